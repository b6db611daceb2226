"""`SyncTransfer`: moves with one blocking `module.to()` per component, as stock diffusers does."""

from __future__ import annotations

import torch

from ..constants import COPY, DROP
from .base import HOST, Moved, Transfer
from .inference import moves_ordinary_tensors
from .book import first_tensor, module_nbytes
from .host_copy import HostCopy


class SyncTransfer(Transfer):
    """One `module.to(device)` per onload, one `module.to("cpu")` (or a drop) per offload, on the caller's stream."""

    @moves_ordinary_tensors
    def onload(
        self, module: torch.nn.Module, *, keep_host: bool, check: bool = True, non_blocking: bool = False
    ) -> Moved:
        entry = self.book.entry(module)
        if entry.dirty:
            self.book.refresh(module, entry)
        nbytes = self.bytes_off(module, self.device) if self.readable else module_nbytes(module)
        if entry.host_copy is not None and nbytes:
            entry.host_copy = None  # some weights were on the host after all: that copy is stale
        if self.pinning is not None:
            if keep_host and nbytes:
                self.pinning.prepare(module, type(module).__name__)
            elif not keep_host:
                self.pinning.release(module)  # it stays on the device: its host memory goes
        host_copy = HostCopy(module, check) if keep_host and entry.host_copy is None else entry.host_copy
        # Only asked for when needed: some components' own `.to()` takes no `non_blocking` (StableUnCLIP's normalizer).
        module.to(self.device, non_blocking=True) if non_blocking else module.to(self.device)
        if host_copy is not None and host_copy is not entry.host_copy:
            host_copy.seal(module)
        entry.host_copy = host_copy if keep_host else None
        entry.resident = True
        self._resentinel(module, entry)
        return Moved(nbytes, COPY)

    @moves_ordinary_tensors
    def offload(self, module: torch.nn.Module) -> Moved:
        self.ready(module)  # never evict what a pending copy is still writing
        entry = self.book.entry(module)
        if entry.dirty:
            self.book.refresh(module, entry)
        host_copy, entry.host_copy = entry.host_copy, None
        if host_copy is not None and host_copy.check and host_copy.unchanged(module):
            nbytes = self.bytes_off(module, HOST) if self.readable else module_nbytes(module)
            host_copy.restore(module)
            kind = DROP
        elif host_copy is not None and self.pinning is not None and self.pinning.bytes_of(module):
            # Changed (or not checked): copied into the page-locked host tensors, which stay; else a fresh copy.
            nbytes = self.bytes_off(module, HOST) if self.readable else module_nbytes(module)
            if not host_copy.write_back(module):
                del host_copy
                module.to(HOST)
                self.pinning.forget_stale(module)
            kind = COPY
        else:
            # Release the stale host tensors before copying: host memory never exceeds stock's peak.
            del host_copy
            nbytes = self.bytes_off(module, HOST) if self.readable else module_nbytes(module)
            module.to(HOST)
            kind = COPY
        entry.resident = False
        self._resentinel(module, entry)
        return Moved(nbytes, kind)

    @staticmethod
    def _resentinel(module: torch.nn.Module, entry) -> None:
        # Parameters keep their objects across `.to()`; buffers are replaced, so a buffer sentinel is read again.
        if not isinstance(entry.sentinel, torch.nn.Parameter):
            entry.sentinel = first_tensor(module)
