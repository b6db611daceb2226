"""How much memory the execution device has: free and total bytes, the capacity a budget can count on, the peak of
allocated bytes (the activations are learnt from it), and giving cached memory back.

On any device other than CUDA they return `None` (or do nothing): no automatic budget, no re-reading of free memory, no
peak to learn from. Tests replace these functions (monkeypatch; `testing/device_memory.py` backs them with the
simulated accelerator's counts) to run the CUDA code paths on the CPU.
"""

from __future__ import annotations

from typing import Callable, Optional

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


def capacity(device: torch.device, reserve: int) -> Optional[Callable[[int], Optional[int]]]:
    """Where free memory can be read: a function that, given the bytes of weights the pipeline holds on the device,
    returns the bytes of weights it could hold now (free memory plus what it holds, minus `reserve`). `None` where
    free memory cannot be read."""
    if free_bytes(device) is None:
        return None

    def room(held: int) -> Optional[int]:
        free = free_bytes(device)
        return None if free is None else free + held - reserve

    return room


def allocated_bytes(device: torch.device) -> Optional[int]:
    """Bytes of tensors allocated on `device` by this process now; `None` where it cannot be known (not CUDA)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.memory_allocated(device))


def peak_bytes(device: torch.device) -> Optional[int]:
    """The most bytes allocated on `device` since the last `reset_peak`; `None` where it cannot be known."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.max_memory_allocated(device))


def reset_peak(device: torch.device) -> None:
    """`peak_bytes` starts again from what is allocated now (CUDA only; nothing elsewhere)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def release_cached(device: torch.device) -> None:
    """Give the memory the caching allocator holds unused back to the device (`torch.cuda.empty_cache()`), so that
    what an eviction freed can serve any allocation size. Nothing elsewhere."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.empty_cache()
