"""Arming a pipeline: `validate` checks every argument and computes an `Arming` (changing nothing), `arm` has the
pipeline's session adopt it (its components, the transfer, the policy, the hooks), and `unchanged` tells when an
enable with no new option would arm exactly what is armed, so that it can skip all of that."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple

import torch
from diffusers.utils import logging

from ..layout import Arrangement, PipelineLayout, cannot_move, fixed_of, modules_of
from ..marks import STOCK
from ..policies import ChainPolicy, Policy
from ..pinning.prefetch import ChainPrefetchPolicy, PrefetchPolicy
from ..residency.policy import ResidencyPolicy
from ..transfer import BOOK, ON_DEVICE, make_transfer, memory
from ..residency.budget import component_limits, resolve_budget
from .checks import check_pinning, raise_like_stock
from .combined import layout_of, quiet_sub_pipelines
from .devices import resolve_device
from . import fast_paths
from .hook import attach, ours
from . import host as host_plan
from .options import OffloadOptions, resolve_options
from .placement import Sizes
from . import status_text
from .session import Session, session_of

logger = logging.get_logger(f"diffusers.{__name__}")


class Arming(NamedTuple):
    """Everything `arm` needs, computed by `validate` before anything changes (a session stores it once:
    `Session.arming`).

    Args:
        options (`OffloadOptions`): The options in force.
        device (`torch.device`): The execution device; `index` (`int`): its index.
        layout (`PipelineLayout`): The pipeline as model offload sees it; `arrangement` (`Arrangement`): how the
            options arrange it.
        budget (`int` or `None`): The residency manager's budget; `auto_budget` (`bool`): whether it is the
            automatic one.
        user_excluded (`Tuple[str, ...]`): `_exclude_from_cpu_offload` as the user has it.
        fixed (`Tuple[str, ...]`, defaults to `()`): The components that cannot move (`layout.fixed_of`): out of
            the layout, never moved, counted against the budget where they were loaded.
        reserve (`int`): What the free memory read before onloads keeps for activations: the call shape's learnt
            reserve, else `memory_reserve` (automatic budget) or 0 (explicit). `limits` (`Tuple[Tuple[str, int],
            ...]`): the most weights while each component whose activations need more runs (`budget.component_limits`).
        shape (`tuple`): The call shape they were chosen for, with what was learnt then (`learnt_version`).
        fast (`FastPaths`): The fast paths in force on the device, and why (`runtime/fast_paths.py`).
        host (`HostPlan` or `None`): Under a host budget (`host_memory_budget`), its plan (`host/budget.py`): the
            budget, the components to re-map onto their checkpoint files, the staging ring.
    """

    options: OffloadOptions
    device: torch.device
    index: int
    layout: PipelineLayout
    arrangement: Arrangement
    budget: Optional[int]
    auto_budget: bool
    user_excluded: Tuple[str, ...]
    fixed: Tuple[str, ...] = ()
    reserve: int = 0
    limits: Tuple[Tuple[str, int], ...] = ()
    shape: tuple = ()
    learnt_version: int = 0
    fast: fast_paths.FastPaths = fast_paths.NONE
    host: Optional[Any] = None


def validate(pipe, session: Optional[Session], gpu_id, device, **arguments) -> Arming:
    """Check every argument and compute the arming; raises before anything changes."""
    options = resolve_options(
        session.options if session is not None else OffloadOptions(), pipe.components, **arguments
    )
    user_excluded = tuple(session.exclusion.user(pipe) if session is not None else _user_exclusion(pipe))
    layout = layout_of(pipe, class_excluded=user_excluded)
    raise_like_stock(pipe, layout)
    exec_device, index = resolve_device(
        gpu_id, device, getattr(pipe, "_offload_device", None), getattr(pipe, "_offload_gpu_id", None)
    )
    check_pinning(options, exec_device)
    arrangement = layout.arrange(options.exclude_from_offload)
    fixed = tuple(fixed_of(pipe.components))
    fast = fast_paths.resolve(options, exec_device)
    given = arguments.get("host_memory_budget") is not None
    host = host_plan.plan_for(pipe, options, exec_device, layout.order, given)
    arming = Arming(
        options, exec_device, index, layout, arrangement, None, False, user_excluded, fixed, fast=fast, host=host
    )
    if options.residency:
        arming = _budget(pipe, session, arming)
    return arming


def learnt(session: Optional[Session], options: OffloadOptions):
    """`(reserve, reserves, fitted)` for the session's next call shape (`Activations.plan`): its learnt reserve,
    else `memory_reserve` for the automatic budget and 0 for an explicit one; each measured component's reserve; the
    weights that fitted beside each component that ran out of memory."""
    default = options.memory_reserve if options.memory_budget is None else 0
    return session.activations.plan(default) if session is not None else (default, {}, {})


def with_budget(arming: Arming, session: Optional[Session], stays, held: int, fixed=None) -> Arming:
    """`arming` with the budget, reserve and limits for the session's next call shape (`ValueError`: see
    `resolve_budget`); `fixed`: the bytes of the components that cannot move."""
    reserve, reserves, fitted = learnt(session, arming.options)
    budget, auto = resolve_budget(arming.options, arming.device, stays, held, fixed=fixed, reserve=reserve)
    limits = component_limits(arming.device, held, reserves, fitted, sum(stays.values()))
    shape, version = (session.activations.shape, session.activations.version) if session is not None else ((), 0)
    return arming._replace(
        budget=budget, auto_budget=auto, reserve=reserve, limits=limits, shape=shape, learnt_version=version
    )


def _user_exclusion(pipe) -> list:
    return list(getattr(pipe, "_exclude_from_cpu_offload", None) or [])


def _budget(pipe, session: Optional[Session], arming: Arming) -> Arming:
    modules = modules_of(pipe.components)
    sizes = {n: _nbytes(modules[n]) for n in arming.layout.order}
    stays = {n: sizes[n] for n in arming.arrangement.excluded + arming.arrangement.round_trip}
    fixed = {n: _nbytes(m) for n, m in fixed_of(pipe.components).items()}
    # What the pipeline holds on the device: free memory does not count it (nor what cannot move, held there).
    transfer = make_transfer(arming.device)
    held = sum(sizes[n] for n in arming.layout.order if transfer.locate(modules[n]) == ON_DEVICE) + sum(fixed.values())
    return with_budget(arming, session, stays, held, fixed)


def _nbytes(module: torch.nn.Module) -> int:
    entry = BOOK.entry(module)
    if entry.dirty:
        BOOK.refresh(module, entry)
    return entry.nbytes


def arm(pipe, arming: Arming) -> Session:
    """Arm `pipe` with `arming`: the session adopts it, the policy is made, the hooks attached. The moves come after,
    from the caller: `Session.rearm()` for an enable, `Session.end_of_call()` at a call's end."""
    session = session_of(pipe)
    _tell_fixed(pipe, arming, session)
    if arming.options.keeps_nothing and not session.options.keeps_nothing:
        logger.warning(
            "`keep_on_device_during_generation` has no effect with the residency manager on (`memory_budget` or "
            "`keep_on_device_between_generations=True`): the manager evicts only to make room. It stays in force "
            "for when the manager is off; pass `keep_on_device_during_generation=False` to drop it."
        )
    _tell_fast_paths(arming, session)
    quiet_sub_pipelines(pipe)
    before = (session.active, session.arming)
    STOCK["remove_all_hooks"](pipe)
    session.exclusion.restore(pipe)
    host_plan.carry_out(arming.host, pipe, arming.device)
    modules = modules_of(pipe.components, movable=False)
    session.adopt(arming, {name: modules[name] for name in arming.layout.order}, {n: modules[n] for n in arming.fixed})
    host_plan.armed(session)
    session.decide_with(*policy_for(session, arming))
    pipe._offload_gpu_id, pipe._offload_device = arming.index, arming.device
    session.exclusion.apply(pipe, arming.user_excluded, arming.arrangement.excluded)
    session.armed(attach(pipe, session))
    if before != (True, arming):  # a new arming, not the same again
        logger.info(status_text.arming_line(arming, dict(session.facts.sizes), session.placement.fixed_sizes()))
    return session


