"""The runtime's public functions on a pipeline: its transfer ledger, `release`, and `offload_status`."""

from __future__ import annotations

import dataclasses
from typing import Dict, List, NamedTuple, Optional, Tuple

from ..layout import cannot_move
from ..ledger import TransferLedger
from ..marks import get_session, host_side
from ..constants import OFFLOAD
from ..transfer import ON_DEVICE
from ..recovery.activations import LearntShape
from ..blocks.status import BlockStatus
from . import status_text
from .fast_paths import FastPaths
from .session import session_of
from ..host.account import HostBytes, total
from .host import host_tensors


def _check(pipe) -> None:
    from diffusers import DiffusionPipeline

    if not isinstance(pipe, DiffusionPipeline):
        raise TypeError(f"`pipe` must be a `DiffusionPipeline`, got {pipe!r}.")


def transfer_ledger(pipe) -> TransferLedger:
    """The transfer ledger of `pipe`: every move this extension made of its components.

    Args:
        pipe (`DiffusionPipeline`): The pipeline.

    Returns:
        `TransferLedger`: `.records` (each with `component`, `direction` (`"onload"` or `"offload"`), `nbytes`,
        `call_index`, `kind` and `step`), `.clear()` and `.summary()`.

    Example:

    ```py
    >>> import diffusers_offload_ext as doe

    >>> pipe.enable_model_cpu_offload(keep_on_device_during_generation=True)
    >>> ledger = doe.transfer_ledger(pipe)
    >>> image = pipe("a photo of an astronaut riding a horse on mars").images[0]
    >>> print(ledger.summary()["total_bytes"])
    ```
    """
    _check(pipe)
    return session_of(pipe).ledger


def release(pipe) -> int:
    """Evict every offloaded component of `pipe` from the execution device now.

    Components in `exclude_from_offload` (and the class's `_exclude_from_cpu_offload`, which run without a hook)
    stay. Use it with `keep_on_device_between_generations=True`, for example before another pipeline uses the card.
    Evicted components come back on their own the next time they run. With zero-copy eviction, unchanged components
    are only dropped from the device (no copy back).

    Args:
        pipe (`DiffusionPipeline`): The pipeline.

    Returns:
        `int`: Bytes of component weights evicted (0 when the extension's model offload is not enabled).

    Example:

    ```py
    >>> import diffusers_offload_ext as doe

    >>> pipe.enable_model_cpu_offload(keep_on_device_between_generations=True)
    >>> image = pipe("a photo of an astronaut riding a horse on mars").images[0]
    >>> doe.release(pipe)  # the device is free for something else
    ```
    """
    _check(pipe)
    session = get_session(pipe)
    if session is None or not session.active:
        return 0
    return session.release()


class ComponentStatus(NamedTuple):
    """One component in `OffloadStatus.components`.

    Args:
        nbytes (`int`): Bytes of its parameters and buffers.
        resident (`bool`): On the execution device now.
        where (`str`): Where its tensors are, read from the tensors: `"device"`, `"host"`, `"mixed"`, `"empty"`,
            `"meta"` or `"elsewhere"` (on the plain CPU, where host and device are the same memory, the record).
        role (`str`): `"excluded"` (`exclude_from_offload`), `"round trip"` (the class's `_exclude_from_cpu_offload`),
            `"kept"` (`keep_on_device_during_generation`), `"chain"` or `"outside chain"` (hooked, run outside the
            `model_cpu_offload_seq` chain), `"cannot move"` (bitsandbytes 8-bit: never moved, counted against the
            budget where it was loaded; `why` says why).
        host_copy (`bool`): A host copy is held for an eviction without a copy.
        pinned_bytes (`int`): Bytes of its host memory page-locked (`pin_memory`).
        blocks (`BlockStatus` or `None`): While it streams (it is larger than the room the memory budget leaves it):
            which blocks are resident, which stream, the ring and the bytes streamed per forward; `None` otherwise.
        why (`str`): Why it is where it is, in the options' words (`"kept on the device within memory_budget"`,
            `"evicted (room for transformer); loaded again when it runs"`: the `cause` of its last eviction in the
            ledger); for the role `"cannot move"`, why it cannot.
        host (`HostBytes` or `None`): Under a host budget (`host_memory_budget`), its host memory by kind:
            `page_locked`, `anonymous` (both counted by the budget) and `file_backed` (views of its checkpoint files,
            which the kernel may drop and read again); its host copy while it is on the device. `None` without one.
    """

    nbytes: int
    resident: bool
    where: str
    role: str
    host_copy: bool
    pinned_bytes: int = 0
    blocks: Optional[BlockStatus] = None
    why: str = ""
    host: Optional[HostBytes] = None


