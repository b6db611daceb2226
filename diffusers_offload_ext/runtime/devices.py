"""The execution device of `enable_model_cpu_offload`: picked from `gpu_id` and `device` as stock picks it, except
that `device=None` keeps the device set before."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch


def resolve_device(
    gpu_id: Any,
    device: Any,
    previous_device: Optional[torch.device],
    previous_gpu_id: Optional[int],
) -> Tuple[torch.device, int]:
    """Pick the execution device the way stock does, with `device=None` keeping the device set before.

    Returns:
        `(torch.device, int)`: the execution device (always with an index, like stock's `cuda:0`) and its index.
    """
    if gpu_id is not None and (isinstance(gpu_id, bool) or not isinstance(gpu_id, int)):
        raise TypeError(f"`gpu_id` must be an int or None, got {gpu_id!r}.")
    if gpu_id is not None and gpu_id < 0:
        raise ValueError(f"`gpu_id` must be >= 0, got {gpu_id!r}.")
    if device is not None and not isinstance(device, (str, torch.device)):
        raise TypeError(f"`device` must be a str, a `torch.device` or None, got {device!r}.")
    if device is None:
        if previous_device is not None:
            device = torch.device(previous_device.type)
        else:
            device = _default_device()
    try:
        torch_device = torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"`device` must name a torch device such as 'cuda' or 'cuda:1', got {device!r}.") from error
    if gpu_id is not None and torch_device.index is not None:
        raise ValueError(
            f"You passed both `gpu_id`={gpu_id!r} and an index in `device`={device!r}. Pass only one of them, "
            f"for example `device={torch_device.type!r}, gpu_id={gpu_id!r}`."
        )
    if gpu_id is not None:
        index = gpu_id
    elif torch_device.index is not None:
        index = torch_device.index
    else:
        index = previous_gpu_id or 0
    return torch.device(torch_device.type, index), index


def _default_device() -> str:
    try:
        from diffusers.utils.torch_utils import get_device
    except ImportError:  # diffusers < 0.33 defaults to CUDA
        return "cuda"
    found = get_device()
    if found == "cpu":
        raise RuntimeError(
            "`enable_model_cpu_offload` requires an accelerator, but none was found. Pass `device='cpu'` to run "
            "the offload machinery on the CPU (useful for tests)."
        )
    return found
