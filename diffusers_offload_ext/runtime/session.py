"""`Session`: one pipeline's offload state, owned here and written nowhere else. Events come in (offload armed, a call
begins or ends, a component is about to run, a release, a component left, weights moved from outside); the policy
is asked; the transfer carries the decision out; every move is recorded once, in the ledger and to the observers."""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, Optional

import torch
from diffusers.utils import logging

from ..calls import CallTracker
from ..constants import ARMING, END_OF_CALL, KEEP, OFFLOAD, ONLOAD, OUT_OF_MEMORY, PREFETCH, STREAM
from ..ledger import Recorder
from ..marks import SESSION_ATTR, get_session
from ..pinning import store as pinned
from ..policies import Decision, Facts, Policy
from ..recovery.activations import Activations
from ..transfer import Transfer, make_transfer, memory
from . import sharing
from .exclusion import Exclusion
from .options import OffloadOptions
from .placement import Placement, Sizes
from .stream_moves import keep

logger = logging.get_logger(f"diffusers.{__name__}")


class Session:
    """Everything the extension knows and does for one pipeline (`doe.offload_status(pipe)` shows it read-only).

    Attributes:
        calls (`CallTracker`): The pipeline's calls. `recorder` (`Recorder`): its `ledger` and `observers`.
        arming (`Arming` or `None`): What offload is armed with (`options`, `device`, `layout`, `arrangement`,
            `budget`). `transfer` (`Transfer` or `None`): how the components move.
        policy (`Policy` or `None`): Which component moves when; `facts` (`Facts`): what it is told with each event.
        placement (`Placement`): The armed components and where they are (`modules`, `entries`, `resident`,
            `streams`). `hooks`: the hooks armed, by component; `active` (`bool`): they are.
        exclusion (`Exclusion`): The `_exclude_from_cpu_offload` set on the pipeline, and what it replaced.
    """

    def __init__(self) -> None:
        self.calls = CallTracker()
        self.recorder = Recorder(self.calls)
        self.arming = None
        self.transfer: Optional[Transfer] = None
        self.policy: Optional[Policy] = None
        self.placement = Placement(self.recorder, self.calls)
        self.facts = _facts(self.placement)
        self.hooks: Dict[str, object] = {}
        self.exclusion = Exclusion()
        self.forecasts: dict = {}  # the residency policies' value tables, kept across this pipeline's policies
        self.active = False
        self.activations = Activations()  # what each call shape's activations need (`recovery/activations.py`)

    # -- read through ----------------------------------------------------------------------------------------------
    ledger = property(lambda self: self.recorder.ledger)
    observers = property(lambda self: self.recorder.observers)
    options = property(lambda self: self.arming.options if self.arming is not None else OffloadOptions())
    device = property(lambda self: self.arming.device if self.arming is not None else None)
    layout = property(lambda self: self.arming.layout if self.arming is not None else None)
    arrangement = property(lambda self: self.arming.arrangement if self.arming is not None else None)
    budget = property(lambda self: self.arming.budget if self.arming is not None else None)
    modules = property(lambda self: self.placement.modules)
    entries = property(lambda self: self.placement.entries)
    resident = property(lambda self: self.placement.resident)
    readable = property(lambda self: self.placement.readable)
    streams = property(lambda self: self.placement.streams)
    #: `name_of(module)`: the component name of `module` in this pipeline, or `None`.
    name_of = property(lambda self: self.placement.name_of)

    # -- arming -------------------------------------------------------------------------------------------------------
    def adopt(self, arming, modules: Dict[str, torch.nn.Module], fixed: Optional[Dict] = None) -> None:
        """Take `arming` over `modules` as they are now (and `fixed`, those that cannot move): the transfer, where each
        one is, the stream rooms. Then come the policy (`decide_with`), the hooks (`armed`), the moves (`rearm`...)."""
        self.stop_moving()
        self.transfer = self._transfer_for(arming)
        stays = set(arming.arrangement.excluded) | set(arming.arrangement.round_trip)
        going = [m for n, m in self.modules.items() if modules.get(n) is not m or n in stays]
        pinned.unpin(self.device, going if self.transfer.pinning is not None else self.modules.values())  # old device
        self.arming = arming
        for name in self.placement.take(modules, self.transfer, holder=self, fixed=fixed):
            self.move(name, OFFLOAD)  # on another accelerator (the device changed): home first
        self.placement.keep_host_copies(self.transfer, arming.fast.drops, arming.arrangement.excluded)
        self.placement.measure_streams(list(arming.arrangement.hooked) if arming.options.residency else [])

    def decide_with(self, policy: Policy, capacity: Optional[Callable] = None, arming=None) -> None:
        """`policy` decides from now on, told the facts (sizes, `capacity`, stream rooms); `arming` replaces the last."""
        self.arming = arming or self.arming
        self.policy = policy
        self.facts = self.facts._replace(sizes=Sizes(self.placement, self.transfer), capacity=capacity)

    def armed(self, hooks: Dict[str, object]) -> None:
        """The hooks are attached: offload is on."""
        self.hooks, self.active = hooks, True

    def disarm(self, forget_exclusion: bool = False) -> None:
        """The hooks are gone (`remove_all_hooks()`, then `forget_exclusion`; or a combined pipeline armed whole)."""
        self.active = False
        if forget_exclusion and self.arming is not None:  # `exclude_from_offload` ends with them
            self.arming = self.arming._replace(options=self.options.without_exclusion())

    def stop_moving(self) -> None:
        """Every pending prefetch waited on, every streaming component back on the host."""
        if self.transfer is not None:
            self.transfer.flush()
            self.stop_streams()

    # -- events -----------------------------------------------------------------------------------------------------
    def use(self, name: str) -> None:
        """The hot path: hooked component `name` is about to run."""
        placement = self.placement
        entry = placement.entries[name]
        dirty = entry.dirty  # a recheck reads its size again
        if placement.drifted(name, self.transfer):
            if dirty and name in placement.streams.active:
                self.move(name, OFFLOAD)  # its structure changed: it streams again, from its blocks as they are now
            placement.recheck(name, self.transfer)
        if name not in placement.resident and not dirty:
            # About to be loaded, every tensor walked: its size is read again first (a tensor set to `None` or
            # deleted leaves no trace the registration hooks see).
            self.transfer.book.refresh(placement.modules[name], entry)
        if placement.stream_room_stale(name):
            placement.measure_streams([name])  # its blocks changed: so may the room it streams in
        if placement.shared(name):
            self._stop_others_streams(name)  # this pipeline runs it: it places it
        calls = self.calls
        if calls.depth:
            calls.current.append(name)
        activations = self.activations
        if activations.measuring:
            activations.close(self.device)
        decision = self.policy.on_use(name, placement.resident, self.facts)
        if decision.moves:  # `carry_out`, made here: the load's path to `Module.to` stays short
            with self.recorder.evicting(f"room for {name}"):
                for direction, moved in decision.moves:
                    if direction == KEEP:
                        keep(self, moved, decision.kept[moved])
                    else:
                        self.move(moved, direction, decision.overflow)
        if calls.depth:
            self.streams.begin_use(name, calls.current.count(name) - 1)
        if self.transfer.pending:
            self.transfer.ready(placement.modules[name])
        if activations.measuring:
            activations.open(self.device, self.held_bytes, name)

    def request_offload(self, name: str) -> None:
        """Pipeline code called the component's `hook.offload()`."""
        if self.policy is not None and name in self.modules:
            self.carry_out(self.policy.on_offload_request(name, self.resident, self.facts), "offload requested")

    def release(self) -> int:
        """`doe.release(pipe)`: every offloaded component evicted now; returns the bytes evicted."""
        self.placement.recheck_all(self.transfer)
        before = len(self.ledger)
        self.carry_out(self.policy.on_release(self.resident, self.facts), "release")
        return sum(record.nbytes for record in self.ledger.records[before:])

    def component_left(self, name: str, module: torch.nn.Module) -> None:
        """Component `name` was replaced or unregistered: it leaves the device unless another armed pipeline holds
        it, and this session stops holding it (the pipeline is armed again at its next call)."""
        others = [s for s in sharing.holders(module) if s is not self]
        if name in self.resident and not others and self.transfer is not None:
            self.move(name, OFFLOAD)
        sharing.leave(self, module)
        self.placement.left(name)

    def moved_outside(self, target: Optional[torch.device]) -> None:
        """`pipe.to(...)` moved components (see `Placement.moved_outside`)."""
        self.placement.moved_outside(target, self.transfer)

    def begin_call(self, callbacks: bool = True) -> None:
        """A pipeline call begins (`callbacks`: with a step callback): placements checked, the ones kept put back."""
        if not self.calls.begin(callbacks):
            return
        sharing.running.append(self)
        if not self.active:
            return
        for name in self.streams.restructured(self.entries):
            self.move(name, OFFLOAD)  # its structure changed between calls: it streams again from its blocks now
        self.placement.recheck_all(self.transfer)
        for name in [n for n in self.modules if n not in self.policy.hooked and n not in self.resident]:
            self.move(name, ONLOAD)
        self.carry_out(self.policy.on_call_start(self.calls), "call start")

    def end_of_call(self, failed: bool) -> None:
        """The end of the call in progress, once per call (`maybe_free_model_hooks()`, or the call guard when the call
        returned or raised without it): streams stop unless components stay between calls, the policy's end-of-call
        moves are made; unless it `failed`, its trace joins the history and its streams' lessons (`_end_streams`)."""
        self.calls.end_trace(failed)
        self.activations.end(self.device, failed)
        if self.hooks:
            with self.recorder.evicting(END_OF_CALL):
                self._end_streams(failed)
            self.carry_out(self.policy.on_call_end(self.resident, self.facts), END_OF_CALL)
        self.streams.end_call(failed)

    def rearm(self) -> None:
        """Offload armed again, not at a call's end (an enable; `maybe_free_model_hooks()` outside a call or after its
        end): streaming components stop, then the policy's arming moves."""
        self.stop_streams()
        self.carry_out(self.policy.on_enable(self.resident, self.facts), ARMING[self.options.residency])

    def leave_call(self, failed: bool) -> None:
        """A pipeline call returned or raised, its end already made."""
        if failed:
            self.streams.settle()
        if self.calls.end(failed) and self in sharing.running:
            sharing.running.remove(self)

    # -- moves ------------------------------------------------------------------------------------------------------
    def carry_out(self, decision: Decision, cause: Optional[str] = None) -> None:
        """The moves of `decision`, in order; its offloads' `cause` in the ledger."""
        with self.recorder.evicting(cause):
            for direction, name in decision.moves:
                if direction == KEEP:
                    keep(self, name, decision.kept[name])
                else:
                    self.move(name, direction, decision.overflow)

    def stop_streams(self) -> None:
        """Every streaming component back on the host."""
        for name in list(self.streams.active):
            self.move(name, OFFLOAD)

    def move(self, name: str, direction: str, overflow=None) -> None:
        """Move component `name` (`ONLOAD`, `OFFLOAD`, `PREFETCH`, or `STREAM` within `overflow.limit`) through the
        transfer and record it once; every pipeline holding it learns where it is."""
        module = self.modules[name]
        if direction == STREAM:
            if self.streams.begin(name, module, overflow, self.transfer, self.arming.fast.drops):
                return self.placement.placed(module, True)
            direction = ONLOAD  # it cannot stream: loaded whole, alone
        if name in self.streams.active:
            return self._stop_stream(name, direction)
        if self._stop_others_streams(name) and direction == OFFLOAD:
            return  # it streamed for another pipeline sharing it: that stream sent it home
        ahead, direction = direction == PREFETCH, ONLOAD if direction == PREFETCH else direction
        booker = self._booker(module)
        booked, recorder = booker.name_of(module) or name, booker.recorder
        began = recorder.begin(booked, direction, module)
        with torch.profiler.record_function(f"diffusers_offload_ext::{direction}::{name}"):
            if direction == ONLOAD:
                load = self.transfer.prefetch if ahead else self.transfer.onload
                moved = load(module, keep_host=self._keeps_host(name), check=self.arming.fast.drops)
            else:
                moved = self.transfer.offload(module)
        self.placement.placed(module, direction == ONLOAD)
        record = recorder.finish(began, booked, direction, moved.nbytes, PREFETCH if ahead else moved.kind)
        logger.debug(f"{direction} `{name}` ({record.nbytes} bytes, {record.kind})")
        if direction == ONLOAD:
            self._others_make_room(module)

    def _keeps_host(self, name: str) -> bool:
        """An onload of `name` keeps its host copy where an eviction may drop it (or page-locked host memory is kept),
        unless the component never leaves the device."""
        return (self.arming.fast.drops or self.transfer.pinning is not None) and name not in self.policy.stays

    def _booker(self, module: torch.nn.Module) -> "Session":
        """The session whose ledger records a move of `module` made here: that of the innermost pipeline call running
        that holds it (its call made the move, even where another pipeline's budget chose it), else this one."""
        holder = sharing.running_holder(module) if sharing.running else None
        return self if holder is None else holder

    def _others_make_room(self, module: torch.nn.Module) -> None:
        """This session put `module` on the device: every other pipeline holding it makes room for it if it must."""
        for other in sharing.holders(module):
            if other is not self and other.policy is not None:
                other.carry_out(other.policy.on_shared_load(other.name_of(module), other.resident, other.facts))

    def _end_streams(self, failed: bool) -> None:
        """A call ends: streams stop, unless components stay between calls; then their rings are emptied, and those
        that would keep other blocks now (`BlockStreams.replanned`; not after a failed call) stop, to start again."""
        if not self.options.keep_between:
            self.stop_streams()
            return
        self.streams.settle()
        for name in [] if failed else self.streams.replanned():
            self.move(name, OFFLOAD)

    def _stop_stream(self, name: str, direction: str) -> None:
        """`name` streams for this session: an onload leaves it so (it runs on the device already, block by block);
        any other move stops the stream (each block's move is in the ledger)."""
        if direction != ONLOAD:
            self.streams.stop(name, self.transfer)
            self.placement.placed(self.modules[name], False)

    def _stop_others_streams(self, name: str) -> bool:
        """This session runs or moves its component `name`: where another pipeline sharing it keeps it streaming, that
        stream stops first (into that pipeline's ledger), and this session places it by its own policy. Whether one
        stopped."""
        if name in self.streams.active or not self.placement.shared(name):
            return False
        module, stopped = self.modules[name], False
        for other in sharing.holders(module):
            theirs = other.name_of(module) if other is not self else None
            if theirs is not None and theirs in other.streams.active:
                other.streams.unlearn(theirs)  # not a pass of its own calls: its plan stays
                other.move(theirs, OFFLOAD)
                stopped = True
        return stopped

    def _transfer_for(self, arming) -> Transfer:
        """The transfer for `arming`'s device and options: the one in force where it fits; on another device, what
        this session put on the old one goes home first."""
        transfer = self.transfer
        if transfer is not None and self.device != arming.device:
            for name in sorted(self.resident & set(self.modules)):
                self.move(name, OFFLOAD)
            transfer = None
        overlaps = arming.fast.prefetch  # only where the device has a copy stream (`fast_paths.resolve`)
        if transfer is None or transfer.asynchronous != overlaps:
            transfer = make_transfer(arming.device, prefetch=overlaps)
        transfer.pinning = pinned.store_for(arming.device) if arming.fast.page_locked else None
        return transfer

    # -- what calls need beyond the weights, and out-of-memory recovery ------------------------------------------------
    def expect(self, shape) -> None:
        """The next pipeline call has `shape` (`activations.call_shape`): its budget is chosen for it, and what it
        needs beyond the weights is measured from now on where the device tells."""
        if not self.calls.in_call:
            self.activations.expect(shape)
            if self.active:
                self.activations.begin(self.device, self.held_bytes())

    def held_bytes(self) -> int:
        """Bytes of this pipeline's weights on the device (of a streaming component, its kept blocks and ring)."""
        choices, sizes = self.streams.choices, self.facts.sizes
        return sum(choices[n].device_bytes if n in choices else sizes[n] for n in self.resident)

    def carry_out_rung(self, decision: Decision) -> None:
        """Carry out a rung of an out-of-memory recovery (`recovery/guard.py`), each move recorded with cause
        `"out-of-memory"` (a move that runs out of memory itself ends the rung), then give what it freed back."""
        self.activations.close(self.device)
        with contextlib.ExitStack() as causes:
            # The ledger that books a move of a shared component may be another running call's (`_booker`).
            for recorder in {id(s.recorder): s.recorder for s in [self] + sharing.running}.values():
                causes.enter_context(recorder.caused(OUT_OF_MEMORY))
            self.streams.settle()
            self.streams.smaller_rings = True  # its last rungs stream in less than a ring of three buffers
            try:
                self.carry_out(decision)
            except torch.OutOfMemoryError:
                logger.debug("A rung of an out-of-memory recovery ran out of device memory itself.")
            finally:
                self.streams.smaller_rings = False
        memory.release_cached(self.device)
        self.activations.open(self.device, self.held_bytes())

    def recovered(self, name: str, failed_held: int) -> None:
        """Component `name` ran again after an out-of-memory error (with `failed_held` bytes of weights on the device
        when it failed) and completed: what the device holds now fitted beside its activations. The call shape
        learns it, and the residency manager allows no more while `name` runs, from now on (the explicit
        `memory_budget` stays the cap)."""
        held = self.held_bytes()
        allowed = getattr(self.policy, "allowed", lambda _: None)(name)
        self.activations.recovered(name, held, within=allowed is None or failed_held <= allowed)
        if hasattr(self.policy, "limit_while"):
            self.policy.limit_while(name, held)


def _facts(placement: Placement) -> Facts:
    """What the policy is told with each event, read live from `placement` (sizes once armed: `decide_with`)."""
    streams = placement.streams
    return Facts(
        Sizes(placement, None),
        None,
        placement.stream_rooms,
        streams.held,
        placement.block_facts,
        streams.kept,
        streams.runs,
    )


def session_of(pipe) -> Session:
    """The session of `pipe`, made (and left on the pipeline) if it has none."""
    session = get_session(pipe)
    if session is None:
        session = pipe.__dict__[SESSION_ATTR] = Session()
    return session
