"""`StreamedBlock`: one streamed block's weights, swapped between its host tensors and its ring buffer (its
quantization state with them), and the check at release of whether its forward changed them."""

from __future__ import annotations

from typing import List, Optional

import torch

from .base import HOST
from .inference import version_of
from .quant_state import place_state, restore_state, state_of


class StreamedBlock:
    """One streamed block: where its tensors live, their host tensors, and its place in the ring."""

    def __init__(self, block) -> None:
        self.name, self.module, self.slots, self.nbytes = block.name, block.module, block.slots, block.nbytes
        tables = [(sub._parameters if is_param else sub._buffers, key) for sub, is_param, key in self.slots]
        self.tables = tables
        self.originals = [table[key] for table, key in tables]
        self.hosts = [t.data if isinstance(t, torch.nn.Parameter) else t for t in self.originals]
        self.states = state_of(self.slots)
        self.views: List[torch.Tensor] = []
        self.marks: List[int] = []
        self.slot: Optional[int] = None
        self.running = False

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
            if now is not expected or now.data_ptr() != view.data_ptr():
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
                    if now.shape == host.shape and now.dtype == host.dtype and not host.is_inference():
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
