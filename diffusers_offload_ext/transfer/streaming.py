"""`BlockStreamer`: runs one component larger than the room the budget leaves it. Its kept blocks go to the device
for as long as it streams; every other block is copied into a ring buffer just before it runs (prefetched `depth` ahead
in the order blocks ran) and released right after, host tensors put back (`quant_state` too: `quant_state.py`).

Streamed blocks live on the device only during their own forward. A change made to one there (an in-place update of a
parameter or buffer, a replaced tensor) is seen at release from the tensors' identity, data pointer and version
counter and copied back into the host tensors; edits through `.data`, which bump no counter, are seen for the kept
blocks (fingerprints, as for whole components: `HostCopy`) but not for streamed blocks, which no code outside their
forward can reach while they are on the device. Forward hooks are registered with `always_call`, so a block that
raises still releases its buffer; `settle` releases whatever a failed call left.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch

from ..constants import COPY, DROP, OFFLOAD, ONLOAD, PREFETCH
from .base import HOST
from .inference import has_inference_parameters, streams_ordinary_tensors, version_of
from .host_copy import HostCopy
from .quant_state import carry, place_state, restore_state, state_of
from .ring import Copier, Ring

#: `(block, direction, nbytes, kind)`: told of every block move.
Emit = Callable[[str, str, int, str], None]


class _Streamed:
    """One streamed block: where its tensors live, their host tensors, and its place in the ring."""

    def __init__(self, block) -> None:
        self.name, self.module, self.slots, self.nbytes = block.name, block.module, block.slots, block.nbytes
        tables = [(sub._parameters if is_param else sub._buffers, key) for sub, is_param, key in self.slots]
        self.tables = tables
        self.originals = [table[key] for table, key in tables]
        self.hosts = [t.data if isinstance(t, torch.nn.Parameter) else t for t in self.originals]
        self.states = state_of(self.slots)
        self.views: List[torch.Tensor] = []
        self.marks: List[int] = []
        self.slot: Optional[int] = None
        self.running = False

    def swap_in(self, device: torch.device) -> None:
        for (table, key), original, view in zip(self.tables, self.originals, self.views):
            if isinstance(original, torch.nn.Parameter):
                original.data = view
                table[key] = original
            else:
                table[key] = view
        place_state(self.states, device)
        self.marks = [version_of(table[key]) for table, key in self.tables]

    def changed(self) -> bool:
        for (table, key), original, view, mark in zip(self.tables, self.originals, self.views, self.marks):
            now = table.get(key)
            expected = original if isinstance(original, torch.nn.Parameter) else view
            if now is not expected or now.data_ptr() != view.data_ptr():
                return True
            if mark is None or version_of(now) != mark:  # no counter to read: taken as changed (written back)
                return True
        return False

    def swap_out(self, write_back: bool) -> None:
        with torch.no_grad():
            for i, (table, key) in enumerate(self.tables):
                now = table.get(key)
                if write_back and now is not None:
                    host = self.hosts[i]
                    if now.shape == host.shape and now.dtype == host.dtype and not host.is_inference():
                        self.hosts[i].copy_(now.data)
                    else:
                        # A new shape (it no longer fits the ring: refused at load) or an inference tensor: a fresh copy.
                        self.hosts[i] = now.data.to(HOST, copy=True)  # never a view of the ring
                original = self.originals[i]
                if isinstance(original, torch.nn.Parameter):
                    original.data = self.hosts[i]
                    table[key] = original
                else:
                    table[key] = self.originals[i] = self.hosts[i]
        restore_state(self.states)
        self.views, self.marks, self.running = [], [], False


def _device_of(slots) -> Optional[torch.device]:
    """Where the first tensor in `slots` is (`None`: it is gone)."""
    sub, is_param, key = slots[0]
    tensor = (sub._parameters if is_param else sub._buffers).get(key)
    return None if tensor is None else tensor.device


def _move_slots(slots, device: torch.device) -> None:
    """Move the tensors in `slots` to `device` (a parameter keeps its object; a buffer is replaced)."""
    with torch.no_grad():
        for sub, is_param, key in slots:
            table = sub._parameters if is_param else sub._buffers
            if is_param:
                table[key].data = table[key].data.to(device)
            else:
                table[key] = table[key].to(device)


class BlockStreamer:
    """Streams the blocks of `component` that `plan` does not keep.

    Args:
        component (`torch.nn.Module`): The component.
        blocks (`Sequence[Block]`): Its blocks (`blocks.find_blocks`).
        plan (`StreamPlan`): Which blocks stay, and the ring's size.
        device (`torch.device`): The execution device.
        copier (`Copier`): How ring buffers are filled (`Transfer.copier()`).
        emit (`Emit`): Told of every block move.
        order (`Sequence[str]`, *optional*): The order the streamed blocks ran in last time (module order if not
            given); the prefetch follows it, and learns the real order from the first pass.
        check (`bool`, defaults to `True`): Fingerprint the kept blocks (False: their eviction always copies back).
        passes (`int`, *optional*): How many forwards the component is expected to run (as many as last time): the
            prefetch runs ahead across the end of a forward into the next one, except after the last (and never
            when not given).
    """

    def __init__(
        self, component, blocks, plan, device, copier: Copier, emit: Emit, order=None, check=True, passes=None
    ) -> None:
        self.passes, self.inference_parameters = passes, has_inference_parameters(component)
        self.component, self.device, self.copier, self.emit, self.check = component, device, copier, emit, check
        self.depth = max(plan.slots - 1, 1)
        self.kept = [b for b in blocks if b.name in set(plan.kept)]
        self.streamed: Dict[str, _Streamed] = {b.name: _Streamed(b) for b in blocks if b.name not in set(plan.kept)}
        known = [n for n in (order or ()) if n in self.streamed]
        #: The streamed blocks in the order they run (the prefetch follows it): last time's, else module order.
        self.runs = known or list(self.streamed)
        self.slot_bytes, self.slots = plan.slot_bytes, plan.slots
        self.uses: Dict[str, int] = {block.name: 0 for block in blocks}
        self.seen: List[str] = []
        self.copies: Dict[str, HostCopy] = {}
        self.states: Dict[str, list] = {}  # the kept blocks' quantization state (host tensors)
        self.ring: Optional[Ring] = None
        self._holder: List[Optional[str]] = []
        self._tokens: List[object] = []
        self._freed: List[object] = []
        self._handles: list = []

    # -- life -------------------------------------------------------------------------------------------------------
    @streams_ordinary_tensors
    def start(self) -> None:
        """Kept blocks to the device, the ring allocated, hooks on the streamed blocks, the first blocks prefetched."""
        for block in self.kept:
            copy = HostCopy(self.component, self.check, only=block.slots)
            _move_slots(block.slots, self.device)
            self.states[block.name] = carry(block.slots, self.device)
            copy.seal(self.component)
            self.copies[block.name] = copy
            self.emit(block.name, ONLOAD, block.nbytes, COPY)
        self.ring = Ring(self.device, self.slot_bytes, self.slots)
        self._holder = [None] * self.slots
        self._tokens = [None] * self.slots
        self._freed = [None] * self.slots
        for name, block in self.streamed.items():
            pre = block.module.register_forward_pre_hook(lambda module, args, name=name: self.enter(name))
            post = block.module.register_forward_hook(lambda m, a, out, name=name: self.leave(name), always_call=True)
            self._handles += [pre, post]
        for block in self.kept:  # counted too, so that the next plan weighs every block by its uses
            self._handles.append(
                block.module.register_forward_pre_hook(lambda m, a, name=block.name: self._count(name))
            )
        if self.passes is not None:  # the order is known: the first blocks cross while the rest runs
            for name in self.runs[: self.depth]:
                self._load(name, ahead=True)

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
        for block in self.kept:
            copy = self.copies.pop(block.name)
            restore_state(self.states.pop(block.name, ()))
            if copy.check and copy.unchanged(self.component):
                copy.restore(self.component)
                self.emit(block.name, OFFLOAD, block.nbytes, DROP)
                continue
            if not copy.write_back(self.component):
                _move_slots(block.slots, HOST)  # a new shape or dtype: only a fresh host copy can hold it
            self.emit(block.name, OFFLOAD, block.nbytes, COPY)

    def abandon(self) -> None:
        """The weights were moved some other way: stop streaming where they are now (nothing is copied)."""
        self._learned()
        self._unhook()
        self.copier.drain()
        self.ring, self.copies, self.states = None, {}, {}

    def _unhook(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.ring is not None:
            self.copier.drain()
            self.ring.close()
            self.ring = None

    # -- the hot path -----------------------------------------------------------------------------------------------
    @streams_ordinary_tensors
    def enter(self, name: str) -> None:
        """Block `name` is about to run: its copy waited on (made now if it was not prefetched), its tensors pointed
        at its ring buffer, the next blocks prefetched."""
        block = self.streamed[name]
        if block.running:
            return
        slot = block.slot if block.slot is not None else self._load(name, ahead=False)
        self.copier.wait(self._tokens[slot])
        self._tokens[slot] = None
        block.swap_in(self.device)
        block.running = True
        self.uses[name] += 1
        self._learn(name)
        self._prefetch(name)

    def leave(self, name: str) -> None:
        """Block `name` ran: a change copied back, its host tensors put back, its buffer free for the next copy."""
        block = self.streamed[name]
        if not block.running:
            return
        changed = block.changed()
        block.swap_out(write_back=changed)
        slot = block.slot
        self._freed[slot] = self.copier.mark()
        self._holder[slot], block.slot = None, None
        self.emit(name, OFFLOAD, block.nbytes, COPY if changed else DROP)

    def _count(self, name: str) -> None:
        self.uses[name] += 1

    @property
    def order(self) -> List[str]:
        """Every streamed block: those that run, in their order, then the others."""
        return self.runs + [n for n in self.streamed if n not in self.runs]

    def _learned(self) -> None:
        """A pass that never repeated (one forward) is the order too."""
        if self.seen:
            self.runs = list(self.seen)
        self.seen = None

    def _learn(self, name: str) -> None:
        if self.seen is None:
            return
        if name in self.seen:
            self.runs = list(self.seen)
            self.seen = None  # one pass is the order
        else:
            self.seen.append(name)

    def _prefetch(self, name: str) -> None:
        if name not in self.runs:
            return  # a block that did not run before: nothing known to follow it
        runs = self.runs
        index = runs.index(name)
        # Past the end of a forward into the next only when one is expected (never on a first stream: no bytes for a
        # forward that may not come).
        last = self.passes is None or self.uses[name] >= self.passes
        upcoming = [runs[(index + k) % len(runs)] for k in range(1, self.depth + 1)]
        if last:
            upcoming = upcoming[: max(len(runs) - 1 - index, 0)]
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


def intact(streamer: BlockStreamer) -> bool:
    """Whether the weights are where `streamer` put them: kept blocks on the device, streamed ones on the host."""
    if any(_device_of(block.slots) != streamer.device for block in streamer.kept):
        return False
    return all(block.running or _device_of(block.slots) == HOST for block in streamer.streamed.values())
