"""Pipelines that override `enable_model_cpu_offload` themselves: which of them the new options can reach, the adapter
that gives them the options, and the layout of a combined pipeline seen whole.

Combined pipelines (diffusers marks them `_load_connected_pipes`: a prior pipeline and a decoder pipeline sharing
the combined pipeline's components) forward stock offload to their sub-pipelines. With any new option they are armed
whole instead: one session, one ledger, one budget over the combined pipeline's own component names, a chain made of
the sub-pipelines' chains in the order they run. Pipelines whose override chains hooks on sub-modules of a component
and declare no `model_cpu_offload_seq` (AudioLDM2, MusicLDM) cannot be described per component: they reject the new
options with a clear error. Without new options every override runs as it is.
"""

from __future__ import annotations

import functools
import inspect
from typing import List, Optional, Sequence, Tuple

from ..layout import PipelineLayout, modules_of, split_sequence

NEW_OPTIONS = (
    "exclude_from_offload",
    "keep_on_device_during_generation",
    "memory_budget",
    "memory_reserve",
    "keep_on_device_between_generations",
    "zero_copy_eviction",
    "pin_memory",
    "prefetch",
)
#: Set on an adapted override, pointing to the class's own method.
ADAPTED = "__offload_ext_adapts__"


def own_override(cls: type) -> Optional[object]:
    """The `enable_model_cpu_offload` that `cls` or a base below `DiffusionPipeline` defines, if any."""
    from diffusers import DiffusionPipeline

    for klass in cls.__mro__:
        if klass is DiffusionPipeline:
            return None
        method = klass.__dict__.get("enable_model_cpu_offload")
        if method is not None and not _ours(method):
            return getattr(method, ADAPTED, method)
    return None


def _ours(method) -> bool:
    from .methods import METHODS

    return method is METHODS["enable_model_cpu_offload"]


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


def sub_pipelines(pipe) -> List[Tuple[str, object]]:
    """The pipelines a combined pipeline holds as attributes, in the order they were assigned."""
    from diffusers import DiffusionPipeline

    return [(name, value) for name, value in vars(pipe).items() if isinstance(value, DiffusionPipeline)]


def combined_layout(pipe, class_excluded: Optional[Sequence[str]] = None) -> PipelineLayout:
    """The layout of a combined pipeline over its own component names: its `model_cpu_offload_seq` if it has one,
    else its sub-pipelines' sequences in the order they were assigned; its class exclusions and theirs."""
    order = tuple(modules_of(pipe.components))
    names = {id(module): name for name, module in modules_of(pipe.components).items()}
    sequence = split_sequence(getattr(pipe, "model_cpu_offload_seq", None))
    excluded = list(class_excluded if class_excluded is not None else getattr(pipe, "_exclude_from_cpu_offload", ()))
    for _, sub in sub_pipelines(pipe):
        own = {id(m): n for n, m in modules_of(sub.components).items()}
        mapped = {n: names[i] for i, n in own.items() if i in names}
        if not getattr(pipe, "model_cpu_offload_seq", None):
            sequence += tuple(mapped[n] for n in split_sequence(sub.model_cpu_offload_seq) if n in mapped)
        excluded += [mapped[n] for n in getattr(sub, "_exclude_from_cpu_offload", ()) or () if n in mapped]
    return PipelineLayout(
        order=order,
        sequence=tuple(dict.fromkeys(sequence)),
        class_excluded=tuple(n for n in dict.fromkeys(excluded) if n in order),
    )


def layout_of(pipe, class_excluded: Optional[Sequence[str]] = None) -> PipelineLayout:
    """The layout enable arms: a combined pipeline's whole one, else the pipeline's own."""
    if getattr(type(pipe), "_load_connected_pipes", False) and sub_pipelines(pipe):
        return combined_layout(pipe, class_excluded)
    return PipelineLayout.from_pipeline(pipe, class_excluded=class_excluded)


def quiet_sub_pipelines(pipe) -> None:
    """Before a combined pipeline is armed whole: its sub-pipelines hold no hooks of their own any more (their
    end-of-call offload would otherwise arm them again over the shared modules)."""
    from ..marks import STOCK, get_session

    if not getattr(type(pipe), "_load_connected_pipes", False):
        return
    for _, sub in sub_pipelines(pipe):
        STOCK["remove_all_hooks"](sub)
        session = get_session(sub)
        if session is not None:
            session.active = False


def mirror_exclusion(pipe, excluded: Sequence[str]) -> list:
    """A combined pipeline's sub-pipelines see its exclusions too, under their own names (their
    `_execution_device` skips what has no hook); returns what `restore_mirrored` puts back."""
    saved: list = []
    if not excluded or not getattr(type(pipe), "_load_connected_pipes", False):
        return saved
    names = {id(module): name for name, module in modules_of(pipe.components).items()}
    for _, sub in sub_pipelines(pipe):
        mine = [n for n, m in modules_of(sub.components).items() if names.get(id(m)) in excluded]
        if mine:
            saved.append(
                (sub, "_exclude_from_cpu_offload" in sub.__dict__, sub.__dict__.get("_exclude_from_cpu_offload"))
            )
            current = list(getattr(sub, "_exclude_from_cpu_offload", None) or [])
            sub.__dict__["_exclude_from_cpu_offload"] = list(dict.fromkeys(current + mine))
    return saved


def restore_mirrored(saved: list) -> None:
    for sub, had, value in reversed(saved):
        if had:
            sub.__dict__["_exclude_from_cpu_offload"] = value
        else:
            sub.__dict__.pop("_exclude_from_cpu_offload", None)


def adapt(original):
    """`original` (a class's own `enable_model_cpu_offload`) with the new options: without them, and while the
    extension has not armed the pipeline, `original` runs as it is; with them, the extended method runs (or a clear
    error, before anything changes, for a class they cannot reach)."""
    accepted = set(inspect.signature(original).parameters)

    @functools.wraps(original)
    def enable_model_cpu_offload(
        self,
        gpu_id=None,
        device=None,
        *,
        exclude_from_offload=None,
        keep_on_device_during_generation=None,
        memory_budget=None,
        memory_reserve=None,
        keep_on_device_between_generations=None,
        zero_copy_eviction=None,
        pin_memory=None,
        prefetch=None,
    ):
        from ..marks import get_session
        from .methods import METHODS

        options = {name: value for name, value in locals().items() if name in NEW_OPTIONS}
        session = get_session(self)
        given = [name for name in NEW_OPTIONS if options.get(name) is not None]
        if not given and (session is None or not session.active):
            stock = {k: v for k, v in (("gpu_id", gpu_id), ("device", device)) if v is not None and k in accepted}
            return original(self, **stock)
        supported, reason = support(type(self))
        if not supported:
            raise TypeError(
                f"`{type(self).__name__}.enable_model_cpu_offload` cannot take {given!r}: {reason}. Call "
                f"`enable_model_cpu_offload()` without them for its own model offload, or "
                f"`enable_sequential_cpu_offload()`."
            )
        return METHODS["enable_model_cpu_offload"](self, gpu_id, device, **options)

    del (
        enable_model_cpu_offload.__wrapped__
    )  # its signature is the adapter's (with the new options), not the original's
    setattr(enable_model_cpu_offload, ADAPTED, original)
    return enable_model_cpu_offload
