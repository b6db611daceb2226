"""Blocks: how a component splits into the units that block residency keeps on the device or streams, found from the
module tree alone (the repeated entries of its `ModuleList`s, and the rest as one block), never from class names.

Rules, in order:

1. Every `torch.nn.ModuleList` that is not inside an entry already taken gives one block per entry that holds
   tensors (`transformer_blocks.3`, `encoder.block.11`, `down_blocks.0`). The outermost list wins: the resnets inside a
   UNet down block stay part of that block.
2. A block that shares a tensor with anything outside it (tied weights) is folded into the rest: a tensor is in
   exactly one block.
3. Everything else (embeddings, norms, projections, a UNet's mid block) is one block named `REST`. A component with
   no repeated entries is one block.

Blocks are listed in module order, the rest first. The blocks of a module built on the `meta` device have the same
names and sizes as the real ones, so the planner sizes them without memory.
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Tuple

import torch

from ..storages import storage_nbytes

#: The name of the block that holds what no repeated entry holds.
REST = "<rest>"
#: `(sub-module, is_parameter, name)`: where one tensor of a block lives.
Slot = Tuple[torch.nn.Module, bool, str]


class Block(NamedTuple):
    """One block of a component.

    Args:
        name (`str`): Its qualified name in the component (`"transformer_blocks.3"`), or `REST`.
        module (`torch.nn.Module`): The module that runs it: the list entry, or the component itself for `REST`
            (its tensors are needed whenever the component runs).
        slots (`Tuple[Slot, ...]`): Where each of its tensors lives, each tensor once.
        nbytes (`int`): Bytes of the storages behind those tensors (`storages.storage_nbytes`: through tensor
            subclasses, quantization state included).
    """

    name: str
    module: torch.nn.Module
    slots: Tuple[Slot, ...]
    nbytes: int


def _tensor_slots(module: torch.nn.Module, seen: Dict[int, str], owner: str) -> Dict[int, Slot]:
    """Slots of `module`'s tensors not already in `seen` (id -> owner), recorded there as `owner`'s."""
    found: Dict[int, Slot] = {}
    for sub in module.modules():
        for is_param, table in ((True, sub._parameters), (False, sub._buffers)):
            for key, tensor in table.items():
                if tensor is None:
                    continue
                if id(tensor) not in seen:
                    seen[id(tensor)] = owner
                    found[id(tensor)] = (sub, is_param, key)
    return found


def _lists(module: torch.nn.Module, prefix: str = ""):
    """The outermost `ModuleList`s: `(qualified name, list)`, in module order."""
    for name, child in module.named_children():
        qualified = f"{prefix}{name}"
        if isinstance(child, torch.nn.ModuleList):
            yield qualified, child
        else:
            yield from _lists(child, qualified + ".")


def _nbytes(slots) -> int:
    """Bytes of the storages behind the slots' tensors (quantization state included), each storage once."""
    return storage_nbytes((sub._parameters if is_param else sub._buffers)[key] for sub, is_param, key in slots)


def find_blocks(component: torch.nn.Module) -> List[Block]:
    """The blocks of `component` (see the module docstring): every tensor in exactly one block, the rest first (left
    out when it holds no tensor)."""
    entries = []
    for list_name, modules in _lists(component):
        for index, entry in enumerate(modules):
            if entry is not None:  # a `ModuleList` may hold `None` where a layer is left out (Mochi's VAE)
                entries.append((f"{list_name}.{index}", entry))
    # Who refers to each tensor: an entry's tensor also reachable from elsewhere is shared.
    owners: Dict[int, set] = {}
    for name, entry in entries:
        for tensor in list(entry.parameters()) + list(entry.buffers()):
            owners.setdefault(id(tensor), set()).add(name)
    inside = {id(m) for _, entry in entries for m in entry.modules()}
    outside_ids = set()
    for sub in component.modules():
        if id(sub) in inside:
            continue
        for tensor in list(sub._parameters.values()) + list(sub._buffers.values()):
            if tensor is not None:
                outside_ids.add(id(tensor))
    shared = {key for key, names in owners.items() if len(names) > 1 or key in outside_ids}
    blocks: List[Block] = []
    seen: Dict[int, str] = {}
    for name, entry in entries:
        tensors = list(entry.parameters()) + list(entry.buffers())
        if not tensors or any(id(t) in shared for t in tensors):
            continue
        slots = _tensor_slots(entry, seen, name)
        blocks.append(Block(name, entry, tuple(slots.values()), _nbytes(slots.values())))
    rest = _tensor_slots(component, seen, REST)
    if rest:
        blocks.insert(0, Block(REST, component, tuple(rest.values()), _nbytes(rest.values())))
    return blocks


def block_sizes(component: torch.nn.Module) -> Dict[str, int]:
    """`{block name: bytes}` of `component`'s blocks, in order (works on `meta` modules)."""
    return {block.name: block.nbytes for block in find_blocks(component)}
