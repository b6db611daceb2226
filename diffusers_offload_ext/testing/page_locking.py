"""`fake_page_locking`: a stand-in driver that page-locks host memory for the simulated accelerator (`cpu:0`), so that
the page-locked store runs on machines without CUDA; it records what is registered, at which size."""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from ..transfer import pinned

#: The codes the fake answers, as CUDA's runtime would.
ALREADY_REGISTERED, NOT_REGISTERED, REFUSED = 712, 713, 2


class FakeLocker(pinned.Locker):
    """Keeps `registered` (`data_ptr -> bytes`); refuses every registration when `refuse` is set."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.registered: Dict[int, int] = {}
        self.calls: List[Tuple[str, int]] = []

    def register(self, pointer: int, nbytes: int) -> int:
        self.calls.append(("register", pointer))
        if self.refuse:
            return REFUSED
        if pointer in self.registered:
            return ALREADY_REGISTERED
        self.registered[pointer] = nbytes
        return 0

    def unregister(self, pointer: int) -> int:
        self.calls.append(("unregister", pointer))
        return 0 if self.registered.pop(pointer, None) is not None else NOT_REGISTERED


@contextlib.contextmanager
def fake_page_locking(
    budget: Optional[int] = None, refuse: bool = False
) -> Iterator[Tuple[FakeLocker, "pinned.PinnedStore"]]:
    """Within the block, host memory can be "page-locked" for devices of type `cpu` (the simulated accelerator):
    yields the fake driver and the store, whose `budget` is `budget` if given."""
    locker = FakeLocker(refuse)
    saved_lockers, saved_stores = dict(pinned.LOCKERS), dict(pinned._STORES)
    pinned.LOCKERS["cpu"] = lambda: locker
    pinned._STORES.pop("cpu", None)
    store = pinned.store_for(torch.device("cpu"))
    if budget is not None:
        store.budget = budget
    try:
        yield locker, store
    finally:
        pinned.LOCKERS.clear()
        pinned.LOCKERS.update(saved_lockers)
        pinned._STORES.clear()
        pinned._STORES.update(saved_stores)
