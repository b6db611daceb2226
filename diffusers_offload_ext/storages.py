"""Bytes as the storages hold them: the plain tensors behind a module's parameters and buffers, seen through tensor
subclasses and their quantization state, each storage counted once.

A quantized weight is rarely one plain tensor. A wrapper subclass (torchao, optimum-quanto) has no storage of its own:
its bytes are in the inner tensors that `__tensor_flatten__` names, and its `numel() * element_size()` is the
dequantized size. A `Parameter` subclass may carry more tensors as attributes: bitsandbytes' `Params4bit.quant_state`
(`absmax`, `code`, a nested `state2`), `Int8Params.SCB`. `tensor_parts` finds all of them; `storage_nbytes` adds
their bytes, one storage once (tied weights, a parameter that is a view of another).
"""

from __future__ import annotations

from typing import Dict, Iterable, Iterator, List, Set, Tuple

import torch

#: How deep attributes and nested wrappers are followed (`quant_state.state2.absmax` is three deep).
MAX_DEPTH = 4
_PLAIN = frozenset((torch.Tensor, torch.nn.Parameter))
#: Attribute values never walked into: modules (`Params4bit.module` is its own layer) and plain values.
_SCALARS = (torch.nn.Module, type, str, bytes, int, float, bool, torch.dtype, torch.Size)


def is_wrapper(tensor: torch.Tensor) -> bool:
    """Whether `tensor` holds its data in inner tensors (`__tensor_flatten__`) rather than in a storage of its own."""
    return callable(getattr(type(tensor), "__tensor_flatten__", None))


def _attributes(value: object, depth: int) -> Iterator[torch.Tensor]:
    """Tensors among the attributes of `value` (a tensor or a state object), followed to `MAX_DEPTH`; modules are
    never entered (`Params4bit.module` is its own layer)."""
    if depth >= MAX_DEPTH:
        return
    try:
        attributes = vars(value)
    except TypeError:
        return
    for item in list(attributes.values()):
        if isinstance(item, torch.Tensor):
            yield from _parts(item, depth + 1)
        elif item is not None and not isinstance(item, _SCALARS):
            yield from _attributes(item, depth + 1)


def _parts(tensor: torch.Tensor, depth: int) -> Iterator[torch.Tensor]:
    if depth >= MAX_DEPTH:
        return
    if type(tensor) in _PLAIN:
        yield tensor
        return
    if is_wrapper(tensor):
        names, _ = tensor.__tensor_flatten__()
        for name in names:
            inner = getattr(tensor, name, None)
            if isinstance(inner, torch.Tensor):
                yield from _parts(inner, depth + 1)
    else:
        yield tensor
    yield from _attributes(tensor, depth)


def tensor_state(tensor: torch.Tensor) -> List[Tuple[object, str, torch.Tensor]]:
    """`(owner, attribute, tensor)` of every tensor `tensor` carries as an attribute, followed through state objects
    (bitsandbytes' `Params4bit.quant_state.absmax`, `.code`, `.state2.absmax`; `Int8Params.SCB`), never into modules:
    the quantization state a move of the tensor's data alone would leave behind."""
    found: List[Tuple[object, str, torch.Tensor]] = []
    seen: Set[int] = set()

    def walk(owner: object, depth: int) -> None:
        if depth >= MAX_DEPTH or id(owner) in seen:
            return
        seen.add(id(owner))
        try:
            attributes = vars(owner)
        except TypeError:
            return
        for name, item in list(attributes.items()):
            if isinstance(item, torch.Tensor):
                if item is not tensor:
                    found.append((owner, name, item))
            elif item is not None and not isinstance(item, _SCALARS):
                walk(item, depth + 1)

    if type(tensor) not in _PLAIN and not is_wrapper(tensor):
        walk(tensor, 0)
    return found


def tensor_parts(tensor: torch.Tensor) -> List[torch.Tensor]:
    """The tensors that hold `tensor`'s bytes: itself if it has a storage of its own, the inner tensors of a wrapper
    subclass, and tensors it carries as attributes (quantization state), each object once."""
    seen: Set[int] = set()
    out = []
    for part in _parts(tensor, 0):
        if id(part) not in seen:
            seen.add(id(part))
            out.append(part)
    return out


def _storage_key(tensor: torch.Tensor) -> Tuple:
    """What identifies `tensor`'s storage: its address on its device; a tensor of its own where storages have none
    (`meta`, whose addresses are all zero)."""
    try:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return ("object", id(tensor)), None
    if pointer == 0:
        return ("object", id(tensor)), None
    return (str(tensor.device), pointer), storage.nbytes()


def storage_nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages behind `tensors` (seen through subclasses by `tensor_parts`), each storage once.

    Per storage, the bytes of the distinct views that use it, at most the storage's size: a weight tied to another is
    counted once, and a small view of a large storage (a slice) counts its own bytes, as a move of it copies.
    """
    views: Dict[Tuple, Dict[Tuple, int]] = {}
    limits: Dict[Tuple, int] = {}
    for tensor in tensors:
        for part in tensor_parts(tensor):
            key, limit = _storage_key(part)
            view = (part.storage_offset(), tuple(part.shape), tuple(part.stride()), part.dtype)
            views.setdefault(key, {})[view] = part.numel() * part.element_size()
            if limit is not None:
                limits[key] = limit
    total = 0
    for key, sizes in views.items():
        used = sum(sizes.values())
        total += min(used, limits[key]) if key in limits else used
    return total


def module_tensors(module: torch.nn.Module) -> List[torch.Tensor]:
    """The parameters and buffers of `module` and its sub-modules, each tensor object once."""
    seen: Set[int] = set()
    out = []
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for tensor in table.values():
                if tensor is not None and id(tensor) not in seen:
                    seen.add(id(tensor))
                    out.append(tensor)
    return out


#: Attributes of a layer that hold its weights' quantization state outside its parameters: bitsandbytes'
#: `Linear8bitLt.state` (a `MatmulLtState`), where the row scales (`SCB`) go after the layer's first forward.
LAYER_STATE = ("state",)


def layer_state(module: torch.nn.Module) -> List[torch.Tensor]:
    """Tensors that `module`'s layers hold in a quantization state object (`LAYER_STATE`), each object once."""
    found: List[torch.Tensor] = []
    for sub in module.modules():
        for name in LAYER_STATE:
            value = vars(sub).get(name)
            if value is not None and not isinstance(value, (torch.Tensor,) + _SCALARS):
                found += _attributes(value, 1)
    return found


def module_storage_nbytes(module: torch.nn.Module) -> int:
    """Bytes of the storages behind `module`'s parameters and buffers, quantization state included (a layer's own,
    `layer_state`, too), each storage once (`storage_nbytes`)."""
    return storage_nbytes(module_tensors(module) + layer_state(module))
