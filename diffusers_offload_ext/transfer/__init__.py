"""Transfers: the only code that moves bytes between the host and the execution device, and the only code that knows
torch devices (besides timing). `make_transfer` picks the implementation for a device and options."""

from __future__ import annotations

from typing import Callable, List

import torch

from . import pinned
from .base import ELSEWHERE, EMPTY, HOST, MIXED, ON_DEVICE, ON_HOST, ON_META, Moved, Transfer, tensors_report
from .book import BOOK, Book, Entry, first_tensor, module_nbytes
from .host_copy import HostCopy
from .recording import Call, RecordingTransfer
from .synchronous import SyncTransfer

#: Called with every transfer `make_transfer` builds (tests wrap them in a `RecordingTransfer`).
_wrappers: List[Callable[[Transfer], Transfer]] = []


def make_transfer(device: torch.device) -> Transfer:
    """The transfer for `device`: today a `SyncTransfer` (blocking `.to()`), wrapped by any registered wrapper."""
    transfer: Transfer = SyncTransfer(device)
    for wrap in _wrappers:
        transfer = wrap(transfer)
    return transfer


__all__ = [
    "BOOK",
    "ELSEWHERE",
    "EMPTY",
    "HOST",
    "MIXED",
    "ON_DEVICE",
    "ON_HOST",
    "ON_META",
    "Book",
    "Call",
    "Entry",
    "HostCopy",
    "Moved",
    "RecordingTransfer",
    "SyncTransfer",
    "Transfer",
    "first_tensor",
    "make_transfer",
    "module_nbytes",
    "pinned",
    "tensors_report",
]
