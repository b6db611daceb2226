"""`HostCopy`: a component's host tensors kept while it is on the device, so that evicting it unchanged needs no copy,
and the checks that tell whether it is unchanged.

`module.to(device)` replaces each parameter's `.data` (the `Parameter` object stays) and each buffer (a new tensor);
the host tensors are freed unless someone still refers to them. `HostCopy` refers to them, so that evicting an
unchanged component only puts them back (`restore`). A change made while the component was on the device must never
be lost, so `unchanged` checks, in order of cost:

1. structure: the same sub-modules, parameter and buffer names (LoRA layers added or removed change it);
2. identity: the same `Parameter` objects and buffer tensors, with the same data pointers, shapes, dtypes and strides
   (a replaced tensor, for example `weight.data = fused`, changes it, and so does a reshape through `.data` that
   keeps the pointer: `p.data = p.data.view(4, 6)`), and no gradient;
3. version counters: any in-place operation on the parameter or buffer itself (`p.mul_(2)`, `copy_`,
   `load_state_dict`) bumps `t._version` (inference tensors, made under `torch.inference_mode()`, have none: for
   them only the content check below sees an edit);
4. content: edits through `.data` (`weight.data += delta`, as PEFT's `merge()` fuses a LoRA) bump no counter that
   can be seen from the parameter, so a fingerprint of every device tensor (`fingerprint.py`) is taken right after
   the onload and again before the eviction.

When any check fails, or a tensor cannot be fingerprinted (a tensor subclass, a quantized or sparse tensor), the
eviction copies the device tensors back, as stock does. So it does when some tensor was not on the host when the
copy was made (a part of the component the user had moved to the device): the copy holds host tensors only, read
from the tensors themselves, so that such a part goes home at the eviction, as stock's `.to("cpu")` sends it.
"""

from __future__ import annotations

import weakref
from typing import Iterator, List, Optional, Sequence, Tuple

import torch

from .inference import version_of
from .fingerprint import fingerprints, same

Slot = Tuple[torch.nn.Module, bool, str, torch.Tensor]


def slots(module: torch.nn.Module, only: Optional[Sequence[tuple]] = None) -> Iterator[Slot]:
    """Every parameter and buffer slot: `(sub-module, is_parameter, name, tensor)`, in a fixed order; with `only`
    (`(sub-module, is_parameter, name)` triples, a block's), those slots that still hold a tensor."""
    if only is not None:
        for sub, is_param, key in only:
            tensor = (sub._parameters if is_param else sub._buffers).get(key)
            if tensor is not None:
                yield sub, is_param, key, tensor
        return
    for sub in module.modules():
        for key, param in sub._parameters.items():
            if param is not None:
                yield sub, True, key, param
        for key, buffer in sub._buffers.items():
            if buffer is not None:
                yield sub, False, key, buffer


