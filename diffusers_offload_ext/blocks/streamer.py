"""`BlockStreamer`: runs one component larger than the room the budget leaves it. Its kept blocks go to the device
for as long as it streams; every other block is copied into a ring buffer just before it runs (prefetched `depth`
blocks ahead along the order the blocks ran in, never past the end of the component's forward) and released right
after, its host tensors put back (its quantization state too).

Streamed blocks live on the device only during their own forward. A change made to one there (an in-place update of a
parameter or buffer, a replaced tensor, a new shape, dtype or stride) is seen at release from the tensors' identity,
data pointer, version counter and layout and copied back into the host tensors; edits through `.data`, which bump no
counter, are seen for the kept blocks (fingerprints, as for whole components: `HostCopy`) but not for streamed
blocks, which no code outside their forward can reach while they are on the device. Between forwards (a step
callback) a streamed block is its host tensors: whatever is there when it is copied, a `Parameter` or its data
replaced included, is what runs and what is put back (`StreamedBlock.refresh`); nothing is copied ahead across the
end of a forward, and where code that may write them runs next (a step callback; outside a pipeline call, any code)
the host waits there for the copy stream, so that no copy still reads host memory that code may write. Inside a
pipeline call without a step callback no code writes them between forwards: the forward ends without a host wait.
On a copy stream the first blocks are prefetched from each forward's start, and each copy waits only for the last
reader of the buffer it rewrites (`pinning/copy_stream.py`).
Forward hooks are registered with `always_call`, so a block that raises still releases its buffer; `settle` releases
whatever a failed call left. Around a block compiled in place (regional compilation) they run outside its graph
(`block_hooks.py`).

Every plain tensor behind a streamed block passes through the ring, whatever its format (`streamed_block.py`,
`parts.py`): the ring's buffers hold all of its bytes, quantization state included.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch

from ..constants import COPY, DROP, OFFLOAD, ONLOAD, PREFETCH
from ..transfer.base import HOST
from ..transfer.inference import has_inference_parameters, streams_ordinary_tensors
from .kept_blocks import KeptBlocks
from ..transfer.copier import Copier
from .ring import Ring
from .kept_set import KeptSet
from .find import REST
from .streamed_block import StreamedBlock, device_of

#: `(block, direction, nbytes, kind)`: told of every block move.
Emit = Callable[[str, str, int, str], None]


class BlockStreamer(KeptSet):
    """Streams the blocks of `component` that `plan` does not keep.

    Args:
        component (`torch.nn.Module`): The component.
        blocks (`Sequence[Block]`): Its blocks (`blocks.find_blocks`).
        plan (`BlockChoice`): Which blocks stay, and the ring's size.
        device (`torch.device`): The execution device.
        copier (`Copier`): How ring buffers are filled (`Transfer.copier()`).
        emit (`Emit`): Told of every block move.
        order (`Sequence[str]`, *optional*): The order the streamed blocks ran in last time (module order if not
            given); the prefetch follows it, and learns the real order from the first pass.
        check (`bool`, defaults to `True`): Fingerprint the kept blocks (False: their eviction always copies back).
        passes (`int`, *optional*): How many forwards the component is expected to run (as many as last time).
        schedule (`Callable`): Which blocks to prefetch, `(order, running block or None, depth, passes) -> blocks`
            (`policies.blocks_ahead`: the "when" is a policy's).
        edits_between (`Callable[[], bool]`, *optional*): Whether code that may write host weights runs between two
            forwards (`_forward_ends`); always, by default.
    """

    def __init__(
        self,
        component,
        blocks,
        plan,
        device,
        copier: Copier,
        emit: Emit,
        order=None,
        check=True,
        passes=None,
        *,
        schedule,
        edits_between: Callable[[], bool] = lambda: True,
    ) -> None:
        self.passes, self.inference_parameters, self.schedule = passes, has_inference_parameters(component), schedule
        self.component, self.device, self.copier, self.emit, self.check = component, device, copier, emit, check
        self.blocks = {b.name: b for b in blocks}
        self.depth = max(plan.slots - 1, 1)
        self.kept = [b for b in blocks if b.name in set(plan.kept)]
        self.streamed = {b.name: StreamedBlock(b) for b in blocks if b.name not in set(plan.kept) and b.name != REST}
        #: Every block that ran in its last pass, in order (kept ones too: what it keeps may change).
        self.ran: List[str] = list(order or ())
        known = [n for n in self.ran if n in self.streamed]
        #: The streamed blocks in the order they run (the prefetch follows it): last time's, else module order.
        self.runs = known or list(self.streamed)
        self.slot_bytes, self.slots = plan.slot_bytes, plan.slots
        self.uses: Dict[str, int] = {block.name: 0 for block in blocks}
        #: Which use of the component in its call runs now (`BlockStreams.begin_use`), and the blocks each ran.
        self.use_index: Optional[int] = None
        self.runs_by_use: Dict[int, set] = {}
        self.seen: List[str] = []
        self.keeper, self.edits_between = KeptBlocks(component, self.kept, device, copier, emit, check), edits_between
        self.ring: Optional[Ring] = None
        #: Whether the ring is wanted now (a stream whose component does not run may let it go: `release_ring`).
        self.holds_ring = True
        self._holder: List[Optional[str]] = []
        self._tokens: List[object] = []
        self._freed: List[object] = []
        self._handles: list = []
        self._hooks: Dict[str, object] = {}  # block -> its hooks (`Around`)

    # -- life -------------------------------------------------------------------------------------------------------
    @streams_ordinary_tensors
    def start(self) -> None:
        """Kept blocks to the device, the ring allocated, hooks on the streamed blocks, the first blocks prefetched.
        Where that fails (the device ran out of memory), what was done is undone before the error propagates."""
        try:
            self._start()
        except BaseException:
            self.settle()
            self._unhook()
            self.keeper.evict()
            raise

    def _start(self) -> None:
        self.keeper.load()
        self._handles = [
            self.component.register_forward_pre_hook(lambda *_: _forward_starts(self)),
            self.component.register_forward_hook(lambda *_: _forward_ends(self), always_call=True),
        ]
        for name, block in self.streamed.items():
            _refresh(self, block)  # a tensor found on the device goes home
            self._hook_streamed(name)
        for block in self.kept:  # counted too, so that the next plan weighs every block by its uses
            self._hook_kept(block.name)
        if self.holds_ring:
            self.hold_ring()

    def new_ring(self) -> Ring:
        """A ring of its `slots` buffers of `slot_bytes` on the device."""
        return Ring(self.device, self.slot_bytes, self.slots)

    def first_blocks(self) -> None:
        """The ring was just allocated: its first blocks cross while the rest runs (`_forward_starts`)."""
        _forward_starts(self, self.passes)

    def settle(self) -> None:
        """Release every block in the ring (a failed call left one running, or prefetches were never used)."""
        for block in self.streamed.values():
            if block.running:
                self.leave(block.name)
        for slot, name in enumerate(self._holder):
            if name is not None:
                self._drop(slot)
        self.copier.drain()

    @streams_ordinary_tensors
    def stop(self) -> None:
        """Everything back on the host: streamed blocks released, kept blocks evicted (without a copy when they are
        unchanged), the ring let go, the hooks removed."""
        self.settle()
        self._learned()
        self._unhook()
        self.keeper.evict()

    def abandon(self) -> None:
        """The weights were moved some other way: stop streaming where they are now (nothing is copied)."""
        self._learned()
        self._unhook()
        self.copier.drain()
        self.ring = None
        self.keeper.forget()

    def _unhook(self) -> None:
        for handle in self._handles + list(self._hooks.values()):
            handle.remove()
        self._handles, self._hooks = [], {}
        if self.ring is not None:
            self.copier.drain()
            self.ring.close()
            self.ring = None

    # -- the hot path (hooks torch.compile never traces) ------------------------------------------------------------
    @torch.compiler.disable
    @streams_ordinary_tensors
    def enter(self, name: str) -> None:
        """Block `name` is about to run: its copy waited on (made now if it was not prefetched), its tensors pointed
        at its ring buffer, the next blocks prefetched."""
        block = self.streamed[name]
        if block.running:
            return
        if self.ring is None:  # let go while it did not run, and not asked for again: allocated now
            self.hold_ring()
        slot = block.slot if block.slot is not None else self._load(name, ahead=False)
        self.copier.wait(self._tokens[slot])
        self._tokens[slot] = None
        block.swap_in(self.device)
        block.running = True
        self.uses[name] += 1
        if self.use_index is not None:
            self.runs_by_use.setdefault(self.use_index, set()).add(name)
        self._learn(name)
        self._prefetch(name)

    @torch.compiler.disable
    def leave(self, name: str) -> None:
        """Block `name` ran: a change copied back, its host tensors put back, its buffer free for the next copy."""
        block = self.streamed[name]
        if not block.running:
            return
        changed = block.changed()
        block.swap_out(write_back=changed, copy_home=self.copier.copy_home)
        slot = block.slot
        self._freed[slot] = self.copier.mark()
        self._holder[slot], block.slot = None, None
        self.emit(name, OFFLOAD, block.nbytes, COPY if changed else DROP)

    @torch.compiler.disable
    def _count(self, name: str) -> None:
        self.uses[name] += 1
        if self.use_index is not None:
            self.runs_by_use.setdefault(self.use_index, set()).add(name)
        self._learn(name)

    def _prefetch(self, name: str) -> None:
        upcoming = self.schedule(self.runs, name, self.depth, self.passes)
        for wanted in dict.fromkeys(upcoming):
            if wanted == name or self.streamed[wanted].slot is not None:
                continue
            if self._free_slot(keep=upcoming) is None:
                return
            self._load(wanted, ahead=True, keep=upcoming)

    def _free_slot(self, keep: Sequence[str] = ()) -> Optional[int]:
        """A free buffer, made free by dropping an unused prefetch not in `keep` if need be; `None` if none."""
        for slot, holder in enumerate(self._holder):
            if holder is None:
                return slot
        for slot, holder in enumerate(self._holder):
            if not self.streamed[holder].running and holder not in keep:
                self._drop(slot)
                return slot
        return None

    def _load(self, name: str, ahead: bool, keep: Sequence[str] = ()) -> int:
        block = self.streamed[name]
        _refresh(self, block)
        slot = self._free_slot(keep)
        if slot is None:
            raise RuntimeError(f"every ring buffer holds a running block; `{name}` cannot be streamed")
        views = self.ring.views(slot, block.hosts)
        self._tokens[slot] = self.copier.copy(list(zip(views, block.hosts)), after=self._freed[slot])
        self._freed[slot] = None
        self._holder[slot], block.slot, block.views = name, slot, views
        self.emit(name, ONLOAD, block.nbytes, PREFETCH if ahead else COPY)
        return slot

    def _drop(self, slot: int) -> None:
        name = self._holder[slot]
        block = self.streamed[name]
        self._holder[slot], block.slot, block.views = None, None, []
        self._tokens[slot] = None  # a copy never waited on: the next copy into this buffer follows it on its stream
        self.emit(name, OFFLOAD, block.nbytes, DROP)


def _refresh(streamer: BlockStreamer, block: StreamedBlock) -> None:
    """`block`'s slots read again (`StreamedBlock.refresh`); a tensor found on the device went home: in the ledger."""
    homed = block.refresh()
    if homed:
        streamer.emit(block.name, OFFLOAD, homed, COPY)


@torch.compiler.disable
@streams_ordinary_tensors
def _forward_starts(streamer: BlockStreamer, passes=None) -> None:
    """A forward of the component starts (after any code between forwards ran): on a copy stream, its first blocks
    are copied now, while the component's first layers run (each copy ordered after its buffer's last reader only).
    Without one, only when streaming starts (`passes` given: `_start`), as before: a copy made at once overlaps
    nothing, and the ledger of the plain paths stays what it was."""
    if not streamer.copier.asynchronous and passes is None or streamer.ring is None:
        return
    asynchronous = streamer.copier.asynchronous
    for name in streamer.schedule(streamer.runs, None, streamer.depth, (passes or 1) if asynchronous else passes):
        if streamer.streamed[name].slot is None and streamer._free_slot() is not None:
            streamer._load(name, ahead=True)


@torch.compiler.disable
def _forward_ends(streamer: BlockStreamer) -> None:
    """A forward ended: every copy asked for is made; the host waits for them only where code that may write the host
    weights runs next (`edits_between`: a step callback, or outside a pipeline call)."""
    if streamer.copier.asynchronous:
        streamer.copier.drain() if streamer.edits_between() else streamer.copier.end_forward()


def intact(streamer: BlockStreamer) -> bool:
    """Whether the weights are where `streamer` put them: kept blocks on the device, streamed ones on the host."""
    if any(device_of(block.slots) != streamer.device for block in streamer.kept):
        return False
    return all(block.running or device_of(block.slots) == HOST for block in streamer.streamed.values())
