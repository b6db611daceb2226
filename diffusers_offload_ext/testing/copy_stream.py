"""`fake_copy_stream`: a stand-in for the CUDA copy stream on the simulated accelerator. A prefetched component's
device weights exist at once but hold NaN (zeros for integers) until `ready` is called, as a CUDA copy still in
flight would hold garbage: a component run before its prefetch was waited on gives a wrong image."""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Tuple

import torch

from ..transfer import COPY_STREAMS, Moved, SyncTransfer
from ..transfer.ring import Copier


class FakeCopyStreamTransfer(SyncTransfer):
    """A `SyncTransfer` whose prefetches complete only at `ready`; `log` lists `("prefetch" | "ready", module)`."""

    asynchronous = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._inflight: Dict[int, List[Tuple[torch.Tensor, torch.Tensor]]] = {}
        self.log: List[Tuple[str, torch.nn.Module]] = []

    def prefetch(self, module: torch.nn.Module, *, keep_host: bool, check: bool = True) -> Moved:
        moved = self.onload(module, keep_host=keep_host, check=check, non_blocking=True)
        held = []
        for tensor in list(module.parameters()) + list(module.buffers()):
            data = tensor.data  # a view without the parameter's version counter: the poison is not an "edit"
            held.append((data, data.clone()))
            data.fill_(float("nan") if data.is_floating_point() else 0)
        self._inflight[id(module)] = held
        self.log.append(("prefetch", module))
        return moved

    @property
    def pending(self) -> bool:
        return bool(self._inflight)

    def ready(self, module: torch.nn.Module) -> None:
        held = self._inflight.pop(id(module), None)
        if held is not None:
            for data, value in held:
                data.copy_(value)
            self.log.append(("ready", module))

    def copier(self) -> "FakeCopier":
        return FakeCopier(self.log)

    def flush(self) -> None:
        for key in list(self._inflight):
            for data, value in self._inflight.pop(key):
                data.copy_(value)


class FakeCopier(Copier):
    """A ring-buffer copier whose copies complete only at `wait`: until then the buffer holds NaN (zeros for
    integers), as a CUDA copy still in flight would hold garbage; `log` gets `("copy" | "wait", view count)`."""

    asynchronous = True

    def __init__(self, log: list) -> None:
        self.log = log
        self._inflight: Dict[int, list] = {}

    def copy(self, pairs, after=None):
        token = object()
        with torch.no_grad():
            for view, _ in pairs:
                view.fill_(float("nan") if view.is_floating_point() else 0)
        self._inflight[id(token)] = list(pairs)
        self.log.append(("copy", len(pairs)))
        return token

    def wait(self, token) -> None:
        pairs = self._inflight.pop(id(token), None) if token is not None else None
        if pairs is not None:
            with torch.no_grad():
                for view, host in pairs:
                    view.copy_(host)
            self.log.append(("wait", len(pairs)))

    def drain(self) -> None:
        self._inflight.clear()


@contextlib.contextmanager
def fake_copy_stream() -> Iterator[List[FakeCopyStreamTransfer]]:
    """Within the block, `prefetch=True` on a `cpu` device (the simulated accelerator) gets a `FakeCopyStreamTransfer`;
    yields the list of those made."""
    made: List[FakeCopyStreamTransfer] = []

    def factory(device: torch.device) -> FakeCopyStreamTransfer:
        made.append(FakeCopyStreamTransfer(device))
        return made[-1]

    saved = COPY_STREAMS.get("cpu")
    COPY_STREAMS["cpu"] = factory
    try:
        yield made
    finally:
        if saved is None:
            COPY_STREAMS.pop("cpu", None)
        else:
            COPY_STREAMS["cpu"] = saved
