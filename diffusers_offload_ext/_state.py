"""The per-pipeline offload state: what is on the device, the policy in force, the ledger and the call trace."""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Set, Tuple

import torch
from diffusers.utils import logging

from ._ledger import (
    COPY,
    DROP,
    OFFLOAD,
    ONLOAD,
    TransferLedger,
    TransferRecord,
    module_nbytes,
)
from ._options import OffloadOptions
from ._residency import format_size
from ._zerocopy import HostCopy

logger = logging.get_logger(__name__)

#: Attribute of the pipeline that holds its `OffloadState`.
STATE_ATTR = "_offload_ext_state"
#: How many completed call traces a pipeline remembers.
TRACE_HISTORY = 8
HOST = torch.device("cpu")


class OffloadState:
    """Everything the extension knows about one pipeline.

    `resident` is the set of component names the extension has put on the execution device. On a real
    accelerator it matches where the parameters are; on the CPU (where host and device are the same memory) it is
    the only record of placement, and the ledger is derived from it.
    """

    def __init__(self) -> None:
        self.ledger = TransferLedger()
        self.options = OffloadOptions()
        self.device: Optional[torch.device] = None
        self.policy = None
        self.modules: Dict[str, torch.nn.Module] = {}
        self.resident: Set[str] = set()
        self.active = False
        self.saved_exclusion: Optional[Tuple[bool, object]] = None
        self.call_depth = 0
        self.calls_started = 0
        self.call_index: Optional[int] = None
        self.step: Optional[int] = None
        self.trace: List[str] = []
        self.traces: List[Tuple[str, ...]] = []
        #: Callables `(name, direction, module, nbytes) -> finish(record)` told about every move (see `doe.trace`).
        self.observers: List = []
        #: Zero-copy eviction: keep host tensors of onloaded components (`HostCopy` per resident component).
        self.zero_copy = False
        self.host_copies: Dict[str, HostCopy] = {}
        #: Value tables of the residency manager, kept across its re-creations.
        self.plan_cache: dict = {}
        #: Components already warned about being larger than the memory budget.
        self.warned_oversize: Set[str] = set()

    # -- what the hooks call ---------------------------------------------------------------------------------
    def on_use(self, name: str) -> None:
        if self.call_depth:  # the trace of the current call (uses outside a call are not predicted from)
            self.trace.append(name)
        moves = self.policy.on_use(name, self.resident)
        if moves:
            self.carry_out(moves)
            overflow = getattr(self.policy, "last_overflow", None)
            if overflow is not None and overflow[0] not in self.warned_oversize:
                self.warned_oversize.add(overflow[0])
                _, nbytes, limit = overflow
                logger.warning(
                    f"`{name}` ({format_size(nbytes)}) does not fit in the memory budget left for offloaded "
                    f"components ({format_size(limit)}): every other offloaded component was evicted and it runs "
                    f"alone. Raise `memory_budget` (or free device memory) to avoid reloading it."
                )

    def request_offload(self, name: str) -> None:
        if self.policy is not None:
            self.carry_out(self.policy.on_offload_request(name, self.resident))

    # -- moving ------------------------------------------------------------------------------------------------
    def carry_out(self, moves: Iterable[Tuple[str, str]]) -> None:
        for direction, name in moves:
            self.move(name, direction)

    def move(self, name: str, direction: str) -> None:
        """Move one component with a single `.to()` and record it.

        With zero-copy eviction on, an onload keeps the host tensors (`HostCopy`), and an offload of a component
        unchanged since its onload puts them back instead of copying (`kind="drop"`, no `.to()`).
        """
        module = self.modules[name]
        nbytes = module_nbytes(module)
        target = self.device if direction == ONLOAD else HOST
        kind = COPY
        finishers = [observer(name, direction, module, nbytes) for observer in self.observers]
        with torch.profiler.record_function(f"diffusers_offload_ext::{direction}::{name}"):
            if direction == ONLOAD:
                # Components that never leave the device (excluded ones) need no host copy: their host memory is
                # freed, as stock frees it.
                keep_host = self.zero_copy and name not in getattr(self.policy, "fixed", ())
                host_copy = HostCopy(module) if keep_host else None
                module.to(target)
                if host_copy is not None:
                    host_copy.seal(module)
                    self.host_copies[name] = host_copy
            else:
                host_copy = self.host_copies.pop(name, None)
                if host_copy is not None and host_copy.unchanged(module):
                    host_copy.restore(module)
                    kind = DROP
                else:
                    # Release the stale host tensors before copying: host memory never exceeds stock's peak.
                    host_copy = None
                    module.to(target)
        if direction == ONLOAD:
            self.resident.add(name)
        else:
            self.resident.discard(name)
        record = TransferRecord(name, direction, nbytes, self.call_index, kind, self.step)
        self.ledger.append(record)
        for finish in finishers:
            finish(record)
        logger.debug(f"{direction} `{name}` ({nbytes} bytes) to {target}")

    def sync_with_placement(self, modules: Dict[str, torch.nn.Module], device: torch.device) -> None:
        """Reconcile `resident` with where the parameters really are, before arming offload on `device`.

        On an accelerator the parameters tell the truth: a module found on the execution device is resident, one
        found on another accelerator is brought back to the host first. On the CPU the record is all there is.
        """
        self.resident &= set(modules)
        for name, module in modules.items():
            where = placement(module)
            if where is None or where.type == "meta":
                continue
            if where.type != "cpu":
                self.resident.add(name)
                if where != device:
                    self.move(name, OFFLOAD)
            elif device.type != "cpu":
                self.resident.discard(name)
        self.forget_host_copies()

    def forget_host_copies(self) -> None:
        """Drop the host copies of components that are no longer on the device (they moved some other way)."""
        for name in [n for n in self.host_copies if n not in self.resident]:
            del self.host_copies[name]

    # -- pipeline calls ------------------------------------------------------------------------------------------
    def begin_call(self) -> None:
        self.call_depth += 1
        if self.call_depth == 1:
            self.call_index = self.calls_started
            self.calls_started += 1
            self.trace = []
            self.step = None
            start = getattr(self.policy, "on_call_start", None)
            if start is not None:
                start(self.traces)

    def end_call(self, failed: bool) -> None:
        self.call_depth -= 1
        if self.call_depth == 0:
            if not failed:
                self.traces.append(tuple(self.trace))
                del self.traces[:-TRACE_HISTORY]
            self.trace = []
            self.call_index = None
            self.step = None


