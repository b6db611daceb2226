"""Pipelines that override `enable_model_cpu_offload` themselves: which of them the new options can reach, and the
adapter that gives them the options (its signature made from the options table).

Combined pipelines (`combined.py`) are armed whole with any new option. Pipelines whose override chains hooks on
sub-modules of a component and declare no `model_cpu_offload_seq` (AudioLDM2, MusicLDM) cannot be described per
component: they reject the new options with a clear error. Without new options every override runs as it is.
"""

from __future__ import annotations

import functools
import inspect
from typing import Optional, Tuple

from diffusers import DiffusionPipeline

from ..marks import ADAPTED, get_session
from . import methods
from .combined import is_combined, sub_pipelines
from .options import NEW_OPTIONS, signature, take


def own_override(cls: type) -> Optional[object]:
    """The `enable_model_cpu_offload` that `cls` or a base below `DiffusionPipeline` defines, if any."""
    for klass in cls.__mro__:
        if klass is DiffusionPipeline:
            return None
        method = klass.__dict__.get("enable_model_cpu_offload")
        if method is not None and method is not methods.enable_model_cpu_offload:
            return getattr(method, ADAPTED, method)
    return None


def support(cls: type) -> Tuple[bool, str]:
    """Whether the new options can reach pipelines of class `cls`, and why (or why not)."""
    if own_override(cls) is None:
        if getattr(cls, "model_cpu_offload_seq", None):
            return True, "stock's `enable_model_cpu_offload`, extended"
        return False, "it declares no `model_cpu_offload_seq`, so stock model offload cannot be enabled on it either"
    if getattr(cls, "_load_connected_pipes", False):
        return True, "a combined pipeline: armed whole, over its own component names, with its sub-pipelines' chains"
    if getattr(cls, "model_cpu_offload_seq", None):
        return True, "its own override is replaced by the extended stock method when a new option is given"
    return False, (
        "its own `enable_model_cpu_offload` chains offload hooks on sub-modules of its components (such as "
        "`text_encoder.text_model`) in an order it declares nowhere else (it has no `model_cpu_offload_seq`), which "
        "per-component options cannot describe"
    )


def adapt(original):
    """`original` (a class's own `enable_model_cpu_offload`) with the new options: without them, and while the
    extension has not armed the pipeline, `original` runs as it is; with them, the extended method runs (or a clear
    error, before anything changes, for a class they cannot reach)."""
    accepted = set(inspect.signature(original).parameters)

    @functools.wraps(original)
    def enable_model_cpu_offload(self, gpu_id=None, device=None, **options):
        options = take("enable_model_cpu_offload", options)
        session = get_session(self)
        given = [name for name in NEW_OPTIONS if options.get(name) is not None]
        if not given and (session is None or not session.active):
            stock = {k: v for k, v in (("gpu_id", gpu_id), ("device", device)) if v is not None and k in accepted}
            result = original(self, **stock)
            _remember_device(self)
            return result
        supported, reason = support(type(self))
        if not supported:
            raise TypeError(
                f"`{type(self).__name__}.enable_model_cpu_offload` cannot take {given!r}: {reason}. Call "
                f"`enable_model_cpu_offload()` without them for its own model offload, or "
                f"`enable_sequential_cpu_offload()`."
            )
        return methods.enable_model_cpu_offload(self, gpu_id, device, **options)

    del (
        enable_model_cpu_offload.__wrapped__
    )  # its signature is the adapter's (with the new options), not the original's
    enable_model_cpu_offload.__signature__ = signature(enable_model_cpu_offload)
    setattr(enable_model_cpu_offload, ADAPTED, original)
    return enable_model_cpu_offload


def _remember_device(pipe) -> None:
    """After a combined pipeline's own method (it enables its sub-pipelines), the device they chose, on it too: a
    later enable with a new option and no `device` keeps it, as for every other pipeline."""
    for _, sub in sub_pipelines(pipe) if is_combined(pipe) else ():
        if getattr(sub, "_offload_device", None) is not None:
            pipe._offload_device, pipe._offload_gpu_id = sub._offload_device, getattr(sub, "_offload_gpu_id", None)
            return
