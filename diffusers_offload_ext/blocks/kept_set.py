"""`KeptSet`: what a streaming component keeps on the device, changed while it does not run: its kept set grown or
shrunk in place (a kept block evicted starts streaming, a streamed block copied in is kept, nothing else moves), and
its ring let go or allocated again (`BlockStreamer` is one; the residency policy asks for it with `KEEP` moves)."""

from __future__ import annotations

from typing import AbstractSet, Dict, List

from ..transfer.inference import streams_ordinary_tensors
from .hooks import Around
from .find import REST
from .streamed_block import StreamedBlock


class KeptSet:
    """A mixin for `BlockStreamer`: its kept set and its ring, changed between its forwards."""

    blocks: Dict[str, object]
    _hooks: Dict[str, object]

    def _hook_streamed(self, name: str) -> None:
        enter, leave = (lambda: self.enter(name)), (lambda: self.leave(name))
        self._hooks[name] = Around(self.streamed[name].module, enter, leave)

    def _hook_kept(self, name: str) -> None:
        self._hooks[name] = Around(self.blocks[name].module, lambda: self._count(name), None)

    # -- what it keeps, changed while it does not run ---------------------------------------------------------------
    def hold_ring(self) -> None:
        """Allocate the ring (when some block streams and it has none) and prefetch the first blocks into it."""
        self.holds_ring = True
        if self.ring is not None or not self.slots or not self.streamed:
            return
        self.ring = self.new_ring()
        allocated = self.copier.mark()  # the first copy into each buffer waits for its allocation, nothing more
        self._holder, self._tokens, self._freed = [None] * self.slots, [None] * self.slots, [allocated] * self.slots
        self.first_blocks()

    def release_ring(self) -> None:
        """Let the ring go (its room is another component's now); it is allocated again before the next block that
        streams (`hold_ring`)."""
        self.holds_ring = False
        if self.seen:  # a pass that never repeated (one decode) is the order too
            self._learned()
        if self.ring is None:
            return
        self.settle()
        self.copier.drain()
        self.ring.close()
        self.ring = None
        self._holder, self._tokens, self._freed = [], [], []

    @streams_ordinary_tensors
    def resize(self, kept: AbstractSet[str], slot_bytes: int, slots: int, ring: bool) -> None:
        """Keep the blocks `kept` from now on, without stopping: kept blocks that go are evicted (dropped when
        unchanged) and stream from now on (the rest, which no block's hooks can bring in, waits on the host until it is
        kept again: before the component runs), the others are copied to the device and kept; the ring is
        let go first and allocated again (`slots` buffers of `slot_bytes`) when `ring` is wanted and some block
        streams. Frees come before copies, so the device never holds more than before and after."""
        self.release_ring()
        going = [b for b in self.kept if b.name not in kept]
        held = {b.name for b in self.kept}
        coming = [b for b in self.blocks.values() if b.name in kept and b.name not in held]
        for block in going:
            self._hooks.pop(block.name).remove()
        self.keeper.evict([b.name for b in going])
        for block in going:
            if block.name != REST:  # the rest is the component's own: it waits on the host until it is kept again
                self.streamed[block.name] = StreamedBlock(block)
                self._hook_streamed(block.name)
        for block in coming:
            if block.name in self.streamed:
                self._hooks.pop(block.name).remove()
                del self.streamed[block.name]
        self.kept = [b for b in self.blocks.values() if b.name in kept]
        self.keeper.blocks = self.kept
        self.keeper.load([b.name for b in coming])
        for block in coming:
            self._hook_kept(block.name)
        # Along the order every block ran in last (the blocks that did not run are not prefetched), else module order.
        self.runs = [n for n in self.ran if n in self.streamed] if self.ran else list(self.streamed)
        self.seen = None if self.ran else []
        self.slot_bytes, self.slots, self.depth = slot_bytes, slots, max(slots - 1, 1)
        if ring:
            self.hold_ring()

    # -- the order its blocks run in (the prefetch follows it) -----------------------------------------------------
    @property
    def order(self) -> List[str]:
        """Every streamed block: those that run, in their order, then the others."""
        runs = [n for n in self.runs if n in self.streamed]  # (while its kept set changes, `runs` lags a moment)
        return runs + [n for n in self.streamed if n not in runs]

    def _learned(self) -> None:
        """A pass that never repeated (one forward) is the order too."""
        if self.seen:
            self._ordered(self.seen)
        self.seen = None

    def _learn(self, name: str) -> None:
        if self.seen is None:
            return
        if name in self.seen:
            self._ordered(self.seen)
            self.seen = None  # one pass is the order
        else:
            self.seen.append(name)

    def _ordered(self, seen: List[str]) -> None:
        self.ran = list(seen)
        self.runs = [n for n in self.ran if n in self.streamed]
