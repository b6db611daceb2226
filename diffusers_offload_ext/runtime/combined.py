"""Combined pipelines seen whole: the layout of a pipeline that holds sub-pipelines sharing its components (diffusers
marks their classes `_load_connected_pipes`), their exclusions mirrored under the sub-pipelines' own names, and their
sub-pipelines kept quiet while the combined pipeline is armed whole.

Such a pipeline forwards stock offload to its sub-pipelines. With any new option it is armed whole instead: one
session, one ledger, one budget over the combined pipeline's own component names, a chain made of the sub-pipelines'
chains in the order they run.
"""

from __future__ import annotations

import weakref
from typing import List, Optional, Sequence, Tuple

from diffusers import DiffusionPipeline

from ..layout import PipelineLayout, modules_of, split_sequence
from ..marks import COMBINED_ATTR, STOCK, get_session
from .host import disarmed


def is_combined(pipe) -> bool:
    return bool(getattr(type(pipe), "_load_connected_pipes", False))


def sub_pipelines(pipe) -> List[Tuple[str, object]]:
    """The pipelines a combined pipeline holds as attributes, in the order they were assigned."""
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
    if is_combined(pipe) and sub_pipelines(pipe):
        return combined_layout(pipe, class_excluded)
    return PipelineLayout.from_pipeline(pipe, class_excluded=class_excluded)


def quiet_sub_pipelines(pipe) -> None:
    """Before a combined pipeline is armed whole: its sub-pipelines hold no hooks of their own any more (their
    end-of-call offload would otherwise arm them again over the shared modules), and each points to it, so that a
    call of a sub-pipeline, on its own or from the combined pipeline's call, is a call of its session."""
    if not is_combined(pipe):
        return
    for _, sub in sub_pipelines(pipe):
        sub.__dict__[COMBINED_ATTR] = weakref.ref(pipe)
        STOCK["remove_all_hooks"](sub)
        session = get_session(sub)
        if session is not None:
            session.disarm()
            disarmed(session)


def mirror_exclusion(pipe, excluded: Sequence[str]) -> list:
    """A combined pipeline's sub-pipelines see its exclusions too, under their own names (their
    `_execution_device` skips what has no hook); returns what `restore_mirrored` puts back."""
    saved: list = []
    if not excluded or not is_combined(pipe):
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
