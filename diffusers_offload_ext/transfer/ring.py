"""`Ring`: the preallocated device buffers that streamed blocks pass through, how a block's tensors lie in one buffer,
and the `Copier`s that fill a buffer (at once, or on a CUDA copy stream ordered by events).

A buffer is one `uint8` allocation made when a component starts streaming and freed when it stops: streaming a block
reinterprets a slice of it as each tensor (`view(dtype).view(shape)`), so the hot path allocates nothing and never
empties the allocator's cache. Each tensor starts at a multiple of `ALIGN` bytes (what CUDA kernels expect of an
allocation, and a multiple of every element size).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from .parts import flatten

#: Every tensor of a block starts at a multiple of this many bytes in its buffer.
ALIGN = 256


def layout(tensors: Sequence[torch.Tensor]) -> Tuple[List[int], int]:
    """`(offsets, total)`: where each of `tensors` starts in a buffer, and the bytes the block needs."""
    offsets, end = [], 0
    for tensor in tensors:
        start = -(-end // ALIGN) * ALIGN
        offsets.append(start)
        end = start + tensor.numel() * tensor.element_size()
    return offsets, end


def aligned_nbytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes a block of `tensors` takes in a ring buffer (its tensors' bytes, each start aligned)."""
    return layout(tensors)[1]


