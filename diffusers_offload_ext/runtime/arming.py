"""Arming a pipeline: validate everything first (`validate`, which changes nothing), then place the components, make
the policy and attach the hooks (`arm`); and the check that lets an unchanged re-enable skip all of it."""

from __future__ import annotations

from typing import Any, List, NamedTuple, Optional, Tuple

import torch
from accelerate.hooks import add_hook_to_module, remove_hook_from_module
from diffusers import DiffusionPipeline

from ..constants import OFFLOAD
from ..layout import Arrangement, PipelineLayout, modules_of
from ..policies import ChainPolicy, Facts, PrefetchPolicy, ResidencyPolicy
from ..transfer import ELSEWHERE, MIXED, ON_DEVICE, BOOK, STREAMED, make_transfer, memory, pinned
from . import sharing
from .checks import check_pinning, raise_like_stock
from .hook import DeferredCpuOffload, OffloadHandle, ours
from .devices import resolve_device
from .options import OffloadOptions, resolve_budget, resolve_options
from .overrides import layout_of, mirror_exclusion, quiet_sub_pipelines, restore_mirrored
from .session import Session, Sizes

#: Attribute of the pipeline (in its `__dict__`) that holds its `Session`.
SESSION_ATTR = "_offload_ext_session"
#: Marks a function of ours that replaced a `DiffusionPipeline` method or wraps a `__call__`.
MARK = "__offload_ext_wraps__"

#: Stock's methods, captured before `install()` can replace them.
STOCK = {
    name: getattr(DiffusionPipeline.__dict__[name], MARK, DiffusionPipeline.__dict__[name])
    for name in (
        "enable_model_cpu_offload",
        "remove_all_hooks",
        "to",
        "maybe_free_model_hooks",
        "progress_bar",
        "__setattr__",
    )
}


class Arming(NamedTuple):
    """Everything `arm` needs, computed by `validate` before anything changes."""

    options: OffloadOptions
    device: torch.device
    index: int
    layout: PipelineLayout
    arrangement: Arrangement
    budget: Optional[int]
    auto_budget: bool
    user_excluded: Tuple[str, ...]


def get_session(pipe) -> Optional[Session]:
    return pipe.__dict__.get(SESSION_ATTR)


def ensure_session(pipe) -> Session:
    session = get_session(pipe)
    if session is None:
        session = pipe.__dict__[SESSION_ATTR] = Session()
    return session


def user_exclusion(pipe, session: Optional[Session]) -> List[str]:
    """`_exclude_from_cpu_offload` as the user has it, without this extension's instance-level additions."""
    if session is not None and session.saved_exclusion is not None:
        had_instance_value, value = session.saved_exclusion
        if not had_instance_value:
            value = getattr(type(pipe), "_exclude_from_cpu_offload", None)
        return list(value or [])
    return list(getattr(pipe, "_exclude_from_cpu_offload", None) or [])


def restore_exclusion(pipe, session: Session) -> None:
    """Undo our instance-level `_exclude_from_cpu_offload`, leaving what the user had set."""
    restore_mirrored(session.sub_exclusions)
    session.sub_exclusions = []
    if session.saved_exclusion is None:
        return
    had_instance_value, value = session.saved_exclusion
    session.saved_exclusion = None
    if had_instance_value:
        pipe.__dict__["_exclude_from_cpu_offload"] = value
    else:
        pipe.__dict__.pop("_exclude_from_cpu_offload", None)


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
    layout = layout_of(pipe, class_excluded=user_exclusion(pipe, session))
    if layout != session.layout or any(pipe.components.get(n) is not m for n, m in session.modules.items()):
        return False
    return all(ours(session.modules[name]) is not None for name in session.arrangement.hooked)


