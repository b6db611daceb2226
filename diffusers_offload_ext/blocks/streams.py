"""`BlockStreams`: the components of one pipeline that keep only some of their blocks on the device and stream the
others (the residency policy's `KEEP` moves, or a component larger than the room an out-of-memory recovery leaves
it): their block choices and streamers, what each streamer learned (the order its blocks ran in, how often each ran)
for its next start, and the facts the policy is told of them (`Facts.streaming`, `Facts.kept`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable, Dict, Iterator, NamedTuple, Optional, Set, Tuple

from diffusers.utils import logging

from .adopt import adopt_whole
from .find import find_blocks
from .choice import BlockChoice
from .items import block_choice, block_items, kept_choice, stream_room  # noqa: F401 (re-exported)
from .prefetch import blocks_ahead
from .streamer import BlockStreamer
from ..units import format_size

logger = logging.get_logger(f"diffusers.{__name__}")


class BlockStatus(NamedTuple):
    """How a streaming component runs (`ComponentStatus.blocks`).

    Args:
        resident (`Tuple[str, ...]`): Its blocks kept on the device while it streams (`"<rest>"` is what no repeated
            block holds: embeddings, norms, projections).
        streamed (`Tuple[str, ...]`): Its blocks copied into the ring just before they run, in the order they ran.
        ring_bytes (`int`): Bytes of the ring of device buffers they pass through (`slots` of `slot_bytes`).
        slots (`int`): Ring buffers: the running block and those prefetched ahead.
        device_bytes (`int`): Bytes it holds on the device: the resident blocks and the ring.
        bytes_per_pass (`int`): Bytes streamed by one forward (one denoising step, for a denoiser).
        why (`str`): Why these blocks are kept and those stream, in words (the residency policy's reason).
    """

    resident: Tuple[str, ...]
    streamed: Tuple[str, ...]
    ring_bytes: int
    slots: int
    device_bytes: int
    bytes_per_pass: int
    why: str = ""


class StreamBytes(Mapping):
    """The bytes each streaming component of `streams` holds on the device, its kept blocks and ring: what the
    policy counts for it while it is resident (`Facts.streaming`), read live."""

    def __init__(self, streams: "BlockStreams") -> None:
        self._choices = streams.choices

    def __getitem__(self, name: str) -> int:
        return self._choices[name].device_bytes

    def __iter__(self) -> Iterator[str]:
        return iter(self._choices)

    def __len__(self) -> int:
        return len(self._choices)


class KeptFacts(Mapping):
    """For each streaming component of `streams`, the blocks it keeps and the bytes of the ring it holds
    (`Facts.kept`), read live."""

    def __init__(self, streams: "BlockStreams") -> None:
        self._streams = streams

    def __getitem__(self, name: str) -> tuple:
        choice = self._streams.choices[name]
        return frozenset(choice.kept), choice.ring_bytes

    def __iter__(self) -> Iterator[str]:
        return iter(self._streams.choices)

    def __len__(self) -> int:
        return len(self._streams.choices)


class BlockStreams:
    """The streaming components of one pipeline.

    Args:
        record (`Callable`): The pipeline's move recorder (`Recorder.record`), told of every block move.
        calls (`CallTracker`): The pipeline's calls: what a stream learns in a call is used by the next calls only
            once the call ended without failing (`end_call`); a failed call leaves the previous plan in force.
    """

    def __init__(self, record: Callable, calls) -> None:
        self.record, self.calls = record, calls
        self.active: Dict[str, BlockStreamer] = {}
        self.choices: Dict[str, BlockChoice] = {}
        self.rooms: Dict[str, int] = {}  # name -> the room each active stream was given
        self.built: Dict[str, int] = {}  # name -> its entry's `changes` when it started streaming
        self.learned: Dict[str, tuple] = {}  # name -> (block order, block uses) of its last stream
        self.this_call: Dict[str, tuple] = {}  # the same, learned in the call in progress
        self.said: Set[str] = set()  # components whose streaming (or failure to) was logged
        self.plans: Dict[str, BlockChoice] = {}  # name -> its plan (`choices` shows the ring it holds now)
        self.why: Dict[str, str] = {}  # name -> why it keeps what it keeps (the policy's words)
        #: The bytes each streaming component holds on the device (`Facts.streaming`).
        self.held = StreamBytes(self)
        #: The blocks each keeps and the ring it holds (`Facts.kept`).
        self.kept = KeptFacts(self)

    def start(self, name: str, module, room: int, transfer, check: bool) -> Tuple[Optional[BlockChoice], str]:
        """Start streaming component `name` (`module`) within `room` bytes through `transfer` (`check`: fingerprint
        its kept blocks); `(choice, "")`, or `(None, why not)` with nothing changed. Its blocks are weighed by the uses
        they had the last time it streamed. A start that raises (out of device memory) leaves it not streaming."""
        order, uses = self.this_call.get(name) or self.learned.get(name, (None, {}))
        choice, blocks, why = block_choice(module, room, uses)
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
            transfer.pinning.prepare(module, type(module).__name__)

        def emit(block, direction, nbytes, kind):
            self.record(name, direction, module, lambda: (nbytes, kind), block)

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
                    f"{len(choice.kept) + len(choice.streamed)} blocks stay on the device ({format_size(choice.kept_bytes)}), "
                    f"the others pass through {choice.slots} buffers of {format_size(choice.slot_bytes)} as they run."
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

    def unlearn(self, name: str) -> None:
        """What component `name`'s stream counted since its last call's end ran for another pipeline sharing it."""
        streamer = self.active[name]
        streamer.uses = dict.fromkeys(streamer.uses, 0)

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

    def replanned(self) -> list:
        """The streams that, weighed by the uses their blocks had in this call, would keep other blocks (or size their
        ring otherwise) within the room they were given: started without knowing their uses (a first call keeps the
        VAE's encoder blocks for a decode). Stopped at the call's end, they start again with the better plan."""
        stale = []
        for name, streamer in self.active.items():
            if name in self.rooms and any(streamer.uses.values()):  # a stream the policy keeps is its to change
                choice, _, _ = block_choice(streamer.component, self.rooms[name], dict(streamer.uses))
                now = self.choices[name]
                if choice is None or (set(choice.kept), choice.slot_bytes) != (set(now.kept), now.slot_bytes):
                    stale.append(name)
        return stale

    def end_call(self, failed: bool) -> None:
        """The call in progress ended: what its streams learned is the plan of the next calls, unless it `failed` (a
        partial pass: blocks that did not run would weigh nothing). A stream that stays between calls learns what
        this call ran and counts the next call's uses afresh."""
        if not failed:
            self.learned.update(self.this_call)
            for name, streamer in self.active.items():
                if any(streamer.uses.values()):
                    if streamer.seen:  # a pass that never repeated (one decode) is the order too
                        streamer._learned()
                    self.learned[name] = (tuple(streamer.ran or streamer.runs), dict(streamer.uses))
        self.this_call.clear()
        for streamer in self.active.values():
            streamer.uses = dict.fromkeys(streamer.uses, 0)

    def _learn(self, name: str, streamer: BlockStreamer) -> None:
        for held in (self.choices, self.plans, self.rooms, self.built, self.why):
            held.pop(name, None)
        if any(streamer.uses.values()):
            learned = self.this_call if self.calls.in_call else self.learned
            learned[name] = (tuple(streamer.ran or streamer.runs), dict(streamer.uses))

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
