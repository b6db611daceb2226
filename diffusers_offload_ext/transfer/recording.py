"""`RecordingTransfer`: a transfer that does what another does and records every call, for tests."""

from __future__ import annotations

from typing import List, NamedTuple

import torch

from .base import Moved, Transfer


class Call(NamedTuple):
    """One call a `RecordingTransfer` saw: `op` (`"onload"`, `"offload"` or `"prefetch"`), the module, and what it
    returned."""

    op: str
    module: torch.nn.Module
    moved: Moved


class RecordingTransfer(Transfer):
    """Delegates every move to `inner` and appends a `Call` to `calls`.

    Args:
        inner (`Transfer`): The transfer that really moves.
    """

    def __init__(self, inner: Transfer) -> None:
        self.inner = inner
        pinning, host = inner.pinning, inner.host
        super().__init__(inner.device, inner.book)
        self.pinning, self.host = pinning, host
        self.readable = inner.readable
        self.calls: List[Call] = []

    @property
    def pinning(self):
        return self.inner.pinning

    @pinning.setter
    def pinning(self, store) -> None:
        self.inner.pinning = store

    @property
    def host(self):
        return self.inner.host

    @host.setter
    def host(self, stager) -> None:
        self.inner.host = stager

    @property
    def streamed(self) -> bool:
        return self.inner.streamed

    def onload(self, module: torch.nn.Module, *, keep_host: bool, check: bool = True) -> Moved:
        moved = self.inner.onload(module, keep_host=keep_host, check=check)
        self.calls.append(Call("onload", module, moved))
        return moved

    def offload(self, module: torch.nn.Module) -> Moved:
        moved = self.inner.offload(module)
        self.calls.append(Call("offload", module, moved))
        return moved

    @property
    def asynchronous(self) -> bool:
        return self.inner.asynchronous

    def prefetch(self, module: torch.nn.Module, *, keep_host: bool, check: bool = True) -> Moved:
        moved = self.inner.prefetch(module, keep_host=keep_host, check=check)
        self.calls.append(Call("prefetch", module, moved))
        return moved

    @property
    def pending(self) -> bool:
        return self.inner.pending

    def ready(self, module: torch.nn.Module) -> None:
        self.inner.ready(module)

    def flush(self) -> None:
        self.inner.flush()
