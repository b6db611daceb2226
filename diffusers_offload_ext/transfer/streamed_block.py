"""`StreamedBlock`: one block of a streaming component that passes through the ring: its parameter and buffer slots,
their host tensors (read again from the slots before each copy), its place in the ring, and the swaps that point its
tensors at a ring buffer and back (bitsandbytes' quantization state with them: `quant_state.py`), writing a change
made there into the host tensors (`streaming.py` runs them)."""

from __future__ import annotations

from typing import List, Optional

import torch

from .base import HOST
from .host_copy import at_home
from .inference import version_of
from .quant_state import place_state, restore_state, state_of


class StreamedBlock:
    """One streamed block: where its tensors live, their host tensors, and its place in the ring."""

    def __init__(self, block) -> None:
        self.name, self.module, self.slots, self.nbytes = block.name, block.module, block.slots, block.nbytes
        tables = [(sub._parameters if is_param else sub._buffers, key) for sub, is_param, key in self.slots]
        self.tables = tables
        self.originals = [table[key] for table, key in tables]
        self.hosts = [_data(t) for t in self.originals]
        self.states = state_of(self.slots)
        self.views: List[torch.Tensor] = []
        self.marks: List[int] = []
        self.slot: Optional[int] = None
        self.running = False

    def refresh(self) -> int:
        """Read the block's slots again before it is copied: a `Parameter`, a buffer or a parameter's data replaced
        since it was last put back (`p.data = new`, a new `Parameter`, in a step callback) is what streams from now on
        and what is put back; a tensor found on the device is moved home first (its host tensor is the one copied).
        Returns the bytes moved home."""
        homed = 0
        for i, (table, key) in enumerate(self.tables):
            now, host = table.get(key), self.hosts[i]
            if now is None or (now is self.originals[i] and _layout(now) == _layout(host) and at_home(host)):
                continue
            data = _data(now)
            if not at_home(data):
                with torch.no_grad():
                    data = data.to(HOST)
                homed += data.numel() * data.element_size()
            if isinstance(now, torch.nn.Parameter):
                now.data = data
            else:
                table[key] = now = data
            self.originals[i], self.hosts[i] = now, data
            self.nbytes = sum(t.numel() * t.element_size() for t in {id(h): h for h in self.hosts}.values())
            self.states = state_of(self.slots)
        return homed

    def swap_in(self, device: torch.device) -> None:
        for (table, key), original, view in zip(self.tables, self.originals, self.views):
            if isinstance(original, torch.nn.Parameter):
                original.data = view
                table[key] = original
            else:
                table[key] = view
        place_state(self.states, device)
        self.marks = [version_of(table[key]) for table, key in self.tables]

    def changed(self) -> bool:
        for (table, key), original, view, mark in zip(self.tables, self.originals, self.views, self.marks):
            now = table.get(key)
            expected = original if isinstance(original, torch.nn.Parameter) else view
            if now is not expected or _layout(now) != _layout(view):
                return True
            if mark is None or version_of(now) != mark:  # no counter to read: taken as changed (written back)
                return True
        return False

    def swap_out(self, write_back: bool) -> None:
        with torch.no_grad():
            for i, (table, key) in enumerate(self.tables):
                now = table.get(key)
                if write_back and now is not None:
                    host = self.hosts[i]
                    if _layout(now)[1:] == _layout(host)[1:] and not host.is_inference():
                        self.hosts[i].copy_(now.data)
                    else:
                        # A new shape (it no longer fits the ring: refused at load) or an inference tensor: a fresh copy.
                        self.hosts[i] = now.data.to(HOST, copy=True)  # never a view of the ring
                original = self.originals[i]
                if isinstance(original, torch.nn.Parameter):
                    original.data = self.hosts[i]
                    table[key] = original
                else:
                    table[key] = self.originals[i] = self.hosts[i]
        restore_state(self.states)
        self.views, self.marks, self.running = [], [], False


def device_of(slots) -> Optional[torch.device]:
    """Where the first tensor in `slots` is (`None`: it is gone)."""
    sub, is_param, key = slots[0]
    tensor = (sub._parameters if is_param else sub._buffers).get(key)
    return None if tensor is None else tensor.device


def move_slots(slots, device: torch.device, non_blocking: bool = False) -> None:
    """Move the tensors in `slots` to `device` (a parameter keeps its object; a buffer is replaced)."""
    with torch.no_grad():
        for sub, is_param, key in slots:
            table = sub._parameters if is_param else sub._buffers
            if is_param:
                table[key].data = table[key].data.to(device, non_blocking=non_blocking)
            else:
                table[key] = table[key].to(device, non_blocking=non_blocking)


def _data(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter's data, or the buffer itself."""
    return tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor


def _layout(tensor: torch.Tensor) -> tuple:
    """What a streamed tensor must keep for its copy to stand for it: data pointer, shape, dtype and stride."""
    return tensor.data_ptr(), tuple(tensor.shape), tensor.dtype, tensor.stride()
