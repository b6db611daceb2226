"""`CopyStreamTransfer`: prefetches on a CUDA copy stream, so that the next component's weights cross the bus while the
current one computes; the compute stream waits on an event before the prefetched component runs. Its `CudaCopier`
fills streamed blocks' ring buffers on the same stream. Not run in CI (no GPU): the tests drive this very code with a
fake of `torch.cuda`'s streams (`testing/copy_stream.py`) that models their semantics on the simulated accelerator.

Only page-locked memory is prefetched: a non-blocking copy from pageable memory holds the host for the whole copy
(measured on an H200), so a component whose host memory is not all page-locked (`pin_memory=False`, a page-lock
refused or over budget) is loaded synchronously instead, with one log line.

Memory safety: the prefetched weights are allocated on the compute stream (the caching allocator keeps a pool per
stream: memory allocated on the copy stream could never be reused by compute), then the copy stream waits for
everything queued on the compute stream (the readers of memory an eviction freed, and those allocations) before it
writes them; `record_stream` keeps them from being reused before the copies are done. An eviction or any move made
outside waits for a pending prefetch first (`ready`, `flush`).
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
from diffusers.utils import logging

from ..transfer.base import Moved
from ..transfer.book import BOOK, Book
from ..transfer.copier import Copier
from ..transfer.synchronous import SyncTransfer

logger = logging.get_logger(f"diffusers.{__name__}")


class CopyStreamTransfer(SyncTransfer):
    """`SyncTransfer` whose `prefetch` runs on a dedicated CUDA stream with `non_blocking=True`."""

    asynchronous = True

    def __init__(self, device: torch.device, book: Book = BOOK) -> None:
        super().__init__(device, book)
        self.stream = torch.cuda.Stream(device)
        self._events: Dict[int, torch.cuda.Event] = {}
        self._ahead = False
        self._said = set()

    def prefetch(self, module: torch.nn.Module, *, keep_host: bool, check: bool = True) -> Moved:
        self._ahead = True
        try:
            return self.onload(module, keep_host=keep_host, check=check)
        finally:
            self._ahead = False

    def _copy_in(self, module: torch.nn.Module, locked: bool, sealed) -> None:
        if not self._ahead or not locked:
            if self._ahead:
                self._synchronously(module)
            return super()._copy_in(module, locked, sealed)
        compute = torch.cuda.current_stream(self.device)
        pairs = []

        def allocate(tensor: torch.Tensor) -> torch.Tensor:
            # On the compute stream: its pool, so that compute can reuse this memory once it is freed.
            target = torch.empty_like(tensor, device=self.device)
            pairs.append((target, tensor.detach()))  # the host data: `_apply` then points a parameter at `target`
            return target

        module._apply(allocate)
        self.stream.wait_stream(compute)  # after the allocations and every reader of the memory they reuse
        with torch.no_grad(), torch.cuda.stream(self.stream):
            for target, source in pairs:
                target.copy_(source, non_blocking=True)
                target.record_stream(self.stream)
            # The host copy's seal (its fingerprint) runs here too: on the copy stream, off the compute path.
            if sealed is not None:
                sealed.seal(module)
            event = torch.cuda.Event()
            event.record(self.stream)
        self._events[id(module)] = event
        self.pinning.fence_module(module, event, self.stream)

    def _synchronously(self, module: torch.nn.Module) -> None:
        name = type(module).__name__
        if name not in self._said:
            self._said.add(name)
            logger.warning(
                f"`{name}` is not in page-locked host memory (`pin_memory`): a copy from pageable memory would hold the "
                "host for the whole copy, so it is loaded synchronously instead of prefetched"
            )

    @property
    def pending(self) -> bool:
        return bool(self._events)

    def ready(self, module: torch.nn.Module) -> None:
        event = self._events.pop(id(module), None)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def copier(self) -> CudaCopier:
        return CudaCopier(self.stream, self.device, self.pinning)

    def flush(self) -> None:
        compute = torch.cuda.current_stream(self.device)
        for event in self._events.values():
            compute.wait_event(event)
        self._events.clear()


class _Batch:
    """One block's copies: issued on the copy stream (`event`), or left to the compute stream (`pageable`: copied
    blocking when waited on)."""

    __slots__ = ("pairs", "event", "pageable", "done")

    def __init__(self, pairs) -> None:
        self.pairs, self.event, self.pageable, self.done = list(pairs), None, False, False


class CudaCopier(Copier):
    """Fills ring buffers on a CUDA copy stream with `non_blocking` copies from page-locked memory, which overlap
    compute. Not run in CI (no GPU): the tests drive it with a fake of `torch.cuda` (`testing/copy_stream.py`).

    A copy is queued when it is asked for, ordered only after the last reader of the buffer it rewrites: the copy
    stream waits for the event `after` (recorded on the compute stream when the block that held the buffer left it,
    or when the ring was allocated), not for everything queued on the compute stream, so the copy of a block two
    ahead starts as soon as the block before the running one is done. A block whose host memory is not page-locked
    is never copied asynchronously (the host would be held for the whole copy): it is copied blocking on the compute
    stream when it is waited on.
    """

    asynchronous = True

    def __init__(self, stream: "torch.cuda.Stream", device: torch.device, pinning=None) -> None:
        super().__init__(device, pinning)
        self.stream = stream
        self._pageable: List[_Batch] = []

    def copy(self, pairs, after=None):
        batch = _Batch(pairs)
        hosts = [host for _, host in batch.pairs]
        if not self.locked(hosts):
            batch.pageable = True
            self._pageable.append(batch)
            return batch
        if after is not None:
            self.stream.wait_event(after)  # the buffer's last reader (or its allocation) is done first
        with torch.no_grad(), torch.cuda.stream(self.stream):
            for view, host in batch.pairs:
                view.copy_(host, non_blocking=True)
            batch.event = torch.cuda.Event()
            batch.event.record(self.stream)
        self.pinning.fence(hosts, batch.event, self.stream)
        return batch

    def wait(self, token) -> None:
        if token is None or token.done:
            return
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
        return event

    def end_forward(self) -> None:
        for batch in list(self._pageable):
            self.wait(batch)  # asked for and counted: made, never skipped (blocking, on the compute stream)

    def drain(self) -> None:
        self.end_forward()
        self.stream.synchronize()
