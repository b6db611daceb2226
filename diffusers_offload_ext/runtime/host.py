"""The host budget in the runtime: its plan, made with the arming from the pipeline's host bytes (before anything
changes: errors raise there), its re-mapping carried out when offload is armed, and the pipeline's host bytes by kind
measured at each call's end and for `offload_status` (`host/`)."""

from __future__ import annotations

import sys
from typing import Callable, Dict, List, Mapping, Optional

import torch
from diffusers.utils import logging

from ..host import account, budget, files, memory, regions, remap
from ..host.keeper import HostKeeper
from ..marks import HOST_SIDES, host_side
from ..pinning import store as pinned
from ..transfer import BOOK, ON_HOST, Transfer, make_transfer
from ..units import format_size

logger = logging.get_logger(f"diffusers.{__name__}")

ARGUMENT = "host_memory_budget"


def host_tensors(modules: Mapping[str, torch.nn.Module], book=BOOK) -> Dict[str, List[torch.Tensor]]:
    """Each component's host tensors: its weights on the host, and while it is on the device its host copy's."""
    found = {}
    for name, module in modules.items():
        entry = book.get(module)
        copy = entry.host_copy if entry is not None else None
        kept = [host for held in copy.host for host in held.hosts] if copy is not None else []
        found[name] = account.host_tensors(module, kept)
    return found


def holds_of(store) -> Callable[[int], bool]:
    """`holds(pointer)`: whether `store` page-locked the storage at `pointer` (never, without a store)."""
    return store.ranges.holds if store is not None else (lambda pointer: False)


def plan_for(pipe, options, device: torch.device, order, given: bool) -> Optional[budget.HostPlan]:
    """The host plan for `pipe`'s components `order` under `options` (`None` without a host budget). Raises the
    plan's `ValueError` when the budget was `given` in this enable; a budget set before and no longer met (weights
    changed since) is kept, with one warning, rather than failing a call's end."""
    if not options.host_budgeted:
        return None
    if not regions.readable():
        raise ValueError(
            f"`{ARGUMENT}` reads which host memory each weight lies in from Linux's /proc/self/maps, which this "
            f'system ({sys.platform}) does not have. Leave `{ARGUMENT}` unset (or pass "off") here.'
        )
    modules = {name: pipe.components[name] for name in order}
    transfer = make_transfer(device)
    store = pinned.store_for(device)
    measured = account.measure(host_tensors(modules), holds_of(store)).components
    path = getattr(pipe, "name_or_path", None)
    candidates = {
        name: (module, files.folder_of(module, path, name))
        for name, module in modules.items()
        if _at_home(transfer, module)
    }
    stages = store is not None and transfer.readable  # where it is not, the device reads the files in place
    host = memory.read_host()
    try:
        return budget.plan_host(ARGUMENT, options.host_budget, measured, candidates, host, stages)
    except ValueError as error:
        if given:
            raise
        logger.warning(f"{error} The budget stays in force; nothing was re-mapped.")
        try:
            nbytes, auto = budget.resolve(ARGUMENT, options.host_budget, host, 0)
        except ValueError:
            nbytes, auto = host.size, False  # the host shrank below a budget given before: the host bounds it
        counted = account.total(measured).counted
        return budget.HostPlan(nbytes, auto, 0, (), measured, counted)


def _at_home(transfer: Transfer, module: torch.nn.Module) -> bool:
    if not transfer.readable:
        return not transfer.book.entry(module).resident
    return transfer.locate(module) == ON_HOST


def carry_out(plan: Optional[budget.HostPlan], pipe, device: torch.device) -> None:
    """Re-map the components `plan` chose onto their checkpoint files (their page-locked memory, now freed, is let
    go of first); one info line says what."""
    if plan is None or not plan.remaps:
        return
    said = []
    for name, prepared in plan.remaps:
        module = pipe.components[name]
        pinned.unpin(device, [module])
        nbytes = remap.apply(prepared)
        BOOK.refresh(module)
        said.append(f"`{name}` ({format_size(nbytes)})")
    logger.info(
        f"`{ARGUMENT}` ({format_size(plan.budget)}): weights re-mapped onto their safetensors files, no longer held in "
        f"anonymous memory: {', '.join(said)}."
    )


def keeper_of(session) -> HostKeeper:
    """The host side of `session` (made on first use)."""
    keeper = host_side(session)
    if keeper is None:
        keeper = HOST_SIDES[session] = HostKeeper()
    return keeper


def armed(session) -> None:
    """`session` adopted its arming: the host side takes its plan (a staging ring where the device needs one) and
    the transfer onloads file-backed weights through it; the host bytes are measured."""
    arming, transfer = session.arming, session.transfer
    keeper = host_side(session) if arming.host is None else keeper_of(session)
    if keeper is None:
        return
    store = pinned.store_for(arming.device) if arming.host is not None else None
    transfer.host = keeper.adopt(arming.host, store, transfer.streamed, in_place=not transfer.readable)
    after_call(session)


def after_call(session) -> None:
    """A call ended (or offload was armed): under a host budget, the host bytes by kind are measured and kept (what
    changed is said once: `HostKeeper.measure`)."""
    keeper = host_side(session)
    if keeper is not None and keeper.plan is not None and session.transfer is not None:
        keeper.measure(host_tensors(session.modules, session.transfer.book))


def disarmed(session) -> None:
    """Offload's hooks are gone: the staging ring is released (armed again, the plan in force makes another)."""
    keeper = host_side(session)
    if keeper is not None:
        keeper.drop()
        if session.transfer is not None:
            session.transfer.host = None