def validate(pipe, session: Optional[Session], gpu_id, device, **arguments) -> Arming:
    """Check every argument and compute the arming; raises before anything changes."""
    options = resolve_options(
        session.options if session is not None else OffloadOptions(), pipe.components, **arguments
    )
    user_excluded = tuple(user_exclusion(pipe, session))
    layout = layout_of(pipe, class_excluded=user_excluded)
    raise_like_stock(pipe, layout)
    exec_device, index = resolve_device(
        gpu_id, device, getattr(pipe, "_offload_device", None), getattr(pipe, "_offload_gpu_id", None)
    )
    check_pinning(options, exec_device)
    arrangement = layout.arrange(options.exclude_from_offload)
    budget, auto = None, False
    if options.residency:
        budget, auto = _budget(pipe, options, layout, arrangement, exec_device)
    return Arming(options, exec_device, index, layout, arrangement, budget, auto, user_excluded)


def _budget(pipe, options, layout, arrangement, device) -> Tuple[Optional[int], bool]:
    modules = modules_of(pipe.components)
    sizes = {n: _nbytes(modules[n]) for n in layout.order}
    stays = {n: sizes[n] for n in arrangement.excluded + arrangement.round_trip}
    # What the pipeline holds on the device: free memory does not count it.
    transfer = make_transfer(device)
    held = sum(sizes[n] for n in layout.order if transfer.locate(modules[n]) == ON_DEVICE)
    return resolve_budget(options, device, stays, held)


def _nbytes(module: torch.nn.Module) -> int:
    entry = BOOK.entry(module)
    if entry.dirty:
        BOOK.refresh(module, entry)
    return entry.nbytes


def arm(pipe, arming: Arming) -> None:
    """Place the components as the options say, make the policy, attach the hooks."""
    session = ensure_session(pipe)
    quiet_sub_pipelines(pipe)
    STOCK["remove_all_hooks"](pipe)
    restore_exclusion(pipe, session)
    if session.transfer is not None:
        session.transfer.flush()
        session.stop_streams()
    if session.transfer is not None and session.device != arming.device:
        # Everything this pipeline put on the old device goes home first.
        for name in sorted(session.resident & set(session.modules)):
            session.move(name, OFFLOAD)
        session.transfer = None
    streamed = arming.options.prefetch and arming.device.type in STREAMED
    if session.transfer is None or session.transfer.asynchronous != streamed:
        session.transfer = make_transfer(arming.device, prefetch=streamed)
    session.readable = session.transfer.readable
    pinning = arming.options.pin_memory is not False
    session.transfer.pinning = pinned.store_for(arming.device) if pinning else None
    _adopt(session, pipe, arming)
    session.policy = _policy(session, arming)
    _end_or_arm(session)
    excluded = list(arming.arrangement.excluded)
    if excluded:
        had = "_exclude_from_cpu_offload" in pipe.__dict__
        session.saved_exclusion = (had, pipe.__dict__.get("_exclude_from_cpu_offload"))
        pipe.__dict__["_exclude_from_cpu_offload"] = list(dict.fromkeys([*arming.user_excluded, *excluded]))
        session.sub_exclusions = mirror_exclusion(pipe, excluded)
    _attach(pipe, session)
    session.active = True


def _adopt(session: Session, pipe, arming: Arming) -> None:
    """Take the pipeline's components as they are now: which ones left, where each one really is."""
    modules = modules_of(pipe.components)
    modules = {name: modules[name] for name in arming.layout.order}
    stays = set(arming.arrangement.excluded) | set(arming.arrangement.round_trip)
    pins_go = [m for n, m in session.modules.items() if modules.get(n) is not m or n in stays]
    for name, module in session.modules.items():
        if modules.get(name) is not module:
            sharing.leave(session, module)
    session.unpin(pins_go if session.transfer.pinning is not None else session.modules.values())
    transfer = session.transfer
    session.modules = modules
    session.entries = {name: transfer.entry(module) for name, module in modules.items()}
    session._names = {id(module): name for name, module in modules.items()}
    session.arming = arming
    session.device, session.options = arming.device, arming.options
    session.layout, session.arrangement = arming.layout, arming.arrangement
    session.budget, session.auto_budget = arming.budget, arming.auto_budget
    pipe._offload_gpu_id, pipe._offload_device = arming.index, arming.device
    session.resident = set()
    for name, module in modules.items():
        sharing.join(session, module)
        where = transfer.locate(module)
        if where == ON_DEVICE:
            session.resident.add(name)
        elif where == ELSEWHERE:
            # On another accelerator (the device changed): bring it home first.
            session.resident.add(name)
            session.move(name, OFFLOAD)
        elif where == MIXED:
            transfer.forget_host_copy(module)
    zero_copy = arming.options.drops
    for name, module in modules.items():
        if name not in session.resident or not zero_copy or name in arming.arrangement.excluded:
            transfer.forget_host_copy(module)


