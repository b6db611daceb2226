"""`BlockStreams`: the components of one pipeline that run block by block because they are larger than the room the
budget leaves them: their block choices and streamers, and what each streamer learned (the order its blocks ran in,
how often each ran) for its next start; and `stream_room`, the fact the policy is told of how little room a
component can stream in."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Dict, Iterator, NamedTuple, Optional, Set, Tuple

from diffusers.utils import logging

from .find import REST, find_blocks
from .choice import DEPTH, Item, BlockChoice, least_room, choose_blocks
from .prefetch import blocks_ahead
from .streamed_block import ring_hosts
from ..transfer.parts import streamable
from .ring import aligned_nbytes
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
    """

    resident: Tuple[str, ...]
    streamed: Tuple[str, ...]
    ring_bytes: int
    slots: int
    device_bytes: int
    bytes_per_pass: int


def _items(module, uses: Optional[Dict[str, int]] = None) -> Tuple[Optional[list], list, str]:
    """`(items, blocks, why not)`: `module`'s blocks as the knapsack sees them (ring slots sized as the ring lays blocks
    out, each weighed by `uses`, 1 if not given); the items are `None` when it cannot stream, and `why not` says
    why."""
    blocks = find_blocks(module)
    if not [b for b in blocks if b.name != REST]:
        return None, blocks, "it has no repeated blocks to stream"
    for block in blocks:
        odd = [t for t in _tensors(block) if not streamable(t)]
        if block.name != REST and odd:
            return None, blocks, f"block `{block.name}` holds a tensor that cannot stream ({type(odd[0]).__name__})"
    known = bool(uses)  # from the last stream: a block that did not run then weighs nothing
    items = [  # a streamed block's ring buffer holds its quantization state too
        Item(
            b.name,
            b.nbytes if b.name == REST else aligned_nbytes(ring_hosts(b.slots)),
            uses.get(b.name, 0) if known else 1,
        )
        for b in blocks
    ]
    return items, blocks, ""


def _forced(blocks) -> list:
    return [REST] if blocks and blocks[0].name == REST else []


def stream_room(module) -> Optional[int]:
    """The fewest device bytes `module` can stream its blocks in (its rest, any block larger than the ring's buffers,
    the ring); `None` when it cannot stream at all. A choice exists (`block_choice`) for any room at least this."""
    items, blocks, _ = _items(module)
    return None if items is None else least_room(items, depth=DEPTH, forced=_forced(blocks))


def block_choice(module, room: int, uses: Optional[Dict[str, int]] = None) -> Tuple[Optional[BlockChoice], list, str]:
    """`(choice, blocks, why not)`: how `module` streams within `room` bytes (`blocks.choice.choose_blocks` over its
    blocks, its rest kept, each block weighed by `uses`, 1 if not given); the choice is `None` when it cannot stream,
    and `why not` says why."""
    items, blocks, why = _items(module, uses)
    if items is None:
        return None, blocks, why
    forced = _forced(blocks)
    choice = choose_blocks(items, room, depth=DEPTH, forced=forced)
    if choice is None:
        least = least_room(items, depth=DEPTH, forced=forced)
        need, have = format_size(least), format_size(room)
        if need == have:
            need, have = f"{least:,} bytes", f"{room:,} bytes"
        why = (
            f"to stream it needs at least {need} on the device, for its rest, any block larger than the ring's "
            f"buffers and a ring of {DEPTH + 1} buffers, and it has {have}"
        )
        return None, blocks, why
    return choice, blocks, ""


def _tensors(block):
    return [(sub._parameters if is_param else sub._buffers)[key] for sub, is_param, key in block.slots]


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


class BlockStreams:
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
        #: The bytes each streaming component holds on the device (`Facts.streaming`).
        self.held = StreamBytes(self)

    def start(self, name: str, module, room: int, transfer, check: bool) -> Tuple[Optional[BlockChoice], str]:
        """Start streaming component `name` (`module`) within `room` bytes through `transfer` (`check`: fingerprint
        its kept blocks); `(choice, "")`, or `(None, why not)` with nothing changed. Its blocks are weighed by the uses
        they had the last time it streamed. A start that raises (out of device memory) leaves it not streaming."""
        order, uses = self.this_call.get(name) or self.learned.get(name, (None, {}))
        choice, blocks, why = block_choice(module, room, uses)
        if choice is None:
            return None, why
        if transfer.pinning is not None:
            transfer.pinning.prepare(module, type(module).__name__)

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
        )
        self.active[name], self.choices[name], self.rooms[name] = streamer, choice, room
        self.built[name] = transfer.entry(module).changes
        try:
            streamer.start()
        except BaseException:  # the device ran out of memory: the streamer undid its start, nothing streams
            del self.active[name], self.choices[name], self.rooms[name], self.built[name]
            raise
        transfer.record(module, True)
        return choice, ""

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
            if any(streamer.uses.values()):
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
                    self.learned[name] = (tuple(streamer.runs), dict(streamer.uses))
        self.this_call.clear()
        for streamer in self.active.values():
            streamer.uses = dict.fromkeys(streamer.uses, 0)

    def _learn(self, name: str, streamer: BlockStreamer) -> None:
        self.choices.pop(name, None)
        self.rooms.pop(name, None)
        self.built.pop(name, None)
        if any(streamer.uses.values()):
            learned = self.this_call if self.calls.in_call else self.learned
            learned[name] = (tuple(streamer.runs), dict(streamer.uses))

    def status(self, name: str) -> Optional[BlockStatus]:
        streamer, choice = self.active.get(name), self.choices.get(name)
        if streamer is None or choice is None:
            return None
        per_pass = sum(streamer.streamed[n].nbytes for n in streamer.order)
        # On the device: the kept blocks at their own bytes (the choice weighs them at their sizes in a ring buffer,
        # aligned), and the ring while it is allocated.
        held = sum(block.nbytes for block in streamer.kept) + (
            streamer.ring.nbytes if streamer.ring is not None else 0
        )
        return BlockStatus(tuple(choice.kept), tuple(streamer.order), choice.ring_bytes, choice.slots, held, per_pass)