class HostCopy:
    """The host tensors of one component while it is on the execution device.

    Create it just before the onload, call `seal(module)` just after; at eviction `unchanged(module)` tells whether
    `restore(module)` may replace the copy back. With `only` (a block's slots, see `blocks.py`) it covers those
    tensors of `module` alone.
    """

    def __init__(self, module: torch.nn.Module, check: bool = True, only: Optional[Sequence[tuple]] = None) -> None:
        self.only = None if only is None else tuple(only)
        # `param.data` is a second reference to the host storage: it outlives the onload, which either sets the
        # parameter's `.data` or puts a new `Parameter` in its place; the original object is kept too, so that it can
        # come back. Sub-modules are held weakly: the copy never keeps a component alive.
        self.host: List[tuple] = [
            (weakref.ref(sub), is_param, key, t, t.data if is_param else t)
            for sub, is_param, key, t in slots(module, self.only)
        ]
        #: Every tensor was on the host (or `meta`): else only a copy sends the rest home, and nothing is dropped.
        self.complete = all(at_home(host) for _, _, _, _, host in self.host)
        self.signature: Optional[list] = None
        self.content: Optional[list] = None
        self.check = check  # False: every eviction writes back (`zero_copy_eviction=False` with page-locked copies)

    def seal(self, module: torch.nn.Module) -> None:
        """Record what the component looks like on the device, right after the onload."""
        if not self.check or not self.complete:
            return
        found = list(slots(module, self.only))
        self.content = self._content(found)
        if self.content is None:
            return  # something it cannot read: the eviction will copy
        self.signature = [
            (weakref.ref(sub), is_param, key, weakref.ref(t)) + _layout(t) for sub, is_param, key, t in found
        ]

    @staticmethod
    def _content(found: List[Slot]) -> Optional[list]:
        """Fingerprints of the tensors, a vector per device (`meta` tensors hold no data that could change), in a
        fixed order; `None` when some tensor cannot be read."""
        groups: dict = {}
        for _, _, _, t in found:
            if t.device.type != "meta":
                groups.setdefault(t.device, []).append(t)
        content = [(device, fingerprints(tensors)) for device, tensors in groups.items()]
        return None if any(vector is None for _, vector in content) else content

    def unchanged(self, module: torch.nn.Module) -> bool:
        """Whether the device tensors are still exactly the ones `seal` saw, unmodified."""
        if self.signature is None or self.content is None:
            return False
        found = list(slots(module, self.only))
        if len(found) != len(self.signature):
            return False
        for (sub, is_param, key, t), (sub0, is_param0, key0, ref0, *layout0) in zip(found, self.signature):
            if sub is not sub0() or is_param != is_param0 or key != key0:
                return False
            if t is not ref0() or _layout(t) != tuple(layout0):
                return False
            if is_param and t.grad is not None:
                return False
        content = self._content(found)
        if content is None or [d for d, _ in content] != [d for d, _ in self.content]:
            return False
        return all(bool(same(now, sealed)) for (_, now), (_, sealed) in zip(content, self.content))  # read once

    def write_back(self, module: torch.nn.Module) -> bool:
        """Copy the device tensors into the host tensors, in place, and put those back (an eviction that copies but
        keeps the host memory, page-locked as it is). False, with nothing changed, where the structure, a shape or a
        dtype changed on the device, a host tensor is an inference tensor, or some tensor was not on the host when
        the copy was made: then a fresh host copy holds them."""
        found = list(slots(module, self.only))
        if len(found) != len(self.host) or not self.complete:
            return False
        pairs = []
        for (sub, is_param, key, t), (sub_ref, is_param0, key0, _, host) in zip(found, self.host):
            if sub is not sub_ref() or is_param != is_param0 or key != key0:
                return False
            if t.shape != host.shape or t.dtype != host.dtype or t.layout != host.layout or host.is_inference():
                return False  # an inference tensor cannot be written in place outside inference mode
            pairs.append((t, host))
        with torch.no_grad():
            for t, host in pairs:
                if t.data_ptr() != host.data_ptr():
                    host.copy_(t)
        self.restore(module)
        return True

    def restore(self, module: torch.nn.Module) -> None:
        """Put the host tensors back in place of the device ones: the eviction without a copy."""
        for sub_ref, is_param, key, original, host in self.host:
            sub = sub_ref()
            if sub is None:
                continue
            if is_param:
                original.data = host
                sub._parameters[key] = original
            else:
                sub._buffers[key] = host
        self.host = []
        self.signature = None
        self.content = None

    @property
    def nbytes(self) -> int:
        """Bytes of host memory this copy holds."""
        seen = {}
        for _, _, _, _, host in self.host:
            seen[id(host)] = host.numel() * host.element_size()
        return sum(seen.values())


def at_home(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is host memory (or `meta`, which holds no data): where a host copy may hold it."""
    device = tensor.device
    return device.type == "meta" or (device.type == "cpu" and device.index is None)


def _layout(tensor: torch.Tensor) -> tuple:
    """What an eviction without a copy must find unchanged besides the tensor's identity: its data pointer, version
    counter, shape, dtype and stride."""
    return tensor.data_ptr(), version_of(tensor), tuple(tensor.shape), tensor.dtype, tensor.stride()
