"""`Session`: what the extension does for one pipeline. It tracks the calls, knows the armed components and which are
on the device (the tensors say, where they can), asks the policy at every event, has the transfer carry the decision
out, and reports each move to the ledger and other observers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable, Dict, Iterator, List, Optional, Set

import torch
from diffusers.utils import logging

from ..calls import CallTracker
from ..constants import OFFLOAD, ONLOAD, PREFETCH, STREAM
from ..ledger import TransferLedger, TransferRecord
from ..policies import NOTHING, Decision, Facts, Policy
from ..transfer import MIXED, ON_DEVICE, ON_HOST, Transfer, pinned
from ..transfer.streaming import intact
from . import sharing
from .block_streams import BlockStreams
from .options import OffloadOptions

logger = logging.get_logger(__name__)


class Sizes(Mapping):
    """Current bytes of a session's components, read from the book (a changed component is re-read lazily)."""

    def __init__(self, session: "Session") -> None:
        self._session = session

    def __getitem__(self, name: str) -> int:
        session = self._session
        entry = session.entries[name]
        if entry.dirty:
            session.transfer.book.refresh(session.modules[name], entry)
        return entry.nbytes

    def __iter__(self) -> Iterator[str]:
        return iter(self._session.entries)

    def __len__(self) -> int:
        return len(self._session.entries)


