"""`Copier`: how host tensors are copied into device buffers (a streamed block's ring buffer, a kept block) and back
into host tensors (a write-back), on the caller's stream: queued from page-locked memory on a CUDA device, else
blocking. A transfer with a copy stream has its own (`pinning/copy_stream.py`: `CudaCopier`).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from .parts import flatten


class Copier:
    """Fills ring buffers on the caller's stream, when asked. Tokens order the work: `copy` returns one that `wait`
    makes the compute wait on, and `mark` one for the compute work queued so far (the readers of a buffer).

    On a CUDA device (`device` given), a block whose host tensors are all page-locked (`pinning`) is copied with
    `non_blocking=True` (the compute stream orders what follows) and one event per block tells the store when that
    host memory may be unregistered; a block in pageable memory is copied blocking, as `module.to()` would, but its
    file-backed tensors under a host budget (`staging`) through the page-locked staging ring.
    """

    asynchronous = False

    def __init__(self, device: Optional[torch.device] = None, pinning=None, staging=None) -> None:
        self.device, self.pinning, self.staging = device, pinning, staging

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
        """Copy each `(device view, host tensor)` pair, once the work `after` stands for is done; under a host budget
        (`staging`, a `host.staging.Stager`) file-backed host tensors through its page-locked staging ring."""
        if self.staging is not None:
            staged = [pair for pair in pairs if self.staging.file_backed(pair[1])]
            self.staging.ring.copy(staged)
            pairs = [pair for pair in pairs if not self.staging.file_backed(pair[1])] if staged else pairs
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

    def end_forward(self) -> None:
        """A forward of the streaming component ended: every copy asked for is made (no host wait)."""

    def drain(self) -> None:
        """Wait for every copy (before the buffers are let go, and where code that may write the host tensors runs
        next: the host waits)."""
