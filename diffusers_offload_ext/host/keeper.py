"""`HostKeeper`: one pipeline's host budget while offload is armed: the plan in force, its staging ring, the last
measurement of its host bytes by kind, the room it leaves for page-locking, and what was said (once) about weights
that stopped being file-backed or a host over its budget.

The page-locked store is one per device type and shared by every pipeline; with host budgets in force its cap is the
least room any of them leaves (`page_lock_room`): the budget less the pageable anonymous bytes it counts (page-locking
anonymous memory adds nothing to what stays in RAM; page-locking a file-backed page does) and the staging ring.
"""

from __future__ import annotations

import weakref
from typing import Callable, Dict, List, Mapping, Optional

import torch
from diffusers.utils import logging

from ..units import format_size
from .account import HostBytes, Measured, changed, measure, pageable_anonymous, total
from .budget import HostPlan
from .memory import SLOTS
from .regions import Regions
from .staging import Stager, StagingRing

logger = logging.get_logger(f"diffusers.{__name__}")

#: Every keeper with a host budget in force (their least room caps the page-locked store).
_KEEPERS: "weakref.WeakSet[HostKeeper]" = weakref.WeakSet()


class HostKeeper:
    """The host side of one pipeline's offload (`Session.host`)."""

    def __init__(self) -> None:
        self.plan: Optional[HostPlan] = None
        self.ring: Optional[StagingRing] = None
        self.stager: Optional[Stager] = None
        self.measured: Optional[Measured] = None
        self._holds: Callable[[int], bool] = lambda pointer: False
        self._said: set = set()

    @property
    def budget(self) -> Optional[int]:
        """The host budget in force in bytes, `None` when none is."""
        return self.plan.budget if self.plan is not None else None

    def adopt(self, plan: Optional[HostPlan], store, queued: bool, in_place: bool) -> Optional[Stager]:
        """Take `plan` (its re-mapping done) for a device whose page-locked store is `store` (`None`: none);
        returns the `Stager` the transfer onloads file-backed weights with (`None` without a plan)."""
        if plan is None:
            self.drop()
            return None
        if self.ring is None or self.ring.slot_bytes * SLOTS != plan.staging or self.ring.store is not store:
            if self.ring is not None:
                self.ring.release()
            self.ring = StagingRing(store if plan.staging else None, plan.staging, queued)
        self.ring.queued = queued
        self.plan = plan
        self._holds = store.ranges.holds if store is not None else (lambda pointer: False)
        self.stager = Stager(
            self.ring, Regions.read(), in_place, lambda t: self._holds(t.untyped_storage().data_ptr())
        )
        _KEEPERS.add(self)
        if store is not None:
            store.limit = page_lock_room
        return self.stager

    def drop(self) -> None:
        """No host budget any more (or offload is gone): the ring is released."""
        if self.ring is not None:
            self.ring.release()
        self.plan = self.ring = self.stager = None
        _KEEPERS.discard(self)

    def read(self, tensors: Mapping[str, List[torch.Tensor]]) -> Dict[str, HostBytes]:
        """Each component's host bytes by kind now (`tensors`: their host tensors); changes nothing."""
        return measure(tensors, self._holds).components

    @property
    def ring_bytes(self) -> int:
        """Bytes of the staging ring page-locked now."""
        return self.ring.nbytes if self.ring is not None else 0

    def measure(self, tensors: Mapping[str, List[torch.Tensor]]) -> Dict[str, HostBytes]:
        """`read`, kept (for the page-locking room and the trace); says once per component when file-backed bytes
        turned anonymous, and once when the budget is exceeded."""
        before = self.measured.components if self.measured is not None else {}
        self.measured = measure(tensors, self._holds)
        now = self.measured.components
        for name, nbytes in changed(before, now):
            if name not in self._said:
                self._said.add(name)
                logger.info(
                    f"`{name}`: {format_size(nbytes)} of its weights stopped being file-backed (changed: assigned, "
                    "fused or edited in place) and count as anonymous memory against `host_memory_budget` now."
                )
        counted = total(now).counted + self.ring_bytes
        if self.plan is not None and counted > self.plan.budget and "over" not in self._said:
            self._said.add("over")
            logger.warning(
                f"host memory counted against `host_memory_budget` ({format_size(self.plan.budget)}) is "
                f"{format_size(counted)} now: weights changed since offload was armed. Enable offload again to "
                "re-map unchanged weights onto their files, or raise the budget."
            )
        return now

    def snapshot(self) -> Optional[dict]:
        """The last measurement's totals and the budget, for the trace (`None` without a host budget)."""
        if self.plan is None or self.measured is None:
            return None
        now = total(self.measured.components)
        return {
            "budget": self.plan.budget,
            "page_locked": now.page_locked + self.ring_bytes,
            "anonymous": now.anonymous,
            "file_backed": now.file_backed,
        }

    def room(self) -> Optional[int]:
        """What this budget leaves for page-locking: the budget, less the pageable anonymous bytes it counts, less the
        staging ring until it is page-locked (it then counts among the page-locked bytes)."""
        if self.plan is None:
            return None
        anonymous = pageable_anonymous(self.measured, self._holds) if self.measured is not None else 0
        ring = self.plan.staging if self.ring is None or not self.ring.buffers else 0
        return max(0, self.plan.budget - anonymous - ring)


def page_lock_room() -> Optional[int]:
    """The page-locked store's cap while host budgets are in force: the least room any of them leaves (`None`: no
    host budget is in force, the store's own cap applies)."""
    rooms = [room for room in (keeper.room() for keeper in list(_KEEPERS)) if room is not None]
    return min(rooms) if rooms else None