def _tell_fast_paths(arming: Arming, session: Session) -> None:
    """One warning when an explicit `pin_memory=True` could not be had (the device's self-check failed); one debug line
    of what is on when it changed."""
    fast, before = arming.fast, session.arming.fast if session.arming is not None else None
    if arming.options.pin_memory is True and not fast.page_locked and (before is None or before.page_locked):
        logger.warning(f"`pin_memory=True`: {fast.why['pin_memory']}.")
    if before is None or before[:4] != fast[:4]:
        logger.debug(f"fast paths on {arming.device}: " + "; ".join(f"{k}: {v}" for k, v in fast.why.items()))


def _tell_fixed(pipe, arming: Arming, session: Session) -> None:
    """One log line when an option newly names a component that cannot move: it changes nothing for it."""
    options, before = arming.options, session.options
    named = [n for n in arming.fixed if n in options.exclude_from_offload and n not in before.exclude_from_offload]
    named += [n for n in arming.fixed if n in options.keep and n not in before.keep and n not in named]
    if named:
        one = len(named) == 1
        logger.warning(
            f"{named!r} cannot move ({cannot_move(pipe.components[named[0]])}): `exclude_from_offload` and "
            f"`keep_on_device_during_generation` change nothing for {'it' if one else 'them'}; "
            f"{'it stays where it was' if one else 'they stay where they were'} loaded, out of offload, counted "
            f'against `memory_budget` (role "cannot move" in `doe.offload_status(pipe)`).'
        )


