"""The plain tensors behind one parameter or buffer, whatever its format, and how to put others in their place: the
inner tensors of a wrapper subclass (torchao, optimum-quanto: `__tensor_flatten__`), the storage of a `Parameter`
subclass (bitsandbytes' `Params4bit`, diffusers' `GGUFParameter`) seen as a plain tensor, and the quantization state
a tensor carries as attributes (`quant_state`). Moves, the ring, host copies and change checks work on these, so they
see into every format the same way.

A wrapper parameter is moved as `Module.to()` moves it: its contents swapped in place (`torch.utils.swap_tensors`),
so that the object users and the module hold stays the same; setting a wrapper's `.data` would leave its inner
tensors where they were.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..storages import MAX_DEPTH, is_wrapper, tensor_state

_PLAIN = (torch.Tensor, torch.nn.Parameter)


class Spec(NamedTuple):
    """How a wrapper subclass is rebuilt from its inner tensors (`None` in place of a `Spec`: a plain tensor)."""

    cls: type
    names: Tuple[str, ...]
    context: object
    size: torch.Size
    stride: Tuple[int, ...]
    children: Tuple[Optional["Spec"], ...]


def as_plain(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as a plain tensor on the same storage (itself if it is one; a `Parameter` subclass's storage seen
    without its class, sharing its version counter)."""
    if type(tensor) in _PLAIN:
        return tensor
    return torch.Tensor._make_subclass(torch.Tensor, tensor, False)


def flatten(tensor: torch.Tensor, detached: bool = False, depth: int = 0) -> Tuple[Optional[Spec], List[torch.Tensor]]:
    """`(spec, leaves)`: the plain tensors holding `tensor`'s bytes (its inner tensors, depth first, for a wrapper)
    and how to rebuild it from them. With `detached`, a parameter's leaf is its `.data` (what stays on the host when
    the parameter itself is moved), else the tensor itself."""
    if depth < MAX_DEPTH and is_wrapper(tensor):
        names, context = tensor.__tensor_flatten__()
        children, leaves = [], []
        for name in names:
            spec, inner = flatten(getattr(tensor, name), False, depth + 1)
            children.append(spec)
            leaves += inner
        return (
            Spec(type(tensor), tuple(names), context, tensor.size(), tuple(tensor.stride()), tuple(children)),
            leaves,
        )
    if detached and isinstance(tensor, torch.nn.Parameter):
        tensor = tensor.data
    return None, [as_plain(tensor)]


def unflatten(spec: Optional[Spec], leaves: Sequence[torch.Tensor], start: int = 0) -> Tuple[torch.Tensor, int]:
    """`(tensor, next)`: the tensor `spec` describes, made of `leaves[start:]`, and the index after the leaves it
    used."""
    if spec is None:
        return leaves[start], start + 1
    inner = {}
    for name, child in zip(spec.names, spec.children):
        inner[name], start = unflatten(child, leaves, start)
    return spec.cls.__tensor_unflatten__(inner, spec.context, spec.size, spec.stride), start


def state_leaves(states) -> List[torch.Tensor]:
    """The tensors now in place of `states` (`(owner, attribute, tensor)` triples: `storages.tensor_state`)."""
    return [getattr(owner, name) for owner, name, _ in states]


def leaves_of(tensor: torch.Tensor, states) -> List[torch.Tensor]:
    """Every plain tensor holding `tensor`'s bytes now, its quantization state `states` included."""
    return flatten(tensor)[1] + state_leaves(states)


def streamable(tensor: torch.Tensor) -> bool:
    """Whether `tensor` can pass through a ring buffer: every plain tensor behind it, its quantization state
    included, is a dense tensor on the host."""
    parts = flatten(tensor, detached=True)[1] + [t for _, _, t in tensor_state(tensor)]
    return all(type(t) in _PLAIN and t.layout == torch.strided and t.device.type == "cpu" for t in parts)


def as_parameter(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`value` as a parameter like `like` (its `requires_grad`)."""
    return torch.nn.Parameter(value, requires_grad=like.requires_grad)


def swap_in_place(parameter: torch.Tensor, value: torch.Tensor) -> None:
    """Give wrapper `parameter` the contents of `value`, keeping the object (as `Module.to()` does)."""
    torch.utils.swap_tensors(parameter, as_parameter(value, parameter))


def move_tensor(table: dict, key: str, is_param: bool, device: torch.device, non_blocking: bool = False) -> None:
    """Move the tensor in `table[key]` to `device`: a wrapper parameter swapped in place, another parameter's `.data`
    replaced (the object stays), a buffer replaced. Quantization state is not moved (`quant_state.carry`)."""
    tensor = table[key]
    if is_param and is_wrapper(tensor):
        swap_in_place(tensor, tensor.to(device, non_blocking=non_blocking))
    elif is_param:
        tensor.data = tensor.data.to(device, non_blocking=non_blocking)
    else:
        table[key] = tensor.to(device, non_blocking=non_blocking)
