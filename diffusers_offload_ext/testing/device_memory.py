"""Device memory for tests on the CPU: `transfer/memory.py`'s CUDA-only readings (free, total, allocated and peak
bytes, the cache given back) backed by a `SimulatedAccelerator` with a capacity, and out-of-memory errors injected
inside a module's forward."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, List, Optional

import torch

from ..transfer import memory

_NAMES = ("free_bytes", "total_bytes", "allocated_bytes", "peak_bytes", "reset_peak", "release_cached")


class SimulatedMemory:
    """What `transfer/memory.py` reads on CUDA, read from `sim` for its device (`None` elsewhere, as on the CPU).

    Attributes:
        released (`int`): How many times the cache was given back (`memory.release_cached`).
        resets (`int`): How many times the peak was reset.
    """

    def __init__(self, sim) -> None:
        self.sim = sim
        self.released = 0
        self.resets = 0

    def _ours(self, device: torch.device) -> bool:
        return torch.device(device) == self.sim.device

    def free_bytes(self, device):
        return self.sim.capacity - self.sim.allocated_bytes if self._ours(device) else None

    def total_bytes(self, device):
        return self.sim.capacity if self._ours(device) else None

    def allocated_bytes(self, device):
        return self.sim.allocated_bytes if self._ours(device) else None

    def peak_bytes(self, device):
        return self.sim.peak_bytes if self._ours(device) else None

    def reset_peak(self, device) -> None:
        if self._ours(device):
            self.resets += 1
            self.sim.reset_peak()

    def release_cached(self, device) -> None:
        if self._ours(device):
            self.released += 1


@contextlib.contextmanager
def simulated_memory(sim) -> Iterator[SimulatedMemory]:
    """Within it, `transfer/memory.py` reads `sim` (a `SimulatedAccelerator` with a capacity) as it reads a CUDA
    device: the automatic budget, the free memory read before onloads and the learnt activations all run."""
    if sim.capacity is None:
        raise ValueError("simulated_memory needs a SimulatedAccelerator with a `capacity`.")
    fake = SimulatedMemory(sim)
    saved = {name: getattr(memory, name) for name in _NAMES}
    try:
        for name in _NAMES:
            setattr(memory, name, getattr(fake, name))
        yield fake
    finally:
        for name, function in saved.items():
            setattr(memory, name, function)


class Injection:
    """Raises `torch.OutOfMemoryError` when `module` is about to run, `times` times, while `when()` holds.

    Attributes:
        raised (`List[str]`): The modules' names, one per error raised.
    """

    def __init__(self, module: torch.nn.Module, times: Optional[int] = 1, when: Callable[[], bool] = lambda: True):
        self.remaining = times
        self.when = when
        self.raised: List[str] = []
        self.handle = module.register_forward_pre_hook(self._maybe_raise)
        self.name = type(module).__name__

    def _maybe_raise(self, module, args) -> None:
        if self.remaining is not None and self.remaining <= 0 or not self.when():
            return
        if self.remaining is not None:
            self.remaining -= 1
        self.raised.append(self.name)
        raise torch.OutOfMemoryError(f"injected: out of memory in {self.name}")

    def remove(self) -> None:
        self.handle.remove()


@contextlib.contextmanager
def out_of_memory(module: torch.nn.Module, times: Optional[int] = 1, when: Callable[[], bool] = lambda: True):
    """Inject `torch.OutOfMemoryError` into `module`'s forward (`times` errors, `None`: every time) while `when()`
    holds. Hook a sub-module of a component to raise inside the component's forward."""
    injection = Injection(module, times, when)
    try:
        yield injection
    finally:
        injection.remove()
