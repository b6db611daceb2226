"""What the extension leaves on diffusers objects, and how to recognise it: the attribute that holds a pipeline's
session, the marks on the functions that replace or wrap pipeline methods, stock's own methods captured before
`install()` replaces them, the marker of the extension's offload hook, and the link from a sub-pipeline to the
combined pipeline armed whole over it."""

from __future__ import annotations

import weakref
from typing import Any, Optional

from diffusers import DiffusionPipeline

#: Attribute of the pipeline (in its `__dict__`) that holds its `Session`.
SESSION_ATTR = "_offload_ext_session"
#: Marks a function of ours that replaced a `DiffusionPipeline` method or wraps a `__call__` (the value: what it
#: replaced or wraps).
MARK = "__offload_ext_wraps__"
#: Attribute of a combined pipeline's sub-pipeline (in its `__dict__`): a weak reference to the combined pipeline
#: armed whole over it, whose session a call of the sub-pipeline belongs to.
COMBINED_ATTR = "_offload_ext_combined"
#: Set on an adapted override of `enable_model_cpu_offload`, pointing to the class's own method.
ADAPTED = "__offload_ext_adapts__"
#: A class attribute, true on the extension's offload hook (`DeferredCpuOffload`).
HOOK_MARK = "_offload_ext_hook"

#: Each session's host side under a host budget (`host/keeper.py`'s `HostKeeper`: its plan, staging ring and last
#: measurement of host bytes by kind), kept beside the session: the runtime writes it, the trace reads it.
HOST_SIDES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

#: The `DiffusionPipeline` methods `install()` replaces.
REPLACED = (
    "enable_model_cpu_offload",
    "remove_all_hooks",
    "to",
    "maybe_free_model_hooks",
    "progress_bar",
    "__setattr__",
)

#: Stock's methods, captured before `install()` can replace them.
STOCK = {name: getattr(DiffusionPipeline.__dict__[name], MARK, DiffusionPipeline.__dict__[name]) for name in REPLACED}


def get_session(pipe) -> Optional[Any]:
    """The extension's `Session` of `pipe`, or `None` when the extension never armed it."""
    return pipe.__dict__.get(SESSION_ATTR)


def host_side(session) -> Optional[Any]:
    """The host side (`HostKeeper`) of `session`, or `None` where no host budget was ever in force."""
    return HOST_SIDES.get(session) if session is not None else None


def extension_hook(hook) -> Optional[Any]:
    """The extension's offload hook in accelerate hook `hook` (the hook itself, or one that a `SequentialHook`
    chains), or `None`."""
    if getattr(hook, HOOK_MARK, False):
        return hook
    for inner in getattr(hook, "hooks", None) or ():
        found = extension_hook(inner)
        if found is not None:
            return found
    return None


def combined_of(pipe) -> Optional[Any]:
    """The combined pipeline that armed `pipe` (one of its sub-pipelines) whole, or `None`."""
    reference = pipe.__dict__.get(COMBINED_ATTR)
    return reference() if reference is not None else None