def policy_for(session: Session, arming: Arming) -> Tuple[Policy, Optional[Any]]:
    """`(policy, capacity)` for `session` under `arming`: stock's chain with the two options, or the residency manager
    (the one in force is kept while its configuration is the same: its plans span calls)."""
    options, arrangement, layout = arming.options, arming.arrangement, arming.layout
    prefetches = arming.fast.prefetch and session.transfer.asynchronous
    if not options.residency:
        keep = True if options.keep_all else options.keep
        if not prefetches:
            return ChainPolicy.for_layout(layout, excluded=arrangement.excluded, keep=keep), None
        chain = ChainPrefetchPolicy.for_layout(layout, excluded=arrangement.excluded, keep=keep)
        return chain, memory.capacity(arming.device, options.memory_reserve)
    capacity = memory.capacity(arming.device, arming.reserve)
    kind = PrefetchPolicy if prefetches else ResidencyPolicy
    policy = kind(
        order=layout.order,
        chain=arrangement.chain,
        hooked=arrangement.hooked,
        sizes=dict(Sizes(session.placement, session.transfer)),
        excluded=arrangement.excluded,
        round_trip=arrangement.round_trip,
        budget=None if arming.budget is None else max(arming.budget - session.placement.fixed_bytes(), 0),
        keep_between=options.keep_between,
        calls=session.calls,
        cache=session.forecasts,
        zero_copy=arming.fast.drops,
        dynamic_capacity=capacity is not None,
        limits=dict(arming.limits),
    )
    previous = session.policy
    if isinstance(previous, ResidencyPolicy) and previous.config == policy.config:
        return previous, capacity
    return policy, capacity


def unchanged(pipe, session: Session, gpu_id: Any, device: Any) -> bool:
    """Whether an enable with no new options would arm exactly what is armed: same device, components, exclusions
    and our hooks still attached. Constant work per component; no walk over parameters."""
    if not session.active or (gpu_id is not None and gpu_id != getattr(pipe, "_offload_gpu_id", None)):
        return False
    if device is not None:
        try:
            wanted = torch.device(device)
        except (RuntimeError, TypeError):
            return False
        if wanted.type != session.device.type or (wanted.index is not None and wanted.index != session.device.index):
            return False
    layout = layout_of(pipe, class_excluded=session.exclusion.user(pipe))
    if layout != session.layout or any(pipe.components.get(n) is not m for n, m in session.modules.items()):
        return False
    if list(fixed_of(pipe.components).items()) != list(session.placement.fixed.items()):
        return False
    return all(ours(session.modules[name]) is not None for name in session.arrangement.hooked)


def arm_again(pipe, session: Session, gpu_id: Any = None, device: Any = None) -> None:
    """Offload armed again with no new option (an enable without them, a call's end): where nothing changed, only the
    automatic budget is read again; else the pipeline is validated and armed afresh. The moves are the caller's."""
    if unchanged(pipe, session, gpu_id, device):
        refresh_budget(session)
    else:
        arm(pipe, validate(pipe, session, gpu_id, device))


def refresh_budget(session: Session) -> None:
    """The budget follows free device memory (the automatic one) and what the next call shape taught (its reserve,
    its components' limits): read them again (no walk: sizes are cached) and make a new residency policy only when
    they changed."""
    arming = session.arming
    if arming is None or not arming.options.residency:
        return
    if not arming.auto_budget and not arming.limits and not session.activations.shapes:
        return  # an explicit budget, nothing learnt: nothing to read
    sizes, fixed = session.facts.sizes, session.placement.fixed_sizes()
    stays = {n: sizes[n] for n in arming.arrangement.excluded + arming.arrangement.round_trip}
    streaming = session.placement.streams.held  # a streaming component holds its kept blocks and ring
    held = sum(streaming[n] if n in streaming else sizes[n] for n in session.resident) + sum(fixed.values())
    try:
        fresh = with_budget(arming, session, stays, held, fixed)
    except ValueError:
        return
    if fresh != arming:
        session.decide_with(*policy_for(session, fresh), arming=fresh)


def before_call(session: Session, shape) -> None:
    """A call of `shape` is about to begin: the budget is chosen again when the shape, or what was learnt, is not
    what it was chosen for."""
    session.expect(shape)
    arming = session.arming
    if session.active and not session.calls.in_call and arming is not None and arming.options.residency:
        learnt = (session.activations.shape, session.activations.version)
        if (arming.shape, arming.learnt_version) != learnt and (arming.limits or session.activations.shapes):
            refresh_budget(session)
