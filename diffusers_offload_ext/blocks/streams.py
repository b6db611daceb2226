"""`BlockStreams`: the components of one pipeline that keep only some of their blocks on the device and stream the
others (the residency policy's `KEEP` moves, or a component larger than the room an out-of-memory recovery leaves
it): their block choices and streamers, what each streamer learned (the order its blocks ran in, how often each ran)
for its next start, and the facts the policy is told of them (`Facts.streaming`, `Facts.kept`)."""

from __future__ import annotations

from typing import Dict, Optional, Set, Tuple

from diffusers.utils import logging

from .adopt import adopt_whole
from .find import find_blocks
from .lessons import StreamLessons
from .status import BlockStatus, KeptFacts, StreamBytes
from .choice import DEPTH, BlockChoice
from .items import block_choice, block_items, kept_choice, stream_room  # noqa: F401 (re-exported)
from .prefetch import blocks_ahead
from .streamer import BlockStreamer
from ..units import format_size

logger = logging.get_logger(f"diffusers.{__name__}")

#: The prefetch depths a stream started by an out-of-memory recovery may take, largest ring first: below the room of
#: a ring of `DEPTH + 1` buffers, one of two (one block prefetched).
RECOVERY_DEPTHS = (DEPTH, 1)


class BlockStreams(StreamLessons):
    """The streaming components of one pipeline.

    Args:
        recorder (`Recorder`): The pipeline's move recorder, told of every block move.
        calls (`CallTracker`): The pipeline's calls: what a stream learns in a call is used by the next calls only
            once the call ended without failing (`end_call`); a failed call leaves the previous plan in force.
    """

    def __init__(self, recorder, calls) -> None:
        self.recorder, self.calls = recorder, calls
        self.active: Dict[str, BlockStreamer] = {}
        self.choices: Dict[str, BlockChoice] = {}
        self.rooms: Dict[str, int] = {}  # name -> the room each active stream was given
        self.built: Dict[str, int] = {}  # name -> its entry's `changes` when it started streaming
        self.learned: Dict[str, tuple] = {}  # name -> (block order, block uses) of its last stream
        self.this_call: Dict[str, tuple] = {}  # the same, learned in the call in progress
        self.said: Set[str] = set()  # components whose streaming (or failure to) was logged
        self.plans: Dict[str, BlockChoice] = {}  # name -> its plan (`choices` shows the ring it holds now)
        self.why: Dict[str, str] = {}  # name -> why it keeps what it keeps (the policy's words)
        #: Whether a stream started now may take a ring smaller than `DEPTH + 1` buffers (an out-of-memory rung).
        self.smaller_rings = False
        #: `Facts.runs`: name -> use index in a call -> the blocks that use ran, as its streams learnt them.
        self.runs: Dict[str, Dict[int, frozenset]] = {}
        self._runs_this_call: Dict[str, Dict[int, frozenset]] = {}
        #: The bytes each streaming component holds on the device (`Facts.streaming`).
        self.held = StreamBytes(self)
        #: The blocks each keeps and the ring it holds (`Facts.kept`).
        self.kept = KeptFacts(self)

    def start(self, name: str, module, room: int, transfer, check: bool) -> Tuple[Optional[BlockChoice], str]:
        """Start streaming component `name` (`module`) within `room` bytes through `transfer` (`check`: fingerprint
        its kept blocks); `(choice, "")`, or `(None, why not)` with nothing changed. Its blocks are weighed by the uses
        they had the last time it streamed. A start that raises (out of device memory) leaves it not streaming."""
        order, uses = self.this_call.get(name) or self.learned.get(name, (None, {}))
        choice, blocks, why = block_choice(module, room, uses, RECOVERY_DEPTHS if self.smaller_rings else (DEPTH,))
        if choice is None:
            return None, why
        self._launch(name, module, blocks, choice, transfer, check, room)
        return choice, ""

    def keep(self, name: str, module, keep, transfer, check: bool, whole: bool = False) -> None:
        """Component `name` (`module`) keeps the blocks `keep.blocks` (a `policies.Keep`) on the device from now on:
        it starts streaming if it did not (its kept blocks copied), else its kept set changes in place
        (`KeptSet.resize`); its ring is held or let go as `keep.ring` says. One on the device `whole` keeps those
        blocks where they are (`adopt.py`)."""
        streamer = self.active.get(name)
        if streamer is None:
            blocks = find_blocks(module)
            choice = kept_choice(blocks, keep.blocks)
            self._launch(name, module, blocks, choice, transfer, check, None, ring=keep.ring, whole=whole)
        else:
            choice = kept_choice(list(streamer.blocks.values()), keep.blocks)
            if set(choice.kept) != {block.name for block in streamer.kept}:
                streamer.resize(set(choice.kept), choice.slot_bytes, choice.slots, keep.ring)
            elif keep.ring:
                streamer.hold_ring()
            else:
                streamer.release_ring()
            self.plans[name] = choice
            self._sync(name)
        self.why[name] = keep.why
        if choice.streamed and name not in self.said:
            self.said.add(name)
            _announce(name, choice, keep.why)

    def _sync(self, name: str) -> None:
        """`choices[name]`: its plan, with the ring it holds now."""
        streamer, plan = self.active[name], self.plans[name]
        self.choices[name] = plan._replace(slots=plan.slots if streamer.ring is not None else 0)

    def _launch(self, name, module, blocks, choice, transfer, check, room, ring: bool = True, whole=False) -> None:
        """Start streaming `name` with plan `choice`; a start that raises leaves it not streaming."""
        order, uses = self.this_call.get(name) or self.learned.get(name, (None, {}))
        if transfer.pinning is not None:
            transfer.pinning.prepare(module, type(module).__name__, transfer.device)

        def emit(block, direction, nbytes, kind):
            self.recorder.finish(self.recorder.begin(name, direction, module), name, direction, nbytes, kind, block)

        streamer = BlockStreamer(
            module,
            blocks,
            choice,
            transfer.device,
            transfer.copier(),
            emit,
            order=order,
            check=check,
            passes=max(uses.values()) if uses else None,
            schedule=blocks_ahead,
            edits_between=lambda: not self.calls.in_call or self.calls.callbacks,
        )
        streamer.holds_ring = ring
        if whole:  # on the device already: its kept blocks stay where they are, the others go home
            streamer.keeper.copies.update(adopt_whole(module, blocks, choice.kept, transfer, check, emit))
        self.active[name], self.plans[name], self.built[name] = streamer, choice, transfer.entry(module).changes
        if room is not None:
            self.rooms[name] = room
        try:
            streamer.start()
        except BaseException:  # the device ran out of memory: the streamer undid its start, nothing streams
            for held in (self.active, self.plans, self.rooms, self.built):
                held.pop(name, None)
            raise
        self._sync(name)
        transfer.record(module, True)

    def begin(self, name: str, module, overflow, transfer, check: bool) -> bool:
        """Run component `name`, larger than the room the budget leaves it (`overflow.limit`), block by block within
        that room (True: the caller records it on the device); where it cannot stream, False, with a warning: the
        caller loads it whole (alone)."""
        choice, why = self.start(name, module, overflow.limit, transfer, check)
        said = name in self.said
        self.said.add(name)
        if choice is not None:
            if not said:
                logger.info(
                    f"`{name}` ({format_size(overflow.nbytes)}) does not fit in the room the memory budget leaves it "
                    f"({format_size(overflow.limit)}): it streams. {len(choice.kept)} of "
                    f"{len(choice.kept) + len(choice.streamed)} blocks stay on the device "
                    f"({format_size(choice.kept_bytes)}), the others pass through {choice.slots} buffers of {format_size(choice.slot_bytes)} as they run."
                )
            return True
        if not said:
            logger.warning(
                f"`{name}` ({format_size(overflow.nbytes)}) does not fit in the memory budget left for offloaded "
                f"components ({format_size(overflow.limit)}) and cannot stream ({why}): every other offloaded "
                f"component was evicted and it runs alone. Raise `memory_budget` (or free device memory)."
            )
        return False

    def stop(self, name: str, transfer) -> None:
        """Component `name` leaves the device: every block back on the host, what was learned kept."""
        streamer = self.active.pop(name)
        try:
            streamer.stop()
        finally:
            self._learn(name, streamer)
            transfer.record(streamer.component, False)

    def abandon(self, name: str) -> None:
        """Component `name`'s weights were moved outside offload: stop streaming it where they are."""
        streamer = self.active.pop(name)
        streamer.settle()
        streamer.abandon()
        self._learn(name, streamer)

    def settle(self) -> None:
        """A call failed: release every streamed block still in a ring (kept blocks stay, consistent)."""
        for streamer in self.active.values():
            streamer.settle()

    def restructured(self, entries) -> list:
        """The streaming components whose structure changed since they started (a sub-module, parameter or buffer
        assigned: `entries`' change counts, which a size read does not reset)."""
        return [name for name in self.active if entries[name].changes != self.built[name]]

    def status(self, name: str) -> Optional[BlockStatus]:
        streamer, choice = self.active.get(name), self.choices.get(name)
        if streamer is None or choice is None:
            return None
        per_pass = sum(streamer.streamed[n].nbytes for n in streamer.order)
        ring = streamer.ring  # read live: a stream may let its ring go, and hold it again
        ring_bytes, slots = (ring.nbytes, len(ring.buffers)) if ring is not None else (0, 0)
        kept = sum(block.nbytes for block in streamer.kept)
        return BlockStatus(
            tuple(b.name for b in streamer.kept),
            tuple(streamer.order),
            ring_bytes,
            slots,
            kept + ring_bytes,
            per_pass,
            self.why.get(name, ""),
        )


def _announce(name: str, choice: BlockChoice, why: str) -> None:
    """One info line, the first time `name` keeps only some of its blocks."""
    logger.info(
        f"`{name}` keeps {len(choice.kept)} of {len(choice.kept) + len(choice.streamed)} blocks on the device "
        f"({format_size(choice.kept_bytes)}) and the others pass through {choice.slots} buffers of "
        f"{format_size(choice.slot_bytes)} as they run: it streams ({why})."
    )