class Session:
    """Everything the extension knows and does for one pipeline (`doe.offload_status(pipe)` shows it read-only).

    Attributes:
        calls (`CallTracker`): The pipeline's calls.
        ledger (`TransferLedger`): Every move made for this pipeline.
        observers (`List[Callable]`): `(component, direction, module) -> finish(record)`, told about every move.
        options (`OffloadOptions`): The options in force.
        device (`torch.device` or `None`): The execution device.
        transfer (`Transfer` or `None`): How this pipeline's components move.
        policy (`Policy` or `None`): Which component moves when.
        modules (`Dict[str, torch.nn.Module]`): The armed components, in the pipeline's order.
        resident (`Set[str]`): Components on the execution device (a streaming one counts: it runs there).
        streams (`BlockStreams`): The components that stream their blocks (larger than the room left them).
        active (`bool`): Offload is enabled (hooks armed).
    """

    def __init__(self) -> None:
        self.calls = CallTracker()
        self.ledger = TransferLedger()
        self.observers: List[Callable] = []
        self.options = OffloadOptions()
        self.device: Optional[torch.device] = None
        self.transfer: Optional[Transfer] = None
        self.policy: Optional[Policy] = None
        self.arming = None
        self.layout = None
        self.arrangement = None
        self.modules: Dict[str, torch.nn.Module] = {}
        self.entries: Dict = {}
        self.hooks: Dict[str, object] = {}
        self.resident: Set[str] = set()
        self.active = False
        #: Whether the tensors say where they are (the transfer's `readable`, kept here for the hot path).
        self.readable = False
        self.budget: Optional[int] = None
        self.auto_budget = False
        self.saved_exclusion = None
        #: Sub-pipelines' `_exclude_from_cpu_offload` as they were before a combined pipeline mirrored its own.
        self.sub_exclusions: list = []
        self.plan_cache: dict = {}
        self.ending = 0
        self.failing = False
        self.streams = BlockStreams(self)
        self.facts = Facts(Sizes(self), can_stream=self.streams.can_stream)
        self._names: Dict[int, str] = {}

    def name_of(self, module: torch.nn.Module) -> Optional[str]:
        """The component name of `module` in this pipeline, or `None`."""
        name = self._names.get(id(module))
        return name if name is not None and self.modules.get(name) is module else None

    # -- the hot path: a hooked component is about to run ---------------------------------------------------------
    def use(self, name: str) -> None:
        entry = self.entries[name]
        dirty = entry.dirty  # a recheck reads its size again
        if name in self.streams.active:
            if dirty or (self.readable and not intact(self.streams.active[name])):
                self.recheck(name)
        elif dirty or (self.readable and self.transfer.is_resident(entry) is not (name in self.resident)):
            self.recheck(name)
        if name not in self.resident and not dirty:
            # About to be loaded, every tensor walked: its size is read again first (a tensor set to `None` or
            # deleted leaves no trace the registration hooks see).
            self.transfer.book.refresh(self.modules[name], entry)
        calls = self.calls
        if calls.depth:
            calls.current.append(name)
        decision = self.policy.on_use(name, self.resident, self.facts)
        if decision is not NOTHING:
            self.carry_out(decision)
        if self.transfer.pending:
            self.transfer.ready(self.modules[name])

    def request_offload(self, name: str) -> None:
        if self.policy is not None and name in self.modules:
            self.carry_out(self.policy.on_offload_request(name, self.resident, self.facts))

    # -- moves ------------------------------------------------------------------------------------------------------
    def carry_out(self, decision: Decision) -> None:
        for direction, name in decision.moves:
            if direction == STREAM:
                if self.streams.begin(name, decision.overflow):
                    placed(self.modules[name], True, self)
            else:
                self.move(name, direction)

    def stop_streams(self) -> None:
        """Every streaming component back on the host (offload is disarmed or armed again)."""
        for name in list(self.streams.active):
            self.move(name, OFFLOAD)

    def move(self, name: str, direction: str) -> None:
        """Move one component through the transfer and record it; every pipeline holding it learns where it is."""
        module = self.modules[name]
        if name in self.streams.active:
            if direction == ONLOAD:
                return  # it runs on the device already, block by block
            self.streams.stop(name)  # each block's move is in the ledger
            placed(module, False, self)
            return
        ahead, direction = direction == PREFETCH, ONLOAD if direction == PREFETCH else direction
        finishers = [observer(name, direction, module) for observer in self.observers]
        with torch.profiler.record_function(f"diffusers_offload_ext::{direction}::{name}"):
            if direction == ONLOAD:
                pinning = self.transfer.pinning is not None
                keep_host = (self.options.drops or pinning) and name not in self.policy.stays
                onload = self.transfer.prefetch if ahead else self.transfer.onload
                moved = onload(module, keep_host=keep_host, check=self.options.drops)
            else:
                moved = self.transfer.offload(module)
        placed(module, direction == ONLOAD, self)
        kind = PREFETCH if ahead else moved.kind
        record = TransferRecord(name, direction, moved.nbytes, self.calls.index, kind, self.calls.step)
        self.ledger.append(record)
        for finish in finishers:
            finish(record)
        logger.debug(f"{direction} `{name}` ({moved.nbytes} bytes, {moved.kind})")
        if direction == ONLOAD:
            for other in sharing.holders(module):
                if other is not self and other.policy is not None:
                    other.carry_out(other.policy.on_shared_load(other.name_of(module), other.resident, other.facts))

    def unpin(self, modules) -> None:
        """Let the page-locked store go of `modules`' host memory (they left offload, or page-locking was turned off);
        the memory itself stays, pageable."""
        store = pinned.existing_store(self.device) if self.device is not None else None
        if store is not None:
            for module in modules:
                store.release(module)

    # -- the truth about placement ----------------------------------------------------------------------------------
    def recheck(self, name: str) -> None:
        """Read where component `name` really is (its structure changed, or its first tensor moved) and bring the
        record in line. A component found partly or wholly off the device is not resident: it will be onloaded
        before it runs, and its host copy is stale."""
        module, entry = self.modules[name], self.entries[name]
        if entry.dirty:
            self.transfer.book.refresh(module, entry)
        if name in self.streams.active:
            if not self.readable or intact(self.streams.active[name]):  # where tensors cannot tell, the record
                return
            logger.debug(f"`{name}` was moved outside offload while it streamed; streaming stops where it is.")
            self.streams.abandon(name)
        where = self.transfer.locate(module)
        if where not in (ON_DEVICE, ON_HOST, MIXED):
            return
        on = where == ON_DEVICE
        if on is not (name in self.resident) or where == MIXED:
            logger.debug(f"`{name}` was found {where} (moved outside offload); the record follows the tensors.")
            placed(module, on, self)
        if not on:
            self.transfer.forget_host_copy(module)

    def reconcile(self) -> None:
        """Before a call: every component's placement checked (constant cost each), and the ones the options keep on
        the device (excluded, round trips) put back there if something moved them."""
        for name in self.modules:
            if self.entries[name].dirty or self.transfer.readable:
                self.recheck(name)
        stays = [n for n in self.modules if n not in self.policy.hooked and n not in self.resident]
        for name in stays:
            self.move(name, ONLOAD)

    def moved_outside(self, target: Optional[torch.device]) -> None:
        """`pipe.to(...)` moved components: read where they are now (or, where tensors cannot tell, take the target
        as the truth); host copies of what left the device are stale."""
        for name, module in self.modules.items():
            if name in self.streams.active:
                self.streams.abandon(name)
            self.entries[name].dirty = True  # a dtype change leaves no other trace
            if self.transfer.readable:
                self.recheck(name)
            elif target is not None:
                on = target == self.device
                self.transfer.record(module, on)
                placed(module, on, self)
            if name not in self.resident:
                self.transfer.forget_host_copy(module)

    # -- calls ------------------------------------------------------------------------------------------------------
    def begin_call(self) -> None:
        if not self.calls.begin():
            return
        sharing.running.append(self)
        if self.active:
            self.reconcile()
            self.carry_out(self.policy.on_call_start(self.calls))

    def end_call(self, failed: bool) -> None:
        if failed:
            self.streams.settle()
        if self.calls.end(failed):
            if self in sharing.running:
                sharing.running.remove(self)

    def end_of_call(self) -> None:
        """Offload is armed again with nothing changed: the end of a call (`maybe_free_model_hooks()`), or an enable
        with the same options. Hooks and policy stay; only the policy's moves are made. A streaming component stops
        first: what stays for the next call is chosen among whole components."""
        self.stop_streams()
        if self.ending and self.calls.in_call and not self.calls.ended:
            self.calls.end_trace(self.failing)
            self.carry_out(self.policy.on_call_end(self.resident, self.facts))
        else:
            self.carry_out(self.policy.on_enable(self.resident, self.facts))


def placed(module: torch.nn.Module, on_device: bool, session: Session) -> None:
    """`module` is now on the device (or not): `session` and every other pipeline holding it update their resident
    sets."""
    for session in {session, *sharing.holders(module)}:
        name = session.name_of(module)
        if name is not None:
            (session.resident.add if on_device else session.resident.discard)(name)
