"""Zero-copy eviction: keep a component's host tensors while it is on the device, and tell whether they still hold.

`module.to(device)` replaces each parameter's `.data` (the `Parameter` object stays) and each buffer (a new tensor);
the host tensors are freed unless someone still refers to them. `HostCopy` refers to them, so that evicting an
unchanged component only puts them back (`restore`): no device-to-host copy. Peak host memory stays stock's (all
weights on the host, the state before any onload).

A change made while the component was on the device must not be lost, so `unchanged` checks, in order of cost:

1. structure: the same sub-modules, parameter and buffer names (LoRA layers added or removed change it);
2. identity: the same `Parameter` objects and buffer tensors, with the same data pointers (a replaced tensor, for
   example `weight.data = fused`, changes it);
3. version counters: any in-place operation on the parameter or buffer itself (`p.mul_(2)`, `load_state_dict`,
   `copy_`) bumps `t._version`;
4. content: in-place edits through `.data` (`weight.data += delta`, as PEFT's default `merge()` fuses a LoRA) bump no
   version counter that can be seen from the parameter, so a fingerprint of the device tensors (two 64-bit sums of
   their bits, one weighted by pseudo-random odd position weights) is taken after the onload and again before the
   eviction. It runs on the device at memory bandwidth, far faster than the transfer it saves; a single changed
   word always changes the weighted sum (odd weights), and any other change escapes it with a probability of
   about 2**-64.

When any check fails, or a tensor cannot be fingerprinted (an unusual dtype or tensor subclass), the eviction copies
the device tensors back, as stock does.
"""

from __future__ import annotations

import weakref
from typing import Dict, Iterator, List, Optional, Tuple

import torch

#: Elements fingerprinted per step (bounds the temporary memory: a few int64 buffers of this length).
CHUNK = 1 << 22
_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MASK = (1 << 64) - 1


def _signed(value: int) -> int:
    value &= _MASK
    return value - (1 << 64) if value >> 63 else value


_K1 = _signed(0x9E3779B97F4A7C15)
_K2 = _signed(0xBF58476D1CE4E5B9)
_weights: Dict[torch.device, torch.Tensor] = {}


def _position_weights(device: torch.device, n: int) -> torch.Tensor:
    weights = _weights.get(device)
    if weights is None or weights.numel() < n:
        size = min(max(n, 1 << 16), CHUNK)
        w = torch.arange(1, size + 1, dtype=torch.int64, device=device) * _K1
        w = (w ^ (w >> 31)) * _K2
        weights = _weights[device] = w | 1
    return weights[:n]


def fingerprint(tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """Two int64 sums of the bits of `tensor` (plain and position-weighted), on its device; `None` on `meta`.

    Raises:
        `TypeError` or `RuntimeError`: the tensor's bits cannot be viewed as integers.
    """
    if tensor.device.type == "meta":
        return None
    flat = tensor.detach().reshape(-1)
    sums = torch.zeros(2, dtype=torch.int64, device=flat.device)
    if flat.numel() == 0:
        return sums
    ints = flat.contiguous().view(_INTS[flat.element_size()])
    for index, start in enumerate(range(0, ints.numel(), CHUNK)):
        chunk = ints[start : start + CHUNK].to(torch.int64)
        sums[0] += chunk.sum()
        sums[1] += (chunk * _position_weights(chunk.device, chunk.numel())).sum() * (2 * index + 1)
    return sums


Slot = Tuple[torch.nn.Module, bool, str, torch.Tensor]
#: What `HostCopy` keeps per slot: `(sub-module, is_parameter, name, the host tensor object, its host data)`.
Kept = Tuple[torch.nn.Module, bool, str, torch.Tensor, torch.Tensor]


def _slots(module: torch.nn.Module) -> Iterator[Slot]:
    """Every parameter and buffer slot: `(sub-module, is_parameter, name, tensor)`, in a fixed order."""
    for sub in module.modules():
        for key, param in sub._parameters.items():
            if param is not None:
                yield sub, True, key, param
        for key, buffer in sub._buffers.items():
            if buffer is not None:
                yield sub, False, key, buffer


class HostCopy:
    """The host tensors of one component while it is on the execution device.

    Create it just before `module.to(device)`, call `seal(module)` just after; at eviction `unchanged(module)` tells
    whether `restore(module)` may replace the move back.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        # `param.data` is a second reference to the host storage: it outlives `module.to(device)`, which either sets
        # the parameter's `.data` or, where the device's tensor type differs (`meta`), puts a new `Parameter` in its
        # place; the original object is kept too, so that it can come back.
        self.host: List[Kept] = [
            (sub, is_param, key, t, t.data if is_param else t) for sub, is_param, key, t in _slots(module)
        ]
        self.signature: Optional[list] = None
        self.content: Optional[torch.Tensor] = None
        self.fingerprintable = True

    def seal(self, module: torch.nn.Module) -> None:
        """Record what the component looks like on the device, right after the onload."""
        slots = list(_slots(module))
        self.signature = [
            (sub, is_param, key, weakref.ref(t), t.data_ptr(), t._version) for sub, is_param, key, t in slots
        ]
        self.content = self._fingerprint(slots)

    def _fingerprint(self, slots: List[Slot]) -> Optional[torch.Tensor]:
        try:
            sums = [fingerprint(t) for _, _, _, t in slots]
        except (TypeError, RuntimeError, KeyError, NotImplementedError):
            self.fingerprintable = False
            return None
        sums = [s for s in sums if s is not None]
        if not sums:
            return None
        devices = {s.device for s in sums}
        if len(devices) > 1:
            sums = [s.cpu() for s in sums]
        return torch.stack(sums)

    def unchanged(self, module: torch.nn.Module) -> bool:
        """Whether the device tensors are still exactly the ones `seal` saw, unmodified."""
        if self.signature is None or not self.fingerprintable:
            return False
        slots = list(_slots(module))
        if len(slots) != len(self.signature):
            return False
        for (sub, is_param, key, t), (sub0, is_param0, key0, ref0, ptr0, version0) in zip(slots, self.signature):
            if sub is not sub0 or is_param != is_param0 or key != key0:
                return False
            if t is not ref0() or t.data_ptr() != ptr0 or t._version != version0:
                return False
            if is_param and t.grad is not None:
                return False
        content = self._fingerprint(slots)
        if content is None or self.content is None:
            return content is None and self.content is None and self.fingerprintable
        return content.shape == self.content.shape and bool(torch.equal(content, self.content))

    def restore(self, module: torch.nn.Module) -> None:
        """Put the host tensors back in place of the device ones: the eviction without a copy."""
        for sub, is_param, key, original, host in self.host:
            if is_param:
                original.data = host
                sub._parameters[key] = original
            else:
                sub._buffers[key] = host
        self.host = []
        self.signature = None
        self.content = None
