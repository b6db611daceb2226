"""Placement as the tensors tell it: where each parameter and buffer of the traced components was last seen, and the
moves a fresh look finds (only a changed `tensor.device` counts, never a hook's name or type)."""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

import torch

from ...constants import COPY, DROP, OFFLOAD, ONLOAD
from ...storages import storage_nbytes
from .devices import device_name

#: `(qualified name, owning module, local name, is parameter)` of one parameter or buffer.
Slot = Tuple[str, Any, str, bool]
#: `(component, module, prefix)`: a subtree to look at; `prefix` names `module` inside the component.
Scope = Tuple[str, torch.nn.Module, str]
#: `(component, from device, to device)` -> bytes that moved that way.
Changes = Dict[Tuple[str, str, str], int]


def tensor_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of the storages behind `tensor` (through tensor subclasses, quantization state included)."""
    return storage_nbytes((tensor,))


def slots(module: torch.nn.Module, prefix: str = "") -> List[Slot]:
    """Every parameter and buffer under `module`, each tensor once, named by where it sits, so that a look reads the
    current tensor even when a hook replaced it."""
    out = []
    seen: Set[int] = set()
    for name, sub in module.named_modules(prefix=prefix):
        for table, is_parameter in ((sub._parameters, True), (sub._buffers, False)):
            for local, tensor in table.items():
                if tensor is not None and id(tensor) not in seen:
                    seen.add(id(tensor))
                    out.append((f"{name}.{local}" if name else local, sub, local, is_parameter))
    return out


def classify(src: str, dst: str, execution_device: Optional[str]) -> Tuple[str, str]:
    """`(direction, kind)` of tensors seen going from `src` to `dst`: to `meta` is a drop; towards the execution
    device (any accelerator when it is unknown) an onload."""
    if dst == "meta":
        return OFFLOAD, DROP
    if execution_device is not None:
        return (ONLOAD if dst == execution_device else OFFLOAD), COPY
    return (ONLOAD if dst != "cpu" else OFFLOAD), COPY


class Placement:
    """The last seen device and bytes of every tensor slot, per component."""

    def __init__(self) -> None:
        self.where: Dict[Tuple[str, str], Tuple[str, int]] = {}
        self._slots: Dict[Tuple[int, str], List[Slot]] = {}

    def forget_structure(self) -> None:
        """Modules may have gained or lost tensors: list their slots again on the next look."""
        self._slots = {}

    def slots_of(self, module: torch.nn.Module, prefix: str) -> List[Slot]:
        key = (id(module), prefix)
        found = self._slots.get(key)
        if found is None:
            found = self._slots[key] = slots(module, prefix)
        return found

    def remember(self, component: str, module: torch.nn.Module, replace: bool = True) -> None:
        """Take the current placement of `module`'s tensors as seen (`replace=False`: only tensors not seen yet)."""
        for key, owner, local, is_parameter in self.slots_of(module, ""):
            tensor = (owner._parameters if is_parameter else owner._buffers).get(local)
            if tensor is None:
                continue
            if replace or (component, key) not in self.where:
                self.where[(component, key)] = (device_name(tensor.device), tensor_nbytes(tensor))

    def look(self, scopes: Iterable[Scope]) -> Changes:
        """Compare the tensors in `scopes` with what was seen last; remember them; return what moved."""
        moved: Changes = {}
        placement = self.where
        for component, module, prefix in scopes:
            for name, owner, local, is_parameter in self.slots_of(module, prefix):
                tensor = (owner._parameters if is_parameter else owner._buffers).get(local)
                if tensor is None:
                    continue
                key = (component, name)
                device = device_name(tensor.device)
                before = placement.get(key)
                if before is not None and before[0] == device:
                    continue
                nbytes = tensor_nbytes(tensor)
                placement[key] = (device, nbytes)
                if before is None:
                    continue
                moved_key = (component, before[0], device)
                moved[moved_key] = moved.get(moved_key, 0) + nbytes
        return moved

    def resident_bytes(self, component: str, execution_device: Optional[str]) -> int:
        """Bytes of `component` last seen on the execution device (on any accelerator when it is unknown)."""
        total = 0
        for (name, _), (device, nbytes) in self.where.items():
            if name != component:
                continue
            if execution_device is not None and device == execution_device:
                total += nbytes
            elif execution_device is None and device not in ("cpu", "meta"):
                total += nbytes
        return total
