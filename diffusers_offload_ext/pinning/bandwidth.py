"""Measured copy bandwidth between the host and a device: host-to-device from pageable and from page-locked memory,
device-to-host into fresh host memory (what `module.to("cpu")` does) and into page-locked memory."""

from __future__ import annotations

import time
from typing import Callable, Dict, Optional

import torch

#: Bytes per copy, and copies per measure (the best one counts): about a second on a PCIe 4.0 card.
NBYTES = 256 << 20
REPEATS = 3


def measure(
    device: torch.device,
    *,
    nbytes: int = NBYTES,
    repeats: int = REPEATS,
    synchronize: Optional[Callable[[], None]] = None,
    page_locked: Optional[bool] = None,
) -> Optional[Dict[str, float]]:
    """Bytes per second of each kind of copy between the host and `device`, best of `repeats`; `None` on a device
    that is not CUDA unless `synchronize` is given (tests measure the simulated accelerator that way).

    Args:
        device (`torch.device`): The device.
        nbytes (`int`): Bytes per copy, 1 MiB to 4 GiB.
        repeats (`int`): Copies per kind, 1 to 20.
        synchronize (`Callable`, *optional*): Waits for the device (default: `torch.cuda.synchronize`).
        page_locked (`bool`, *optional*): Whether page-locked host memory can be allocated (default: on CUDA).

    Returns:
        `dict`: `h2d_pageable`, `h2d_page_locked`, `d2h_fresh`, `d2h_page_locked` in bytes per second (the
        page-locked ones only where page-locked memory can be allocated).
    """
    if not (1 << 20) <= nbytes <= (4 << 30) or not 1 <= repeats <= 20:
        raise ValueError(f"`nbytes` must be 1 MiB to 4 GiB and `repeats` 1 to 20, got {nbytes!r} and {repeats!r}.")
    cuda = device.type == "cuda"
    if not cuda and synchronize is None:
        return None
    synchronize = synchronize or (lambda: torch.cuda.synchronize(device))
    page_locked = cuda if page_locked is None else page_locked
    pageable = torch.ones(nbytes, dtype=torch.uint8)
    on_device = pageable.to(device)
    kinds = {"h2d_pageable": lambda: on_device.copy_(pageable), "d2h_fresh": lambda: on_device.to("cpu")}
    if page_locked:
        locked = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        kinds["h2d_page_locked"] = lambda: on_device.copy_(locked)
        kinds["d2h_page_locked"] = lambda: locked.copy_(on_device)
    return {kind: nbytes / best_seconds(copy, repeats, synchronize) for kind, copy in kinds.items()}


def best_seconds(copy: Callable[[], object], repeats: int, synchronize: Callable[[], None]) -> float:
    """The shortest of `repeats` runs of `copy` (after one warm-up), each ended by `synchronize`."""
    copy()  # warm-up
    synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        copy()
        synchronize()
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)
