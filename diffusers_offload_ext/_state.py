"""The per-pipeline offload state: what is on the device, the policy in force, the ledger and the call trace."""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Set, Tuple

import torch
from diffusers.utils import logging

from ._ledger import (
    COPY,
    OFFLOAD,
    ONLOAD,
    TransferLedger,
    TransferRecord,
    module_nbytes,
)
from ._options import OffloadOptions

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
        self.closing_call = False
        self.saved_exclusion: Optional[Tuple[bool, object]] = None
        self.call_depth = 0
        self.calls_started = 0
        self.call_index: Optional[int] = None
        self.step: Optional[int] = None
        self.trace: List[str] = []
        self.traces: List[Tuple[str, ...]] = []

    # -- what the hooks call ---------------------------------------------------------------------------------
    def on_use(self, name: str) -> None:
        self.trace.append(name)
        moves = self.policy.on_use(name, self.resident)
        if moves:
            self.carry_out(moves)

    def request_offload(self, name: str) -> None:
        if self.policy is not None:
            self.carry_out(self.policy.on_offload_request(name, self.resident))

    # -- moving ------------------------------------------------------------------------------------------------
    def carry_out(self, moves: Iterable[Tuple[str, str]]) -> None:
        for direction, name in moves:
            self.move(name, direction)

    def move(self, name: str, direction: str) -> None:
        """Move one component with a single `.to()` and record it."""
        module = self.modules[name]
        nbytes = module_nbytes(module)
        target = self.device if direction == ONLOAD else HOST
        with torch.profiler.record_function(f"diffusers_offload_ext::{direction}::{name}"):
            module.to(target)
        if direction == ONLOAD:
            self.resident.add(name)
        else:
            self.resident.discard(name)
        self.ledger.append(TransferRecord(name, direction, nbytes, self.call_index, COPY, self.step))
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

    # -- pipeline calls ------------------------------------------------------------------------------------------
    def begin_call(self) -> None:
        self.call_depth += 1
        if self.call_depth == 1:
            self.call_index = self.calls_started
            self.calls_started += 1
            self.trace = []
            self.step = None

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
