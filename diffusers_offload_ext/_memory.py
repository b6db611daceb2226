"""How much memory the execution device has: the only CUDA-specific code of the residency manager.

Everything else asks these two functions, so tests can replace them (monkeypatch `free_bytes` / `total_bytes`) and
run the CUDA code paths on the CPU. On any device other than CUDA both return `None`: no automatic budget, no
re-reading of free memory.
"""

from __future__ import annotations

from typing import Optional

import torch


def free_bytes(device: torch.device) -> Optional[int]:
    """Bytes a new allocation on `device` can still get: free device memory plus what PyTorch's caching allocator
    holds unused (an evicted component's memory goes there first). `None` where it cannot be known (not CUDA)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free) + max(int(cached), 0)


def total_bytes(device: torch.device) -> Optional[int]:
    """Total memory of `device`; `None` where it cannot be known (not CUDA)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.mem_get_info(device)[1])
