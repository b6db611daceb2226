"""Transfers: the only code that moves bytes between the host and the execution device, and the only code that knows
torch devices (besides timing). `make_transfer` picks the implementation for a device and options."""

from __future__ import annotations

from typing import Callable, Dict, List

import torch

from .base import ELSEWHERE, EMPTY, HOST, MIXED, ON_DEVICE, ON_HOST, ON_META, Moved, Transfer, tensors_report
from .book import BOOK, Book, Entry, first_tensor, module_nbytes
from .host_copy import HostCopy
from .recording import Call, RecordingTransfer
from .synchronous import SyncTransfer

#: Called with every transfer `make_transfer` builds (tests wrap them in a `RecordingTransfer`).
_wrappers: List[Callable[[Transfer], Transfer]] = []


#: Device type -> the transfer whose prefetches overlap compute on a copy stream (`prefetch=True`). Tests add a fake
#: for `cpu`.
COPY_STREAMS: Dict[str, Callable[[torch.device], Transfer]] = {}


def make_transfer(device: torch.device, prefetch: bool = False) -> Transfer:
    """The transfer for `device`: a `SyncTransfer` (blocking `.to()`), or with `prefetch` where the device has a copy
    stream a `CopyStreamTransfer`; wrapped by any registered wrapper."""
    factory = COPY_STREAMS.get(device.type) if prefetch else None
    transfer: Transfer = factory(device) if factory is not None else SyncTransfer(device)
    for wrap in _wrappers:
        transfer = wrap(transfer)
    return transfer


def _cuda_copy_stream(device: torch.device) -> Transfer:
    from ..pinning.copy_stream import CopyStreamTransfer

    return CopyStreamTransfer(device)


COPY_STREAMS["cuda"] = _cuda_copy_stream


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
    "COPY_STREAMS",
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
    "tensors_report",
]