def _policy(session: Session, arming: Arming):
    options, arrangement, layout = arming.options, arming.arrangement, arming.layout
    capacity = None
    if options.residency:
        capacity = memory.capacity(arming.device, options.memory_reserve if arming.auto_budget else 0)
    session.facts = Facts(Sizes(session), capacity, session.streams.can_stream)
    if not options.residency:
        keep = True if options.keep_all else options.keep
        return ChainPolicy.for_layout(layout, excluded=arrangement.excluded, keep=keep)
    kind = PrefetchPolicy if options.prefetch and session.transfer.asynchronous else ResidencyPolicy
    policy = kind(
        order=layout.order,
        chain=arrangement.chain,
        hooked=arrangement.hooked,
        sizes=dict(session.facts.sizes),
        excluded=arrangement.excluded,
        round_trip=arrangement.round_trip,
        budget=arming.budget,
        keep_between=options.keep_between,
        calls=session.calls,
        cache=session.plan_cache,
        zero_copy=options.drops,
        dynamic_capacity=capacity is not None,
    )
    previous = session.policy
    if isinstance(previous, ResidencyPolicy) and previous.config == policy.config:
        return previous
    return policy


def _end_or_arm(session: Session) -> None:
    """The moves of arming: at the end of a call (`maybe_free_model_hooks()`), the policy's end-of-call moves after
    the call's trace joins the history; otherwise the policy's arming moves."""
    if session.ending and session.calls.in_call and not session.calls.ended:
        session.calls.end_trace(session.failing)
        session.carry_out(session.policy.on_call_end(session.resident, session.facts))
    else:
        session.carry_out(session.policy.on_enable(session.resident, session.facts))


def _attach(pipe, session: Session) -> None:
    handles: List[OffloadHandle] = []
    previous = None
    chain = session.arrangement.chain
    session.hooks = {}
    watched = session.policy.watched  # the policy hears when these run; nothing offloads them
    for name in session.arrangement.hooked + tuple(n for n in session.layout.order if n in watched):
        module = session.modules[name]
        hook = DeferredCpuOffload(session, name, session.device, prev_module_hook=previous if name in chain else None)
        add_hook_to_module(module, hook, append=True)
        session.hooks[name] = hook
        if name in watched:
            continue
        handle = OffloadHandle(module, hook)
        handles.append(handle)
        if name in chain:
            previous = handle
    pipe._all_hooks = handles


def component_left(pipe, session: Session, name: str, module: torch.nn.Module) -> None:
    """Component `name` was replaced or unregistered: the extension stops holding `module` (its hook goes, and it
    leaves the device unless another armed pipeline holds it). The pipeline is armed again at its next call."""
    hook = getattr(module, "_hf_hook", None)
    if isinstance(hook, DeferredCpuOffload) and hook.session is session:
        remove_hook_from_module(module)
    others = [s for s in sharing.holders(module) if s is not session]
    if name in session.resident and not others and session.transfer is not None:
        session.move(name, OFFLOAD)
    sharing.leave(session, module)
    session.resident.discard(name)


def refresh_budget(session: Session) -> None:
    """The automatic budget follows free device memory: read it again (no walk: sizes are cached) and make a new
    residency policy only when it changed."""
    arming = session.arming
    if arming is None or not arming.auto_budget:
        return
    sizes = session.facts.sizes
    stays = {n: sizes[n] for n in arming.arrangement.excluded + arming.arrangement.round_trip}
    held = sum(sizes[n] for n in session.resident)
    try:
        budget, _ = resolve_budget(arming.options, arming.device, stays, held)
    except ValueError:
        return
    if budget != arming.budget:
        session.arming = arming._replace(budget=budget)
        session.budget = budget
        session.policy = _policy(session, session.arming)
