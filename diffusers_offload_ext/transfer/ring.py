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

#: Every tensor of a block starts at a multiple of this many bytes in its buffer.
ALIGN = 256


def streamable(tensor: torch.Tensor) -> bool:
    """Whether `tensor` can live in a ring buffer: a plain dense tensor on the host (subclasses such as quantized or
    GGUF weights, sparse tensors and `meta` tensors stream only as whole components)."""
    data = tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor
    return type(data) is torch.Tensor and tensor.layout == torch.strided and tensor.device.type == "cpu"


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
    """Fills ring buffers at once, on the caller's stream (a device without a copy stream). Tokens order the work:
    `copy` returns one that `wait` makes the compute wait on, and `mark` one that a later `copy` into the same buffer
    waits on (the compute work that read the buffer before)."""

    asynchronous = False

    def copy(self, pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]], after: Optional[object] = None) -> object:
        """Copy each `(device view, host tensor)` pair, once the work `after` stands for is done."""
        with torch.no_grad():
            for view, host in pairs:
                view.copy_(host)
        return None

    def wait(self, token: Optional[object]) -> None:
        """Make the compute that follows wait for the copy `token` stands for."""

    def mark(self) -> Optional[object]:
        """A token for the compute work queued so far."""
        return None

    def drain(self) -> None:
        """Wait for every copy (before the buffers are let go)."""


class CudaCopier(Copier):
    """Fills ring buffers on a CUDA copy stream with `non_blocking` copies (from page-locked memory they overlap
    compute), each buffer rewritten only after the compute that read it. Not run in CI (no GPU)."""

    asynchronous = True

    def __init__(self, stream: "torch.cuda.Stream", device: torch.device) -> None:
        self.stream = stream
        self.device = device

    def copy(self, pairs, after=None):
        if after is not None:
            self.stream.wait_event(after)
        with torch.no_grad(), torch.cuda.stream(self.stream):
            for view, host in pairs:
                view.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def wait(self, token) -> None:
        if token is not None:
            torch.cuda.current_stream(self.device).wait_event(token)

    def mark(self):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def drain(self) -> None:
        self.stream.synchronize()
