"""`SyncTransfer`: moves one component at a time on the caller's stream, as stock diffusers does, without a host
synchronisation per tensor where its host memory is page-locked.

A blocking `module.to(device)` synchronises the host once per tensor (tens of thousands of times per call for a large
pipeline). From page-locked host memory the copies are queued instead (`non_blocking=True`) on the compute stream,
which orders everything that follows after them, and one event recorded after them tells the page-locked store when
that host memory may be unregistered. From pageable memory a non-blocking copy would hold the host for the whole copy
anyway (measured on an H200), so those stay blocking, as stock's.
"""

from __future__ import annotations

import torch

from ..constants import COPY, DROP
from .base import HOST, Moved, Transfer
from .book import first_tensor, module_nbytes
from .host_copy import HostCopy
from .inference import has_inference_parameters, ordinary_tensors
from .copier import Copier

#: Device types whose copies run on streams through `torch.cuda`'s API. Tests add `cpu` with a fake of that API
#: (`diffusers_offload_ext/testing/copy_stream.py`).
STREAM_DEVICES = {"cuda"}


class SyncTransfer(Transfer):
    """One `module.to(device)` per onload, one `module.to("cpu")` (or a drop) per offload, on the caller's stream."""

    #: Whether the onload in progress is a prefetch ahead of use (a transfer with a copy stream sets it).
    _ahead = False

    def __init__(self, device: torch.device, *args, **kwargs) -> None:
        super().__init__(device, *args, **kwargs)
        self.streamed = device.type in STREAM_DEVICES

    def onload(self, module: torch.nn.Module, *, keep_host: bool, check: bool = True) -> Moved:
        with ordinary_tensors(has_inference_parameters(module)):
            entry = self.book.entry(module)
            if entry.dirty:
                self.book.refresh(module, entry)
            nbytes = self.bytes_off(module, self.device) if self.readable else module_nbytes(module)
            if entry.host_copy is not None and nbytes:
                entry.host_copy = None  # some weights were on the host after all: that copy is stale
            locked = False
            if self.pinning is not None:
                if keep_host and nbytes:
                    locked = self.pinning.prepare(module, type(module).__name__, self.device)
                elif not keep_host:
                    self.pinning.release(module)  # it stays on the device: its host memory goes
            shared = self.host is not None and self.host.in_place  # the device reads host memory: `HostCopy.shared`
            fresh = keep_host and entry.host_copy is None
            host_copy = HostCopy(module, check, shared=shared) if fresh else entry.host_copy
            sealed = host_copy if host_copy is not None and host_copy is not entry.host_copy else None
            try:
                if locked or self._ahead or self.host is not None:
                    self._copy_in(module, locked, sealed)
                else:  # from pageable memory: blocking, as stock's (what `_copy_in` does there too)
                    module.to(self.device)
                    if sealed is not None:
                        sealed.seal(module)
            except BaseException:
                self._back_home(module, entry, host_copy)  # out of device memory halfway: nothing stays half loaded
                raise
            entry.host_copy = host_copy if keep_host else None
            entry.resident = True
            self._resentinel(module, entry)
            return Moved(nbytes, COPY)

    def _copy_in(self, module: torch.nn.Module, locked: bool, sealed) -> None:
        """`module` to the device (queued from page-locked memory, else blocking; its file-backed weights, under a
        host budget, through the staging ring or where they lie: `host/staging.py`), then `sealed.seal(module)`."""
        if self.host is not None and self.host.onload(module, self.device):
            if self.streamed and self.pinning is not None:
                self.pinning.fence_module(module, self._event(), torch.cuda.current_stream(self.device))
        elif locked and self.streamed:
            module.to(self.device, non_blocking=True)
            self.pinning.fence_module(module, self._event(), torch.cuda.current_stream(self.device))
        else:
            module.to(self.device)
        if sealed is not None:
            sealed.seal(module)

    def _back_home(self, module: torch.nn.Module, entry, host_copy) -> None:
        """An onload failed partway (the device ran out of memory): the tensors it moved go back to the host (their
        kept host tensors put back where there are some, else copied), and the record says so."""
        self.flush()
        if host_copy is not None:
            host_copy.restore(module)
        if self.readable:
            module.to(HOST)
        entry.host_copy = None
        entry.resident = False
        self._resentinel(module, entry)

    def _event(self):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def offload(self, module: torch.nn.Module) -> Moved:
        with ordinary_tensors(has_inference_parameters(module)):
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
                if not host_copy.write_back(module, self.copier().copy_home):
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

    def copier(self) -> Copier:
        return Copier(self.device if self.streamed else None, self.pinning, self.host)

    @staticmethod
    def _resentinel(module: torch.nn.Module, entry) -> None:
        # Parameters keep their objects across `.to()`; buffers are replaced, so a buffer sentinel is read again.
        if not isinstance(entry.sentinel, torch.nn.Parameter):
            entry.sentinel = first_tensor(module)