class OffloadStatus(NamedTuple):
    """A read-only snapshot of a pipeline's offload (`doe.offload_status(pipe)`).

    Args:
        enabled (`bool`): This extension's model offload is armed.
        device (`str` or `None`): The execution device.
        policy (`str` or `None`): `"chain"` (stock's moves with the two options) or `"residency"` (the manager).
        components (`Dict[str, ComponentStatus]`): Every armed component, and every one that cannot move, in the
            pipeline's order.
        resident_bytes (`int`): Bytes of the components on the device (of a streaming component, its resident blocks
            and its ring).
        budget (`int` or `None`): The residency manager's budget in bytes (`None`: unlimited or not in force).
        chain (`Tuple[str, ...]`): The components of `model_cpu_offload_seq` present, in order, the excluded ones
            included (one still evicts its predecessor when it runs).
        calls (`int`): Pipeline calls started since the session began.
        in_call (`bool`): A pipeline call is in progress.
        recent_calls (`List[Tuple[str, ...]]`): Components used by the last completed calls, oldest first.
        options (`dict`): The options in force.
        pinned_bytes (`int`): Bytes of the components' host memory page-locked (`pin_memory`).
        reserve (`int` or `None`): With the residency manager, what the free memory read before onloads keeps for
            activations (CUDA): the last call shape's learnt reserve, else `memory_reserve` for the automatic budget
            and 0 for an explicit one.
        learnt (`Tuple[LearntShape, ...]`): What each call shape taught (its activations, reserve, budget limit and
            out-of-memory recoveries), oldest first.
        fast_paths (`FastPaths` or `None`): The fast paths in force on the device (`accelerator`, `drops`,
            `page_locked`, `prefetch`) and `why` each is on or off, by option name (`runtime/fast_paths.py`).
        host_budget (`int` or `None`): The host budget in bytes (`host_memory_budget`; `"auto"` read when offload was
            armed), `None` without one.
        host_bytes (`HostBytes` or `None`): Under a host budget, the components' host memory by kind, measured now
            (the staging ring among the page-locked bytes); `.counted` is what the budget counts. `None` without one.
    """

    enabled: bool
    device: Optional[str]
    policy: Optional[str]
    components: Dict[str, ComponentStatus]
    resident_bytes: int
    budget: Optional[int]
    chain: Tuple[str, ...]
    calls: int
    in_call: bool
    recent_calls: List[Tuple[str, ...]]
    options: dict
    pinned_bytes: int = 0
    reserve: Optional[int] = None
    learnt: Tuple[LearntShape, ...] = ()
    fast_paths: Optional[FastPaths] = None
    host_budget: Optional[int] = None
    host_bytes: Optional[HostBytes] = None

    def __str__(self) -> str:
        """A table: the call in force, the budget, and per component where it is, its bytes, blocks and why."""
        return status_text.render(self)


