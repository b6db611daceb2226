"""`PageRanges`: the process's one record of the host memory it registered with a driver, page by page, so that no
page is ever registered twice and no range is unregistered while another storage or an unfinished copy needs it.

The driver page-locks whole pages: two storages that share a page (neighbouring tensors of one safetensors mapping,
small tensors from one allocator arena) cannot both be registered whole (the second registration would be refused as
"already mapped"). A storage is therefore covered by registrations of the pages no other registration holds, plus
the registrations that already hold its other pages. Each registration is page-rounded (its start and end on page
boundaries: the whole pages the driver locks anyway, all of them mapped since the storage lies in them), so what the
record holds is exactly what the driver locked, whichever way a driver rounds a range; each registration keeps the storages that depend on it and is
unregistered only when none is left and every copy recorded as reading it (`fence`) is done (`query()`), polled
at each later call (`reap`) or waited for (`settle`). Memory page-locked by someone else (`is_pinned()`, e.g.
`Tensor.pin_memory()`) is recorded as locked and never registered.
"""

from __future__ import annotations

import bisect
import os
from typing import Dict, List, Optional, Tuple

import torch
from diffusers.utils import logging

from .locking import Locker

logger = logging.get_logger(f"diffusers.{__name__}")

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class _Registration:
    """One range registered with the driver: its pages `[first, end)`, the storages using it, its pending copies, and
    the tensor whose storage it lies in (kept alive until it is unregistered: registered memory is never freed)."""

    __slots__ = ("pointer", "first", "end", "users", "fences", "owner")

    def __init__(self, pointer: int, first: int, end: int, owner: torch.Tensor) -> None:
        self.pointer, self.first, self.end, self.owner = pointer, first, end, owner
        self.users: set = set()
        self.fences: Dict[object, object] = {}  # lane (a stream) -> the last event recorded after copies reading it


class _Lock:
    """One page-locked storage: its tensor (kept alive while it is locked), bytes, registrations and holders."""

    __slots__ = ("tensor", "nbytes", "registrations", "holders")

    def __init__(self, tensor: torch.Tensor, nbytes: int, registrations: List[_Registration]) -> None:
        self.tensor, self.nbytes, self.registrations = tensor, nbytes, registrations
        self.holders: set = set()


class PageRanges:
    """Registered host ranges of one `locker`, page-granular.

    Args:
        locker (`Locker`): The driver calls.
    """

    def __init__(self, locker: Locker) -> None:
        self.locker = locker
        self._firsts: List[int] = []  # first page of each registration, sorted
        self._registrations: List[_Registration] = []
        self._locks: Dict[int, _Lock] = {}  # storage pointer -> lock
        self._retiring: List[_Registration] = []

    @property
    def locked_bytes(self) -> int:
        """Bytes of the storages this record page-locked itself (memory locked by others not counted)."""
        return sum(lock.nbytes for lock in self._locks.values() if lock.registrations)

    def holds(self, pointer: int) -> bool:
        """Whether the storage at `pointer` is page-locked (by this record, or found so)."""
        return pointer in self._locks

    def lock(self, tensor: torch.Tensor, pointer: int, nbytes: int, holder: object, device=None) -> int:
        """Make the storage at `pointer` (`nbytes`, holding `tensor`) page-locked for `holder`, registering in
        `device`'s context; returns the driver's code (0: it is page-locked, with nothing else changed otherwise)."""
        self.reap()
        lock = self._locks.get(pointer)
        if lock is None:
            first, end = pointer // PAGE, -(-(pointer + nbytes) // PAGE)
            ours = self._overlapping(first, end)
            start = tensor.data_ptr() // PAGE
            if tensor.is_pinned() and not self._overlapping(start, start + 1):  # not because of a neighbour of ours
                lock = _Lock(tensor, nbytes, [])  # page-locked by someone else: used as it is, never registered
            else:
                code, made = self._cover(tensor, first, end, ours, device)
                if code != 0:
                    return code
                lock = _Lock(tensor, nbytes, sorted(ours + made, key=lambda r: r.first))
                for registration in lock.registrations:
                    registration.users.add(pointer)
                    if registration in self._retiring:
                        self._retiring.remove(registration)
            self._locks[pointer] = lock
        lock.holders.add(holder)
        return 0

    def unlock(self, pointer: int, holder: object) -> None:
        """`holder` no longer needs the storage at `pointer`; its registrations go when nothing needs them."""
        lock = self._locks.get(pointer)
        if lock is None:
            return
        lock.holders.discard(holder)
        if lock.holders:
            return
        del self._locks[pointer]
        for registration in lock.registrations:
            registration.users.discard(pointer)
            if not registration.users:
                self._retiring.append(registration)
        self.reap()

    def fence(self, pointers, event, lane: object) -> None:
        """Copies reading the storages at `pointers` were queued on `lane`, and are done when `event` is."""
        for pointer in pointers:
            lock = self._locks.get(pointer)
            if lock is not None:
                for registration in lock.registrations:
                    registration.fences[lane] = event

    def reap(self) -> None:
        """Unregister every unused registration whose copies are done."""
        waiting = []
        for registration in self._retiring:
            if all(event.query() for event in registration.fences.values()):
                self._unregister(registration)
            else:
                waiting.append(registration)
        self._retiring = waiting

    def settle(self) -> None:
        """Wait for the copies of every unused registration, and unregister them all."""
        for registration in self._retiring:
            for event in registration.fences.values():
                event.synchronize()
            self._unregister(registration)
        self._retiring = []

    def _overlapping(self, first: int, end: int) -> List[_Registration]:
        found = []
        index = max(bisect.bisect_right(self._firsts, first) - 1, 0)
        while index < len(self._registrations) and self._registrations[index].first < end:
            registration = self._registrations[index]
            if registration.end > first:
                found.append(registration)
            index += 1
        return found

    def _cover(self, tensor, first, end, ours, device) -> Tuple[int, List[_Registration]]:
        """Register the pages `[first, end)` that `ours` do not hold, whole pages each; on a refusal, undo."""
        made: List[_Registration] = []
        for gap_first, gap_end in _gaps(first, end, ours):
            start = gap_first * PAGE
            code = self.locker.register(start, (gap_end - gap_first) * PAGE, device)
            if code != 0:
                for registration in made:
                    self._unregister(registration)
                return code, []
            registration = _Registration(start, gap_first, gap_end, tensor)
            index = bisect.bisect_left(self._firsts, gap_first)
            self._firsts.insert(index, gap_first)
            self._registrations.insert(index, registration)
            made.append(registration)
        return 0, made

    def _unregister(self, registration: _Registration) -> None:
        index = bisect.bisect_left(self._firsts, registration.first)
        while self._registrations[index] is not registration:
            index += 1
        del self._firsts[index], self._registrations[index]
        code = self.locker.unregister(registration.pointer)
        if code != 0:
            logger.warning(f"unregistering page-locked host memory at {registration.pointer:#x} failed (code {code})")


def _gaps(first: int, end: int, ours: List[_Registration]) -> List[Tuple[int, int]]:
    """The page intervals within `[first, end)` that no registration in `ours` (sorted, disjoint) holds."""
    gaps, page = [], first
    for registration in sorted(ours, key=lambda r: r.first):
        if registration.first > page:
            gaps.append((page, registration.first))
        page = max(page, registration.end)
    if page < end:
        gaps.append((page, end))
    return gaps


def pointer_of(tensor: torch.Tensor) -> Optional[int]:
    """The data pointer of `tensor`'s storage (what the record is keyed by), `None` if it has no storage."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
