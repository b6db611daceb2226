"""`KeptBlocks`: the blocks of a streaming component that stay on the device for as long as it streams: moved there
(with their quantization state) when streaming starts, evicted when it stops, without a copy when unchanged."""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional

import torch

from ..constants import COPY, DROP, OFFLOAD, ONLOAD
from .streamed_block import move_slots, send_home
from ..transfer.host_copy import HostCopy
from .quant_state import carry, home


class KeptBlocks:
    """The kept blocks of `component`.

    Args:
        component (`torch.nn.Module`): The streaming component.
        blocks (`List[Block]`): Its kept blocks.
        device (`torch.device`): The execution device.
        copier (`Copier`): How they are copied to the device (`Copier.onload_kept`).
        emit (`Callable`): Told of every block move, `(block, direction, nbytes, kind)`.
        check (`bool`): Fingerprint them, so that an unchanged block is dropped at eviction (False: always copied).
    """

    def __init__(self, component, blocks: List, device: torch.device, copier, emit: Callable, check: bool) -> None:
        self.component, self.blocks, self.device, self.copier, self.emit = component, blocks, device, copier, emit
        self.check = check
        self.copies: Dict[str, HostCopy] = {}
        self.states: Dict[str, list] = {}  # the kept blocks' quantization state (its host copy puts it back)

    def load(self, names: Optional[Iterable[str]] = None) -> None:
        """Every kept block (or those named) to the device, its host copy kept and sealed. A block that cannot be
        loaded whole (the device ran out of memory) goes back to the host before the error propagates; those loaded
        before it stay, for `evict`."""
        names = None if names is None else set(names)
        for block in self.blocks:
            if (names is not None and block.name not in names) or block.name in self.copies:
                continue
            copy = HostCopy(self.component, self.check, only=block.slots)
            try:
                self.copier.onload_kept(block.slots, self.device, move_slots)
                self.states[block.name] = carry(block.slots, self.device)
                copy.seal(self.component)
            except BaseException:
                self.copier.drain()
                self.states.pop(block.name, None)
                copy.restore(self.component)  # its quantization state's host tensors too
                raise
            self.copies[block.name] = copy
            self.emit(block.name, ONLOAD, block.nbytes, COPY)

    def evict(self, names: Optional[Iterable[str]] = None) -> None:
        """Every kept block (or those named) loaded back to the host: dropped when unchanged, else copied back."""
        names = None if names is None else set(names)
        for block in self.blocks:
            if block.name not in self.copies or (names is not None and block.name not in names):
                continue  # never loaded (its load failed, or one before it), or staying
            copy, states = self.copies.pop(block.name), self.states.pop(block.name, ())
            if copy.check and copy.unchanged(self.component):
                copy.restore(self.component)  # its quantization state's host tensors too
                self.emit(block.name, OFFLOAD, block.nbytes, DROP)
                continue
            if not copy.write_back(self.component, self.copier.copy_home):
                # A new shape, dtype or structure (a parametrization moved `weight` into `parametrizations`): only a
                # fresh host copy can hold it, of every tensor the block has now.
                send_home(block.module)
                home(states)
            self.emit(block.name, OFFLOAD, block.nbytes, COPY)

    def forget(self) -> None:
        """The weights were moved some other way: nothing is held for them any more."""
        self.copies, self.states = {}, {}
