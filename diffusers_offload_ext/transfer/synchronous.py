"""`SyncTransfer`: moves with one blocking `module.to()` per component, as stock diffusers does."""

from __future__ import annotations

import torch

from ..constants import COPY, DROP
from .base import HOST, Moved, Transfer
from .book import first_tensor, module_nbytes
from .host_copy import HostCopy


class SyncTransfer(Transfer):
    """One `module.to(device)` per onload, one `module.to("cpu")` (or a drop) per offload, on the caller's stream."""

    def onload(self, module: torch.nn.Module, *, keep_host: bool) -> Moved:
        entry = self.book.entry(module)
        if entry.dirty:
            self.book.refresh(module, entry)
        nbytes = self.bytes_off(module, self.device) if self.readable else module_nbytes(module)
        if entry.host_copy is not None and nbytes:
            entry.host_copy = None  # some weights were on the host after all: that copy is stale
        host_copy = HostCopy(module) if keep_host and entry.host_copy is None else entry.host_copy
        module.to(self.device)
        if host_copy is not None and host_copy is not entry.host_copy:
            host_copy.seal(module)
        entry.host_copy = host_copy if keep_host else None
        entry.resident = True
        self._resentinel(module, entry)
        return Moved(nbytes, COPY)

    def offload(self, module: torch.nn.Module) -> Moved:
        entry = self.book.entry(module)
        if entry.dirty:
            self.book.refresh(module, entry)
        host_copy, entry.host_copy = entry.host_copy, None
        if host_copy is not None and host_copy.unchanged(module):
            nbytes = self.bytes_off(module, HOST) if self.readable else module_nbytes(module)
            host_copy.restore(module)
            kind = DROP
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
