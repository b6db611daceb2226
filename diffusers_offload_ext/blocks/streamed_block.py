"""`StreamedBlock`: one streamed block's weights, read again from its slots before each copy, swapped between its host
tensors and its ring buffer, and the check at release of whether its forward changed them. Every plain tensor behind
the block passes through the ring (`parts.py`): plain weights, the storage of a `Parameter` subclass (bitsandbytes'
4-bit, GGUF), the inner tensors of a wrapper subclass (torchao, optimum-quanto; rebuilt around their ring views for
the forward) and the quantization state the block's weights carry (`quant_state`), so the ring's buffers hold all of
its bytes."""

from __future__ import annotations

from typing import Callable, List, Optional

import torch

from ..transfer.base import HOST
from ..transfer.host_copy import at_home, layout
from ..transfer.inference import version_of
from ..transfer.parts import as_parameter, flatten, leaves_of, move_tensor, unflatten
from .quant_state import state_of


def ring_hosts(slots) -> List[torch.Tensor]:
    """The host tensors of a block's `slots` as they lie in a ring buffer: the plain tensors behind each, then the
    quantization state they carry."""
    hosts = []
    for sub, is_param, key in slots:
        hosts += flatten((sub._parameters if is_param else sub._buffers)[key], detached=True)[1]
    return hosts + [host for _, _, host in state_of(slots)]


