"""The staging ring, and the onload of a component whose host weights are file-backed: each such weight is copied to
the device through a few page-locked host buffers (read from the file's pages into a free buffer by the host, then
queued from the buffer to the device on the compute stream; a buffer is written again only once the copy that read
it is done, so the host's read of the next chunk overlaps the device's copy of the last), never materialised in
anonymous host memory. Where the execution device is the host's own memory (the plain CPU), a file-backed weight is
not copied at all: the device reads it where it lies.

The ring is page-locked through the process's page-locked store (`pinning/store.py`: its record of registered pages
and its driver calls), counted in the host budget; where host memory cannot be page-locked for the device, or the
driver refuses, the weights are copied from the file's pages directly (the plain path).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch
from diffusers.utils import logging

from .memory import SLOTS

_PLAIN = (torch.Tensor, torch.nn.Parameter)

logger = logging.get_logger(f"diffusers.{__name__}")


class StagingRing:
    """`SLOTS` page-locked host buffers of `nbytes // SLOTS` bytes, made and page-locked on first use.

    Args:
        store (`PinnedStore` or `None`): The page-locked store of the execution device's type; `None`: no ring (every
            copy takes the plain path).
        nbytes (`int`): Bytes of the whole ring.
        queued (`bool`): Whether copies to the device are queued on a stream (CUDA): each buffer then waits for an
            event recorded after its last copy before it is written again. Else every copy is blocking.
    """

    def __init__(self, store, nbytes: int, queued: bool) -> None:
        self.store, self.queued = store, queued
        self.slot_bytes = nbytes // SLOTS
        self.buffers: List[torch.Tensor] = []
        self.events: List[Optional[object]] = []
        self.turn = 0
        self.refused = store is None or self.slot_bytes <= 0
        #: Copies made through the ring: chunks and bytes (what the tests read).
        self.chunks = self.nbytes_copied = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the ring page-locked now."""
        return sum(b.numel() for b in self.buffers)

    def ready(self) -> bool:
        """Make and page-lock the buffers (once); whether the ring can be used."""
        if self.buffers or self.refused:
            return not self.refused
        for _ in range(SLOTS):
            buffer = torch.empty(self.slot_bytes, dtype=torch.uint8)
            code = self.store.ranges.lock(buffer, buffer.data_ptr(), self.slot_bytes, self)
            if code != 0:
                logger.warning(
                    f"page-locking the host staging ring was refused by the driver (code {code}): file-backed weights "
                    "are copied from the file's pages directly"
                )
                self.release()
                self.refused = True
                return False
            self.buffers.append(buffer)
            self.events.append(None)
        return True

    def copy(self, pairs: List[Tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each `(device tensor, host tensor)` pair (same shape and dtype, both contiguous) through the ring,
        packed: a buffer is filled with the bytes of as many tensors as fit, then copied out in pieces, one event per
        buffer; directly where there is no ring."""
        if not self.ready():
            for dst, src in pairs:
                dst.copy_(src)
            return
        pieces: List[Tuple[torch.Tensor, int, int]] = []  # (device bytes, offset in the buffer, count)
        index, used = self._take(), 0
        for dst, src in pairs:
            source, target = src.reshape(-1).view(torch.uint8), dst.view(-1).view(torch.uint8)
            offset = 0
            while offset < source.numel():
                if used == self.slot_bytes:
                    self._send(index, pieces)
                    index, used, pieces = self._take(), 0, []
                count = min(self.slot_bytes - used, source.numel() - offset)
                self.buffers[index][used : used + count].copy_(source[offset : offset + count])
                pieces.append((target[offset : offset + count], used, count))
                used, offset = used + count, offset + count
        self._send(index, pieces)

    def _take(self) -> int:
        """The next buffer, once the copies that last read it are done."""
        index = self.turn
        self.turn = (self.turn + 1) % SLOTS
        if self.events[index] is not None:
            self.events[index].synchronize()
            self.events[index] = None
        return index

    def _send(self, index: int, pieces: List[Tuple[torch.Tensor, int, int]]) -> None:
        """Copy buffer `index`'s pieces to the device (queued, with one event after them, where the ring queues)."""
        buffer = self.buffers[index]
        for target, offset, count in pieces:
            target.copy_(buffer[offset : offset + count], non_blocking=self.queued)
        self.events[index] = self._event() if self.queued and pieces else None
        self.chunks += 1 if pieces else 0
        self.nbytes_copied += sum(count for _, _, count in pieces)

    def _event(self):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return event

    def drain(self) -> None:
        """Wait for every copy that reads the ring."""
        for event in self.events:
            if event is not None:
                event.synchronize()
        self.events = [None] * len(self.buffers)

    def release(self) -> None:
        """Wait for the copies, and let the store unregister the buffers."""
        self.drain()
        for buffer in self.buffers:
            self.store.ranges.unlock(buffer.data_ptr(), self)
        if self.store is not None:
            self.store.ranges.settle()
        self.buffers, self.events = [], []


def onload(
    module: torch.nn.Module,
    device: torch.device,
    file_backed: Callable[[torch.Tensor], bool],
    ring: StagingRing,
    in_place: bool,
    locked: Callable[[torch.Tensor], bool],
) -> bool:
    """Move `module` to `device`, its file-backed host weights (`file_backed(tensor)`) through `ring` (or, with
    `in_place`, where the device reads host memory, not at all), the others as `module.to` would (queued where
    `locked(tensor)` says their memory is page-locked and the ring queues). Returns False, having done nothing, where
    this path does not apply: no file-backed weight, a tensor subclass, a gradient."""
    slots = [(sub, is_param, key, t) for sub in module.modules() for is_param, table in _tables(sub)
             for key, t in table.items() if t is not None]  # fmt: skip
    if any(type(t) not in _PLAIN or t.layout != torch.strided or getattr(t, "grad", None) is not None
           for *_, t in slots):  # fmt: skip
        return False
    if not any(t.device.type == "cpu" and file_backed(t) for *_, t in slots):
        return False
    moved: Dict[int, torch.Tensor] = {}
    pairs = []  # (device tensor, file-backed host tensor): copied through the ring, packed
    with torch.no_grad():
        for *_, tensor in slots:
            if id(tensor) in moved:
                continue
            if tensor.device.type != "cpu" or not file_backed(tensor):
                moved[id(tensor)] = tensor.detach().to(device, non_blocking=ring.queued and locked(tensor))
            elif in_place:
                moved[id(tensor)] = tensor  # the device reads it where it lies
            else:
                moved[id(tensor)] = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
                pairs.append((moved[id(tensor)], tensor.detach().contiguous()))
        ring.copy(pairs)
        for sub, is_param, key, tensor in slots:
            target = moved[id(tensor)]
            if target is tensor:
                continue
            if is_param:
                tensor.data = target
            else:
                sub._buffers[key] = target
    return True


class Stager:
    """What a transfer asks under a host budget: whether a host tensor is file-backed, and the onload of a component
    that has such weights (`onload` above).

    Args:
        ring (`StagingRing`): The ring file-backed weights are copied through.
        regions (`Regions`): The process's file mappings, read when offload was armed.
        in_place (`bool`): The execution device is the host's own memory (the plain CPU).
        holds (`Callable[[torch.Tensor], bool]`): Whether this package page-locked a tensor's memory (such a weight is
            copied as any page-locked one is, not through the ring).
    """

    def __init__(self, ring: StagingRing, regions, in_place: bool, holds: Callable[[torch.Tensor], bool]) -> None:
        self.ring, self.regions, self.in_place, self.holds = ring, regions, in_place, holds

    def file_backed(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` (on the host) is a view of a file's mapping and not page-locked."""
        return self.regions.file_of(tensor.data_ptr()) is not None and not self.holds(tensor)

    def onload(self, module: torch.nn.Module, device: torch.device) -> bool:
        """`onload` of `module` with this stager's ring; False where that path does not apply."""
        return onload(module, device, self.file_backed, self.ring, self.in_place, self.holds)


def _tables(sub: torch.nn.Module):
    return ((True, sub._parameters), (False, sub._buffers))
