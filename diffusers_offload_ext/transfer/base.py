"""The transfer interface: the only code that moves a component's bytes between the host and the execution device,
and the only code that reads where tensors are. Policies and hooks never touch a device; they call this."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..constants import COPY
from ..storages import storage_nbytes
from .book import BOOK, Book, Entry
from .copier import Copier

HOST = torch.device("cpu")

#: Where a module's tensors are, read from the tensors themselves (`Transfer.locate`).
ON_DEVICE = "device"
ON_HOST = "host"
MIXED = "mixed"
EMPTY = "empty"
ON_META = "meta"
ELSEWHERE = "elsewhere"


class Moved(NamedTuple):
    """What a move did: `nbytes` that changed place (or were released, for a drop) and its `kind` (copy or drop)."""

    nbytes: int
    kind: str = COPY


def tensors_report(device: torch.device) -> bool:
    """Whether tensors moved to `device` report it as their device. False where the execution device is the host's
    own memory (`cpu:0` on the plain CPU): there the extension's record is all there is."""
    try:
        return torch.empty(0).to(device).device == device
    except (RuntimeError, AssertionError):
        return device.type != "cpu"


class Transfer:
    """Moves components between the host and `device`, and tells where they are.

    Args:
        device (`torch.device`): The execution device (with an index, like stock's `cuda:0`).
        book (`Book`, *optional*): Where placements and host copies are kept (one per process by default, so that a
            module shared by several pipelines has one entry).

    Attributes:
        readable (`bool`): Whether the tensors say where they are (`tensors_report`). When they do, the tensors are
            the truth and the book follows them; when they do not, the book's record is the truth.
    """

    def __init__(self, device: torch.device, book: Book = BOOK) -> None:
        self.device = device
        self.book = book
        self.readable = tensors_report(device)
        self.pinning = None  # a `PinnedStore` when host copies are page-locked (`pin_memory`)
        self.host = None  # a `host.staging.Stager` under a host budget (file-backed weights, `host_memory_budget`)

    # -- where things are -------------------------------------------------------------------------------------------
    def entry(self, module: torch.nn.Module) -> Entry:
        return self.book.entry(module)

    def is_resident(self, entry: Entry) -> bool:
        """Constant-time: on the device as its first tensor says (or as recorded, where tensors cannot tell)."""
        if not self.readable:
            return entry.resident
        sentinel = entry.sentinel
        return sentinel is not None and sentinel.device == self.device

    def locate(self, module: torch.nn.Module) -> str:
        """Where all of `module`'s tensors are: `"device"`, `"host"`, `"mixed"`, `"empty"`, `"meta"` or `"elsewhere"`
        (another device). Where tensors cannot tell, the record answers `"device"` or `"host"`."""
        if not self.readable:
            return ON_DEVICE if self.book.entry(module).resident else ON_HOST
        found = set()
        for tensor in list(module.parameters()) + list(module.buffers()):
            device = tensor.device
            if device == self.device:
                found.add(ON_DEVICE)
            elif device.type == "meta":
                found.add(ON_META)
            else:
                found.add(ON_HOST if device == HOST else ELSEWHERE)
        if not found:
            return EMPTY
        return found.pop() if len(found) == 1 else MIXED

    def bytes_off(self, module: torch.nn.Module, target: torch.device) -> int:
        """Bytes of the storages behind `module`'s tensors that are not on `target` (each storage once, quantization
        state included: `storages.storage_nbytes`)."""
        return storage_nbytes(t for t in list(module.parameters()) + list(module.buffers()) if t.device != target)

    def record(self, module: torch.nn.Module, resident: bool) -> None:
        """Set the record where tensors cannot tell (after an explicit `pipe.to(...)` on the plain CPU)."""
        self.book.entry(module).resident = resident

    def forget_host_copy(self, module: torch.nn.Module) -> None:
        """Drop the host copy of `module` (its weights moved some other way, or it never leaves the device again)."""
        entry = self.book.get(module)
        if entry is not None:
            entry.host_copy = None

    # -- moves ------------------------------------------------------------------------------------------------------
    def onload(self, module: torch.nn.Module, *, keep_host: bool, check: bool = True) -> Moved:
        """Move `module` to the device; with `keep_host`, keep its host tensors (page-locked where `pinning` is set)
        for an eviction without a copy, or without new host memory when `check` is False or the weights changed."""
        raise NotImplementedError

    def offload(self, module: torch.nn.Module) -> Moved:
        """Move `module` to the host: drop the device copy when an unchanged host copy was kept, else copy."""
        raise NotImplementedError

    #: Whether copies to the device are queued on a CUDA stream (else they are made at once).
    streamed = False

    # -- moves ahead of use (a transfer with a copy stream overrides these) ----------------------------------------
    #: Whether `prefetch` overlaps the running component (else it is an ordinary onload, made at once).
    asynchronous = False

    def prefetch(self, module: torch.nn.Module, *, keep_host: bool, check: bool = True) -> Moved:
        """Start moving `module` to the device ahead of its use; `ready(module)` before it runs."""
        return self.onload(module, keep_host=keep_host, check=check)

    #: Whether some prefetch may not be complete yet (a plain attribute here: read on every forward).
    pending = False

    def ready(self, module: torch.nn.Module) -> None:
        """Make the work that follows on the caller's stream wait until `module`'s prefetch is complete."""

    def flush(self) -> None:
        """`ready` for every pending prefetch (before moves made outside the extension, and at a call's end)."""

    def copier(self) -> Copier:
        """How streamed blocks are copied into their ring buffers (`ring.py`): at once here; on a copy stream where
        the transfer has one."""
        return Copier()