class StreamedBlock:
    """One streamed block: where its tensors live, their host tensors, and its place in the ring."""

    def __init__(self, block) -> None:
        self.name, self.module, self.slots, self.nbytes = block.name, block.module, block.slots, block.nbytes
        self.tables = [(sub._parameters if is_param else sub._buffers, key) for sub, is_param, key in self.slots]
        self.originals = [table[key] for table, key in self.tables]
        self.states = state_of(self.slots)
        self.specs, self.leaves = [], []
        for original in self.originals:
            spec, leaves = flatten(original, detached=True)
            self.specs.append(spec)
            self.leaves.append(leaves)
        self.views: List[torch.Tensor] = []
        self.installed: List[torch.Tensor] = []
        self.marks: List[Optional[int]] = []
        self.slot: Optional[int] = None
        self.running = False

    @property
    def hosts(self) -> List[torch.Tensor]:
        """The host tensors, in the order of the ring's views."""
        return [leaf for leaves in self.leaves for leaf in leaves] + [host for _, _, host in self.states]

    def _split(self, tensors: List[torch.Tensor]) -> List[List[torch.Tensor]]:
        """`tensors` (one per host tensor) cut per slot, then the quantization state's."""
        cut, start = [], 0
        for leaves in self.leaves:
            cut.append(tensors[start : start + len(leaves)])
            start += len(leaves)
        return cut + [tensors[start:]]

    def refresh(self) -> int:
        """Read the block's slots again before it is copied: a `Parameter`, a buffer, a parameter's data or its
        quantization state replaced since it was last put back (`p.data = new`, a new `Parameter`, in a step callback)
        is what streams from now on and what is put back; a tensor found on the device is moved home first (its host
        tensor is the one copied). Returns the bytes moved home."""
        homed, renewed = 0, False
        with torch.no_grad():
            for i, (table, key) in enumerate(self.tables):
                now = table.get(key)
                if now is None:
                    continue
                leaves = flatten(now, detached=True)[1]
                if now is self.originals[i] and _same(leaves, self.leaves[i]):
                    continue
                away = [x for x in leaves if not at_home(x)]
                if away:
                    homed += sum(x.numel() * x.element_size() for x in away)
                    move_tensor(table, key, isinstance(now, torch.nn.Parameter), HOST)
                    now = table[key]
                self.originals[i] = now
                self.specs[i], self.leaves[i] = flatten(now, detached=True)
                renewed = True
            # Quantization state is read again where the block carries some, or a weight was replaced: a plain
            # block's loads walk no attributes.
            states = state_of(self.slots) if renewed or self.states else []
            if renewed or [id(t) for _, _, t in states] != [id(t) for _, _, t in self.states]:
                for j, (owner, name, t) in enumerate(states):
                    if not at_home(t):
                        homed += t.numel() * t.element_size()
                        t = t.to(HOST)
                        setattr(owner, name, t)
                        states[j] = (owner, name, t)
                self.states = states
                self.nbytes = sum(t.numel() * t.element_size() for t in {id(h): h for h in self.hosts}.values())
        return homed

    def swap_in(self, device: torch.device) -> None:
        *mine, state = self._split(self.views)
        self.installed = []
        for (table, key), original, spec, views in zip(self.tables, self.originals, self.specs, mine):
            if spec is not None:
                value = unflatten(spec, views)[0]
                table[key] = as_parameter(value, original) if isinstance(original, torch.nn.Parameter) else value
            elif isinstance(original, torch.nn.Parameter):
                original.data = views[0]
                table[key] = original
            else:
                table[key] = views[0]
            self.installed.append(table[key])
        for (owner, name, _), view in zip(self.states, state):
            setattr(owner, name, view)
        self.marks = [version_of(x) for x in self._live()]

    def _live(self) -> List[torch.Tensor]:
        """The plain tensors in the block's place now (its quantization state's included)."""
        found = []
        for table, key in self.tables:
            found += leaves_of(table[key], ()) if table.get(key) is not None else []
        return found + [getattr(owner, name) for owner, name, _ in self.states]

    def changed(self) -> bool:
        """Whether the forward changed the block: a tensor replaced, reshaped or restrided, or edited in place (its
        version counter moved)."""
        if any(table.get(key) is not mine for (table, key), mine in zip(self.tables, self.installed)):
            return True
        live = self._live()
        if len(live) != len(self.views) or any(layout(x) != layout(v) for x, v in zip(live, self.views)):
            return True
        # No counter to read (an inference tensor): taken as changed (written back).
        return any(mark is None or version_of(x) != mark for x, mark in zip(live, self.marks))

    def swap_out(self, write_back: bool, copy_home: Optional[Callable] = None) -> None:
        """The host tensors back in place of the ring's views; with `write_back`, the device tensors copied into them
        first (through `copy_home(pairs)`, `Copier.copy_home`: one host wait for the block where it is page-locked)."""
        with torch.no_grad():
            pairs = []
            if write_back:
                for i, (table, key) in enumerate(self.tables):
                    now = table.get(key)
                    if now is not None:
                        pairs += self._write_back(i, now)
                for j, (owner, name, host) in enumerate(self.states):
                    now = getattr(owner, name)
                    if now is host:
                        continue
                    if now.shape == host.shape and now.dtype == host.dtype and not host.is_inference():
                        pairs.append((host, now))
                    else:
                        self.states[j] = (owner, name, now.to(HOST, copy=True))
            if copy_home is not None:
                copy_home(pairs)
            else:
                for host, tensor in pairs:
                    host.copy_(tensor)
            for i, (table, key) in enumerate(self.tables):
                original = self.originals[i]
                if isinstance(original, torch.nn.Parameter) and self.specs[i] is None:
                    original.data = self.leaves[i][0]
                table[key] = original
            for owner, name, host in self.states:
                setattr(owner, name, host)
        self.views, self.installed, self.marks, self.running = [], [], [], False

    def _write_back(self, i: int, now: torch.Tensor) -> list:
        """The `(host, device)` pairs that copy slot `i`'s device tensors into its host tensors; none, and a fresh host
        copy made now, where they no longer match (a new shape or dtype: it no longer fits the ring, which refuses it
        at the next load; an inference tensor)."""
        found, hosts = leaves_of(now, ()), self.leaves[i]
        fits = len(found) == len(hosts) and all(
            d.shape == h.shape and d.dtype == h.dtype and not h.is_inference() for d, h in zip(found, hosts)
        )
        if fits:
            return list(zip(hosts, found))
        original, wrapped = self.originals[i], self.specs[i] is not None
        # Never a view of the ring; a parameter's `.data` (a 4-bit parameter's own `.to()` would move its state).
        fresh = (now if wrapped or not isinstance(now, torch.nn.Parameter) else now.data).to(HOST, copy=True)
        if wrapped and isinstance(original, torch.nn.Parameter):
            self.originals[i] = original = as_parameter(fresh, original)
        elif not isinstance(original, torch.nn.Parameter):
            self.originals[i] = original = fresh
        self.specs[i], self.leaves[i] = flatten(original if wrapped else fresh, detached=True)
        return []


def device_of(slots) -> Optional[torch.device]:
    """Where the first tensor in `slots` is (`None`: it is gone)."""
    sub, is_param, key = slots[0]
    tensor = (sub._parameters if is_param else sub._buffers).get(key)
    return None if tensor is None else tensor.device


def move_slots(slots, device: torch.device, non_blocking: bool = False) -> None:
    """Move the tensors in `slots` to `device` (a parameter keeps its object; a buffer is replaced)."""
    with torch.no_grad():
        for sub, is_param, key in slots:
            move_tensor(sub._parameters if is_param else sub._buffers, key, is_param, device, non_blocking)


def send_home(module: torch.nn.Module) -> None:
    """Every tensor of `module` (its sub-modules' too) that is not on the host moved there, as it is now."""
    for sub in module.modules():
        for is_param, table in ((True, sub._parameters), (False, sub._buffers)):
            for key in [k for k, t in table.items() if t is not None and not at_home(t)]:
                move_tensor(table, key, is_param, HOST)


def _same(leaves: List[torch.Tensor], held: List[torch.Tensor]) -> bool:
    """Whether `leaves` are still the host tensors `held`: same number, each at home with the same layout."""
    return len(leaves) == len(held) and all(at_home(x) and layout(x) == layout(h) for x, h in zip(leaves, held))
