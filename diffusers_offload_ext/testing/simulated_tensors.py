"""Where the simulated accelerator (`simulated_accelerator.py`) looks for tensors: the inner tensors of wrapper
subclasses (`__tensor_flatten__`: torchao, optimum-quanto) and a moved wrapper's own copies of them, the tensors of
nested inputs and of outputs, aliasing; and the error it raises where host and device tensors meet."""

from __future__ import annotations

from typing import Iterator

import torch
from torch.overrides import resolve_name
from torch.utils import _pytree

_Tensor = torch.Tensor

#: Types that are never wrapper subclasses (the fast path of `_tag` and `_scan`).
PLAIN = frozenset((_Tensor, torch.nn.Parameter))
#: Wrappers nest (a torchao tensor inside another): deeper than this is not looked into.
MAX_DEPTH = 4


def is_wrapper(tensor: torch.Tensor) -> bool:
    """A subclass that holds its data in inner tensors (`__tensor_flatten__`), not in a storage of its own."""
    return callable(getattr(type(tensor), "__tensor_flatten__", None))


def inner_tensors(tensor: torch.Tensor, depth: int = 0) -> Iterator[torch.Tensor]:
    """The inner tensors of a wrapper subclass (nested wrappers' too, to `MAX_DEPTH`); nothing for other tensors."""
    if depth >= MAX_DEPTH or not is_wrapper(tensor):
        return
    names, _ = tensor.__tensor_flatten__()
    for name in names:
        part = getattr(tensor, name, None)
        if isinstance(part, _Tensor):
            yield part
            yield from inner_tensors(part, depth + 1)


def separate_inner(src: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """A wrapper subclass moved across the simulated bus, with inner tensors of its own: torch ran the move on the
    host, where the subclass's inner `.to()` hands back the source's own inner tensors, which an accelerator would have
    copied (the source keeps its place). Rebuilt with copies of those through `__tensor_unflatten__`."""
    names, context = result.__tensor_flatten__()
    sources = list(inner_tensors(src))
    inner, shared = {}, False
    for name in names:
        part = getattr(result, name)
        if any(aliases(part, other) for other in sources if not is_wrapper(other) and not is_wrapper(part)):
            part, shared = part.clone(), True
        inner[name] = part
    if not shared:
        return result
    return type(result).__tensor_unflatten__(inner, context, result.shape, result.stride())


def aliases(result: torch.Tensor, src: torch.Tensor) -> bool:
    try:
        return result is src or result.data_ptr() == src.data_ptr()
    except RuntimeError:  # no data pointer (sparse, ...)
        return result is src


def tensors_in(inputs: tuple) -> Iterator[torch.Tensor]:
    """The tensors among ``inputs`` and in their lists/tuples/dicts; pytree only for nesting below the first level."""
    for arg in inputs:
        if isinstance(arg, _Tensor):
            yield arg
        elif isinstance(arg, (list, tuple)):
            for item in arg:
                if isinstance(item, _Tensor):
                    yield item
                elif isinstance(item, (list, tuple, dict)):
                    yield from (x for x in _pytree.tree_leaves(item) if isinstance(x, _Tensor))
        elif isinstance(arg, dict):
            yield from (x for x in _pytree.tree_leaves(arg) if isinstance(x, _Tensor))


def outputs_of(result, inputs: tuple) -> Iterator[torch.Tensor]:
    """The tensors ``result`` holds that are not inputs handed back (in-place ops keep their own place)."""
    for out in (result,) if isinstance(result, _Tensor) else result if isinstance(result, (list, tuple)) else ():
        if isinstance(out, _Tensor) and not any(out is x for x in inputs):
            yield out


def mixing_error(func, host: torch.Tensor, device: torch.device) -> RuntimeError:
    try:
        name = resolve_name(func) or repr(func)
    except Exception:  # resolve_name is best effort
        name = repr(func)
    return RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two devices, {device} (simulated "
        f"accelerator) and cpu! (in {name}: a host tensor of shape {tuple(host.shape)} met tensors on the device)"
    )