class Ring:
    """`slots` device buffers of `slot_bytes` each.

    Args:
        device (`torch.device`): Where the buffers are.
        slot_bytes (`int`): Bytes of each buffer (the largest streamed block's `aligned_nbytes`).
        slots (`int`): How many buffers (the running block and those prefetched ahead).
    """

    def __init__(self, device: torch.device, slot_bytes: int, slots: int) -> None:
        self.slot_bytes = int(slot_bytes)
        self.buffers = [torch.empty(self.slot_bytes, dtype=torch.uint8, device=device) for _ in range(slots)]

    @property
    def nbytes(self) -> int:
        return self.slot_bytes * len(self.buffers)

    def views(self, slot: int, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Device tensors in buffer `slot` shaped like `tensors` (same dtype and shape, contiguous)."""
        offsets, total = layout(tensors)
        if total > self.slot_bytes:
            raise ValueError(f"a block of {total} bytes does not fit a ring buffer of {self.slot_bytes} bytes")
        buffer = self.buffers[slot]
        found = []
        for tensor, start in zip(tensors, offsets):
            piece = buffer[start : start + tensor.numel() * tensor.element_size()]
            found.append(piece.view(tensor.dtype).view(tensor.shape))
        return found

    def close(self) -> None:
        """Let the buffers go (the component stopped streaming)."""
        self.buffers = []


class Copier:
    """Fills ring buffers on the caller's stream, when asked. Tokens order the work: `copy` returns one that `wait`
    makes the compute wait on, and `mark` one for the compute work queued so far (the readers of a buffer).

    On a CUDA device (`device` given), a block whose host tensors are all page-locked (`pinning`) is copied with
    `non_blocking=True` (the compute stream orders what follows) and one event per block tells the store when that
    host memory may be unregistered; a block in pageable memory is copied blocking, as `module.to()` would.
    """

    asynchronous = False

    def __init__(self, device: Optional[torch.device] = None, pinning=None) -> None:
        self.device, self.pinning = device, pinning

    def locked(self, hosts: Sequence[torch.Tensor]) -> bool:
        """Whether every one of `hosts` is page-locked (a copy from it may be asynchronous)."""
        return self.pinning is not None and all(self.pinning.holds(host) for host in hosts)

    def queues(self, hosts: Sequence[torch.Tensor]) -> bool:
        """Whether copies of `hosts` to the device are queued (`non_blocking=True`) rather than made blocking."""
        return self.device is not None and self.locked(hosts)

    def fence(self, hosts: Sequence[torch.Tensor]) -> None:
        """Copies of `hosts` were queued on the compute stream: their host memory stays page-locked until done."""
        compute = torch.cuda.current_stream(self.device)
        event = torch.cuda.Event()
        event.record(compute)
        self.pinning.fence(hosts, event, compute)

    def onload_kept(self, slots: Sequence[tuple], device: torch.device, move) -> None:
        """A kept block's `slots` to `device` by `move(slots, device, non_blocking)`: queued where their host memory is
        page-locked (no host wait per tensor; it stays registered until the copies are done), else blocking."""
        tables = [((sub._parameters if is_param else sub._buffers), key) for sub, is_param, key in slots]
        hosts = [leaf for table, key in tables for leaf in flatten(table[key], detached=True)[1]]
        queued = self.queues(hosts)
        move(slots, device, non_blocking=queued)
        if queued:
            self.fence(hosts)

    def copy(self, pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]], after: Optional[object] = None) -> object:
        """Copy each `(device view, host tensor)` pair, once the work `after` stands for is done."""
        hosts = [host for _, host in pairs]
        queued = self.queues(hosts)
        with torch.no_grad():
            for view, host in pairs:
                view.copy_(host, non_blocking=queued)
        if queued:
            self.fence(hosts)
        return None

    def copy_home(self, pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each `(host tensor, device tensor)` pair into the host tensor (a write-back). On a CUDA device where
        every host tensor is page-locked: queued (`non_blocking=True`) on the compute stream, after the work that made
        the device tensors, then one event waited on by the host, once for all of them (their memory is read by the
        host next); else blocking, one host wait per tensor, as `copy_` does."""
        queued = self.queues([host for host, _ in pairs])
        with torch.no_grad():
            for host, tensor in pairs:
                host.copy_(tensor, non_blocking=queued)
        if queued and pairs:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            event.synchronize()

    def wait(self, token: Optional[object]) -> None:
        """Make the compute that follows wait for the copy `token` stands for."""

    def mark(self) -> Optional[object]:
        """A token for the compute work queued so far."""
        return None

    def drain(self) -> None:
        """Wait for every copy (before the buffers are let go)."""


class _Batch:
    """One block's copies on the copy stream: requested, then issued (`event`), or left to the compute stream
    (`pageable`: copied blocking when waited on)."""

    __slots__ = ("pairs", "event", "pageable", "done")

    def __init__(self, pairs) -> None:
        self.pairs, self.event, self.pageable, self.done = list(pairs), None, False, False


class CudaCopier(Copier):
    """Fills ring buffers on a CUDA copy stream with `non_blocking` copies from page-locked memory, which overlap
    compute. Not run in CI (no GPU): the tests drive it with a fake of `torch.cuda` (`testing/copy_stream.py`).

    A copy asked for in a block's pre-hook is queued only at the block's `mark` (its forward hook), after its kernels:
    the copy stream then waits for everything queued on the compute stream so far, the readers of the buffer it
    rewrites and the allocation of a fresh buffer included. A block whose host memory is not page-locked is never
    copied asynchronously (the host would be held for the whole copy): it is copied blocking on the compute stream
    when it is waited on.
    """

    asynchronous = True

    def __init__(self, stream: "torch.cuda.Stream", device: torch.device, pinning=None) -> None:
        super().__init__(device, pinning)
        self.stream = stream
        self._requested: List[_Batch] = []
        self._pageable: List[_Batch] = []

    def copy(self, pairs, after=None):
        batch = _Batch(pairs)
        self._requested.append(batch)
        return batch

    def _issue(self, upto: Optional[_Batch] = None) -> None:
        """Queue the copies asked for (up to `upto` and no further, in order, if given) on the copy stream, after
        everything queued on the compute stream so far."""
        if not self._requested:
            return
        count = self._requested.index(upto) + 1 if upto is not None else len(self._requested)
        batches, self._requested = self._requested[:count], self._requested[count:]
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        for batch in batches:
            if not self.locked([host for _, host in batch.pairs]):
                batch.pageable = True
                self._pageable.append(batch)
                continue
            with torch.no_grad(), torch.cuda.stream(self.stream):
                for view, host in batch.pairs:
                    view.copy_(host, non_blocking=True)
                batch.event = torch.cuda.Event()
                batch.event.record(self.stream)
            self.pinning.fence([host for _, host in batch.pairs], batch.event, self.stream)

    def wait(self, token) -> None:
        if token is None or token.done:
            return
        if token.event is None and not token.pageable:
            self._issue(upto=token)  # needed now: queued at once (what was asked for later waits for a mark)
        compute = torch.cuda.current_stream(self.device)
        if token.pageable:
            compute.wait_stream(self.stream)  # an earlier copy into the same buffer lands first
            with torch.no_grad():
                for view, host in token.pairs:
                    view.copy_(host)
            self._pageable.remove(token)
        else:
            compute.wait_event(token.event)
        token.done = True

    def mark(self):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._issue()
        return event

    def drain(self) -> None:
        self._issue()
        for batch in list(self._pageable):
            self.wait(batch)  # asked for and counted: made, never skipped
        self.stream.synchronize()