def offload_status(pipe) -> OffloadStatus:
    """What this extension's offload holds for `pipe` now. Reading it changes nothing.

    Args:
        pipe (`DiffusionPipeline`): The pipeline.

    Returns:
        `OffloadStatus`: the device, each component's bytes, placement (read from its tensors) and role, what is
        resident, the budget, the chain and the recent call traces.

    Example:

    ```py
    >>> import diffusers_offload_ext as doe

    >>> pipe.enable_model_cpu_offload(keep_on_device_between_generations=True)
    >>> image = pipe("a cat").images[0]
    >>> status = doe.offload_status(pipe)
    >>> print(status.resident_bytes, [n for n, c in status.components.items() if c.resident])
    ```
    """
    _check(pipe)
    session = get_session(pipe)
    if session is None or session.transfer is None:
        return OffloadStatus(False, None, None, {}, 0, None, (), 0, False, [], {})
    fixed, evicted = session.placement.fixed, _last_evictions(session)
    keeper = host_side(session)
    budgeted = keeper is not None and keeper.plan is not None
    host = keeper.read(host_tensors(session.modules, session.transfer.book)) if budgeted else {}
    components = {
        name: (
            _fixed(session, name)
            if name in fixed
            else _component(session, name, evicted.get(name))._replace(host=host.get(name))
        )
        for name in pipe.components
        if name in session.modules or name in fixed
    }
    options = dataclasses.asdict(session.options)
    return OffloadStatus(
        enabled=session.active,
        device=str(session.device),
        policy=_policy_kind(session.policy),
        components=components,
        resident_bytes=sum(c.blocks.device_bytes if c.blocks else c.nbytes for c in components.values() if c.resident),
        budget=session.budget if session.options.residency else None,
        chain=tuple(session.layout.arrange().chain) if session.layout is not None else (),
        calls=session.calls.started,
        in_call=session.calls.in_call,
        recent_calls=list(session.calls.history),
        options=options,
        pinned_bytes=sum(c.pinned_bytes for c in components.values()),
        reserve=session.arming.reserve if session.options.residency else None,
        learnt=session.activations.status(),
        fast_paths=session.arming.fast if session.arming is not None else None,
        host_budget=keeper.budget if budgeted else None,
        host_bytes=_host_total(host, keeper.ring_bytes) if budgeted else None,
    )


def _host_total(host: Dict[str, HostBytes], ring: int) -> HostBytes:
    """The components' host bytes, the staging ring among the page-locked ones."""
    return total(host).plus(HostBytes(page_locked=ring))


def _policy_kind(policy) -> Optional[str]:
    if policy is None:
        return None
    return getattr(policy, "kind", None) or type(policy).__name__.replace("Policy", "").lower()


def _last_evictions(session) -> Dict[str, Optional[str]]:
    """The `cause` of each component's last offload in the ledger's records."""
    return {r.component: r.cause for r in session.ledger.records if r.direction == OFFLOAD and r.block is None}


def _component(session, name: str, evicted: Optional[str] = None) -> ComponentStatus:
    module, entry = session.modules[name], session.entries[name]
    arrangement = session.arrangement
    if name in arrangement.excluded:
        role = "excluded"
    elif name in arrangement.round_trip:
        role = "round trip"
    elif name in session.options.kept(arrangement.hooked):
        role = "kept"
    else:
        role = "chain" if name in arrangement.chain else "outside chain"
    blocks, resident = session.streams.status(name), name in session.resident
    return ComponentStatus(
        nbytes=session.facts.sizes[name],
        resident=resident,
        where=session.transfer.locate(module),
        role=role,
        host_copy=entry.host_copy is not None,
        pinned_bytes=session.transfer.pinning.bytes_of(module) if session.transfer.pinning is not None else 0,
        blocks=blocks,
        why=(blocks.why if blocks is not None and blocks.why else None)
        or status_text.why(role, resident, blocks is not None, session.options.residency, evicted),
    )


def _fixed(session, name: str) -> ComponentStatus:
    """A component that cannot move: where it was loaded (where tensors cannot tell, on the plain CPU, it runs in the
    one memory there is: on the device)."""
    module = session.placement.fixed[name]
    where = session.transfer.locate(module) if session.transfer.readable else ON_DEVICE
    return ComponentStatus(
        nbytes=session.placement.fixed_sizes()[name],
        resident=where == ON_DEVICE,
        where=where,
        role="cannot move",
        host_copy=False,
        why=cannot_move(module),
    )
