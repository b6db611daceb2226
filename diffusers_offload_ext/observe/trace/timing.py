"""Timing and profiler ranges: CUDA events on a CUDA execution device, the wall clock elsewhere, and NVTX ranges
where Nsight can see them. Small and separate, so that tests can check them with mocks."""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Optional

import torch

WALL_CLOCK = "wall-clock"
CUDA_EVENTS = "cuda-events"


def nvtx_enabled(device: Optional[torch.device]) -> bool:
    """Whether spans on `device` are timed with CUDA events and marked with NVTX ranges."""
    return device is not None and device.type == "cuda" and torch.cuda.is_available()


@contextlib.contextmanager
def nvtx_range(message: str, device: Optional[torch.device]):
    """An NVTX range named `message` when `device` is a CUDA device (so it shows in Nsight), else nothing."""
    if not nvtx_enabled(device):
        yield
        return
    torch.cuda.nvtx.range_push(message)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


class Clock:
    """Times spans: CUDA events on a CUDA execution device (read when the trace ends), wall clock elsewhere."""

    def __init__(self, device: Optional[torch.device]) -> None:
        self.cuda = nvtx_enabled(device)
        self.timing = CUDA_EVENTS if self.cuda else WALL_CLOCK

    def start(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, token) -> Callable[[], float]:
        """A function that returns the span's seconds (for CUDA, after synchronising)."""
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()

            def seconds() -> float:
                end.synchronize()
                return token.elapsed_time(end) / 1000.0

            return seconds
        elapsed = time.perf_counter() - token
        return lambda: elapsed


class Span:
    """One timed span that cannot be a `with` block (it starts in one callback and ends in another): a profiler range
    named `label` (`torch.profiler.record_function`, unless `profile=False` because the caller opens one), an NVTX
    range on CUDA, timed by a `Clock`."""

    def __init__(self, label: str, device: Optional[torch.device], profile: bool = True) -> None:
        self.range = torch.profiler.record_function(label) if profile else None
        if self.range is not None:
            self.range.__enter__()
        self.pushed = nvtx_enabled(device)
        if self.pushed:
            torch.cuda.nvtx.range_push(label)
        self.clock = Clock(device)
        self.token = self.clock.start()

    def stop(self) -> Callable[[], float]:
        """End the span; returns what `Clock.stop` returns."""
        seconds = self.clock.stop(self.token)
        if self.pushed:
            torch.cuda.nvtx.range_pop()
        if self.range is not None:
            self.range.__exit__(None, None, None)
        return seconds
