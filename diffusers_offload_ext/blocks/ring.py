"""`Ring`: the preallocated device buffers that streamed blocks pass through, and how a block's tensors lie in one
buffer.

A buffer is one `uint8` allocation made when a component starts streaming and freed when it stops: streaming a block
reinterprets a slice of it as each tensor (`view(dtype).view(shape)`), so the hot path allocates nothing and never
empties the allocator's cache. Each tensor starts at a multiple of `ALIGN` bytes (what CUDA kernels expect of an
allocation, and a multiple of every element size). `transfer/copier.py` fills the buffers.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

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
