"""How the code on a hooked forward's path stays out of Dynamo's graphs without costing eager forwards anything:
`outside_graphs` (the hook's methods: never traced, nor what they call) and `own_frame_skipped` (the out-of-memory
guard: its own frame never traced, what it calls compiled).

`torch.compiler.disable(fn)` wraps `fn` in a context that switches Dynamo's frame callback off and on again at every
call, eager or not (two calls into the interpreter's frame evaluation, about 2 us per hooked forward on a CPU where
stock's whole hook costs 6 us). In eager code that callback is off already, so `outside_graphs` reads it first and
calls `fn` itself there; only while Dynamo runs (a compiled caller's graph broke at the hook) does it go through
`torch.compiler.disable`'s context. A caller that checked `eager()` already calls the wrapper's `eager` (`fn` itself). Dynamo, tracing a caller, sees the marks `torch.compiler.disable` leaves and does
not inline the wrapper (a graph break), as before.
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)

_compiler = getattr(torch, "compiler", None)
_disable = getattr(_compiler, "disable", None)
#: Dynamo's frame callback (`None` in eager code); `None` where this torch does not tell it.
frame_callback = getattr(
    getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None), "get_eval_frame_callback", None
)
try:  # marks a function's own code as skipped by Dynamo, without a wrapper frame
    from torch._dynamo.decorators import skip as _skip_code
except ImportError:  # pragma: no cover - a torch without it: `torch.compiler.disable(..., recursive=False)`
    _skip_code = None


def eager() -> bool:
    """Whether no Dynamo frame callback is set (plain eager code). `False` where this torch cannot tell."""
    return frame_callback is not None and frame_callback() is None


def outside_graphs(fn: F) -> F:
    """`fn`, never traced by Dynamo, nor anything it calls; in eager code called directly (see the module's
    docstring)."""
    if _disable is None:
        return fn
    disabled = _disable(fn)
    if frame_callback is None:
        return disabled

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if frame_callback() is None:
            return fn(*args, **kwargs)
        return disabled(*args, **kwargs)

    # What Dynamo reads of a disabled function: it does not inline it (a graph break), and skips its frame.
    call._torchdynamo_disable = True
    call.eager = fn  # what a caller that checked `eager()` itself may call instead
    if _skip_code is not None:
        _skip_code(call)
    return call


def own_frame_skipped(fn: F) -> F:
    """`fn` whose own frame Dynamo does not trace (a compiled caller's graph ends at its call), while it compiles
    what `fn` calls; without a wrapper frame where this torch allows it."""
    if _skip_code is not None:
        return _skip_code(fn)
    if _disable is None:
        return fn
    try:
        return _disable(fn, recursive=False)
    except TypeError:  # a torch without `recursive`
        return fn
