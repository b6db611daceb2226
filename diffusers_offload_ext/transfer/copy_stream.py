"""`CopyStreamTransfer`: prefetches on a CUDA copy stream, so that the next component's weights cross the bus while the
current one computes; the compute stream waits on an event before the prefetched component runs. Not run in CI (no
GPU); the tests drive the same interface with a fake on the simulated accelerator.

Memory safety: the copy stream first waits for everything already queued on the compute stream, so device memory
freed by an eviction (whose readers were queued before) is never rewritten by a later prefetch before they ran;
blocks allocated on the copy stream return to its own pool, so compute-stream allocations never reuse them early. An
eviction or any move made outside waits for a pending prefetch first (`ready`, `flush`).
"""

from __future__ import annotations

from typing import Dict

import torch

from .base import Moved
from .inference import moves_ordinary_tensors
from .ring import CudaCopier
from .book import BOOK, Book
from .synchronous import SyncTransfer


class CopyStreamTransfer(SyncTransfer):
    """`SyncTransfer` whose `prefetch` runs on a dedicated CUDA stream with `non_blocking=True`."""

    asynchronous = True

    def __init__(self, device: torch.device, book: Book = BOOK) -> None:
        super().__init__(device, book)
        self.stream = torch.cuda.Stream(device)
        self._events: Dict[int, torch.cuda.Event] = {}

    @moves_ordinary_tensors
    def prefetch(self, module: torch.nn.Module, *, keep_host: bool, check: bool = True) -> Moved:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            # The host copy's seal (its fingerprint) runs here too: on the copy stream, off the compute path.
            moved = self.onload(module, keep_host=keep_host, check=check, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self._events[id(module)] = event
        return moved

    @property
    def pending(self) -> bool:
        return bool(self._events)

    def ready(self, module: torch.nn.Module) -> None:
        event = self._events.pop(id(module), None)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def copier(self) -> CudaCopier:
        return CudaCopier(self.stream, self.device)

    def flush(self) -> None:
        compute = torch.cuda.current_stream(self.device)
        for event in self._events.values():
            compute.wait_event(event)
        self._events.clear()
