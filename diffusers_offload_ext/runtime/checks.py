"""The checks made before arming that depend on more than the arguments: stock's own errors (group offloading,
device maps, no `model_cpu_offload_seq`) and options the execution device must support."""

from __future__ import annotations

import torch

from ..layout import PipelineLayout
from ..pinning import store as pinned
from .options import OffloadOptions


def raise_like_stock(pipe, layout: PipelineLayout) -> None:
    """The checks stock's `enable_model_cpu_offload` makes before changing anything, with stock's errors."""
    if hasattr(pipe, "_maybe_raise_error_if_group_offload_active"):
        pipe._maybe_raise_error_if_group_offload_active(raise_error=True)
    if hasattr(pipe, "_maybe_raise_error_if_tensor_parallel_active"):
        pipe._maybe_raise_error_if_tensor_parallel_active()
    if hasattr(pipe, "_is_pipeline_device_mapped"):
        device_mapped = pipe._is_pipeline_device_mapped()
    else:
        device_mapped = pipe.hf_device_map is not None and len(pipe.hf_device_map) > 1
    if device_mapped:
        raise ValueError(
            "It seems like you have activated a device mapping strategy on the pipeline so calling "
            "`enable_model_cpu_offload() isn't allowed. You can call `reset_device_map()` first and then call "
            "`enable_model_cpu_offload()`."
        )
    if not layout.sequence and getattr(pipe, "model_cpu_offload_seq", None) is None:
        # An empty sequence is allowed, as in stock: every model is then hooked outside the chain.
        raise ValueError(
            "Model CPU offload cannot be enabled because no `model_cpu_offload_seq` class attribute is set."
        )


def check_pinning(options: OffloadOptions, device: torch.device) -> None:
    """`pin_memory=True` needs a device whose host memory can be page-locked."""
    if options.pin_memory is True and device.type not in pinned.LOCKERS:
        raise ValueError(
            f"`pin_memory=True` needs an execution device whose host memory can be page-locked "
            f'({sorted(pinned.LOCKERS)}), got {str(device)!r}. Pass `pin_memory="auto"` to page-lock only '
            f"where the device supports it, or `pin_memory=False`."
        )
