"""`fake_copy_stream`: a stand-in for the CUDA copy stream on the simulated accelerator. A prefetched component's
device weights exist at once but hold NaN (zeros for integers) until `ready` is called, as a CUDA copy still in
flight would hold garbage: a component run before its prefetch was waited on gives a wrong image."""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Tuple

import torch

from ..transfer import STREAMED, Moved, SyncTransfer


class FakeStreamTransfer(SyncTransfer):
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

    def flush(self) -> None:
        for key in list(self._inflight):
            for data, value in self._inflight.pop(key):
                data.copy_(value)


@contextlib.contextmanager
def fake_copy_stream() -> Iterator[List[FakeStreamTransfer]]:
    """Within the block, `prefetch=True` on a `cpu` device (the simulated accelerator) gets a `FakeStreamTransfer`;
    yields the list of those made."""
    made: List[FakeStreamTransfer] = []

    def factory(device: torch.device) -> FakeStreamTransfer:
        made.append(FakeStreamTransfer(device))
        return made[-1]

    saved = STREAMED.get("cpu")
    STREAMED["cpu"] = factory
    try:
        yield made
    finally:
        if saved is None:
            STREAMED.pop("cpu", None)
        else:
            STREAMED["cpu"] = saved