def placement(module: torch.nn.Module) -> Optional[torch.device]:
    """The device of the module's first parameter (or buffer); `None` if it has neither."""
    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    return None


def get_state(pipe) -> Optional[OffloadState]:
    return pipe.__dict__.get(STATE_ATTR)


def ensure_state(pipe) -> OffloadState:
    state = get_state(pipe)
    if state is None:
        state = OffloadState()
        pipe.__dict__[STATE_ATTR] = state
    return state


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
    from diffusers import DiffusionPipeline

    if not isinstance(pipe, DiffusionPipeline):
        raise TypeError(f"`pipe` must be a `DiffusionPipeline`, got {pipe!r}.")
    return ensure_state(pipe).ledger


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
    from diffusers import DiffusionPipeline

    if not isinstance(pipe, DiffusionPipeline):
        raise TypeError(f"`pipe` must be a `DiffusionPipeline`, got {pipe!r}.")
    state = get_state(pipe)
    if state is None or not state.active or state.policy is None:
        return 0
    stay = set(getattr(state.policy, "pinned", ())) | set(getattr(state.policy, "bounce", ()))
    names = [n for n in state.modules if n in state.resident and n not in stay]
    before = len(state.ledger)
    state.carry_out([(OFFLOAD, n) for n in names])
    return sum(record.nbytes for record in state.ledger.records[before:])
