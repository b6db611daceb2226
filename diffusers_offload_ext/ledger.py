"""The transfer ledger: one record per move the extension made of one pipeline's component weights, written by the
pipeline's session and read by `doe.transfer_ledger`, the trace and its reports."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Iterator, List, Optional

from .constants import DROP, OFFLOAD, ONLOAD


def new_counter() -> dict:
    """Zeroed counters of moves and bytes, as `TransferLedger.summary()` reports them."""
    return {"onloads": 0, "offloads": 0, "onload_bytes": 0, "offload_bytes": 0, "dropped_bytes": 0, "total_bytes": 0}


def count(counter: dict, record) -> None:
    """Add one record (anything with `direction`, `nbytes`, `kind` and `copied_bytes`) to `counter`."""
    if record.direction == ONLOAD:
        counter["onloads"] += 1
        counter["onload_bytes"] += record.nbytes
    else:
        counter["offloads"] += 1
        if record.kind == DROP:
            counter["dropped_bytes"] += record.nbytes
        else:
            counter["offload_bytes"] += record.nbytes
    counter["total_bytes"] += record.copied_bytes


class CopiedBytes:
    """What a record of a move (anything with `nbytes` and `kind`) says crossed the bus."""

    __slots__ = ()

    @property
    def copied_bytes(self) -> int:
        """Bytes that really crossed the bus (0 for a dropping eviction)."""
        return 0 if self.kind == DROP else self.nbytes


@dataclasses.dataclass(frozen=True)
class TransferRecord(CopiedBytes):
    """One move of one component.

    Args:
        component (`str`): The pipeline component that moved (for example `"transformer"`).
        direction (`str`): `"onload"` (host to execution device) or `"offload"` (back to the host).
        nbytes (`int`): Bytes of parameters and buffers that changed place (for a drop: that were released).
        call_index (`int` or `None`): Index of the pipeline call the move happened in (0 for the first call made
            after offload was enabled on this pipeline), `None` outside any call (for example at enable time).
        kind (`str`, defaults to `"copy"`): `"copy"` when the bytes crossed the bus, `"drop"` for an offload that only
            released the device copy.
        step (`int` or `None`): Denoising step the move happened in, `None` outside the denoising loop.
        block (`str` or `None`): For a component that streams (larger than the room the budget left it), the block
            that moved (`"transformer_blocks.3"`, `"<rest>"`); `None` for a move of the whole component.
        cause (`str` or `None`): `"out-of-memory"` for a move an out-of-memory recovery forced (the evictions that
            made room, a component restarted to stream in less room). Else, for an offload, why it was evicted:
            `"room for X"` (component `X` was about to run: stock's chain evicting its predecessor, or the budget
            making room), `"end of call"`, `"call start"`, `"budget"` (the residency manager armed, or armed again
            with another budget), `"arming"` (offload armed), `"release"` (`doe.release`), `"offload requested"`
            (the pipeline called the hook's `offload()`); `None` for onloads and other moves.
    """

    component: str
    direction: str
    nbytes: int
    call_index: Optional[int]
    kind: str = "copy"
    step: Optional[int] = None
    block: Optional[str] = None
    cause: Optional[str] = None


#: Calls whose records a ledger holds by default (`TransferLedger.keep_calls`); its summary covers every call.
KEEP_CALLS = 16


class TransferLedger:
    """The moves one pipeline's offloading made, in order: the records of the last `keep_calls` calls, and counters
    of every move ever made (until `clear()`), so that `summary()` and `copied_bytes()` stay exact over every call
    while the records held stay bounded. A record belongs to its call; a move made outside a call (`call_index=None`)
    belongs with the call before it (or before the first call).

    Args:
        keep_calls (`int` or `None`, defaults to `KEEP_CALLS` (16)): Calls whose records are held; `None` holds every
            record (memory then grows with every call). Settable later: `ledger.keep_calls = 100`.

    Example:

    ```py
    >>> ledger = doe.transfer_ledger(pipe)
    >>> pipe("a cat")
    >>> ledger.summary()["total_bytes"]
    ```
    """

    def __init__(self, keep_calls: Optional[int] = KEEP_CALLS) -> None:
        self.records: List[TransferRecord] = []
        self._calls: List[int] = []  # the call each held record belongs to (`-1`: before the first call)
        self._latest = -1  # the latest call a record was made in
        self.keep_calls = keep_calls
        self._reset_counters()

    @property
    def keep_calls(self) -> Optional[int]:
        """Calls whose records are held (`None`: all of them); setting it trims at once."""
        return self._keep_calls

    @keep_calls.setter
    def keep_calls(self, value: Optional[int]) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"`keep_calls` must be an int or None (every record), got {value!r}.")
        if value is not None and value < 0:
            raise ValueError(f"`keep_calls` must not be negative, got {value!r}. Pass 0 to hold summaries only.")
        self._keep_calls = value
        self._trim()

    def _reset_counters(self) -> None:
        self._total = new_counter()
        self._per_component: dict = {}
        self._per_call: dict = {}

    def append(self, record: TransferRecord) -> None:
        count(self._total, record)
        count(self._per_component.setdefault(record.component, new_counter()), record)
        count(self._per_call.setdefault(record.call_index, new_counter()), record)
        call = self._latest if record.call_index is None else record.call_index
        self.records.append(record)
        self._calls.append(call)
        if call > self._latest:
            self._latest = call
            self._trim()

    def _trim(self) -> None:
        """Let go of the records of calls before the last `keep_calls`."""
        if self._keep_calls is None:
            return
        first = self._latest - self._keep_calls + 1
        drop = next((i for i, call in enumerate(self._calls) if call >= first), len(self._calls))
        if drop:
            del self.records[:drop]
            del self._calls[:drop]

    def clear(self) -> None:
        """Forget every record and every count."""
        self.records.clear()
        self._calls.clear()
        self._reset_counters()

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[TransferRecord]:
        return iter(self.records)

    def __repr__(self) -> str:
        return f"TransferLedger({len(self.records)} records held, {self.copied_bytes()} bytes copied)"

    def copied_bytes(self, direction: Optional[str] = None, call_index: Optional[int] = ...) -> int:
        """Bytes that crossed the bus, optionally only in one `direction` and/or one `call_index`; exact over every
        call, including those whose records are no longer held."""
        counter = self._total if call_index is ... else self._per_call.get(call_index, new_counter())
        if direction is None:
            return counter["total_bytes"]
        key = {ONLOAD: "onload_bytes", OFFLOAD: "offload_bytes"}.get(direction)
        return counter[key] if key is not None else 0

    def summary(self) -> dict:
        """Counts and bytes, in total, per component and per call: exact over every move since the ledger was made
        or cleared, including the calls whose records are no longer held.

        Returns:
            `dict`: with keys `onloads`, `offloads`, `onload_bytes`, `offload_bytes` (bytes copied device-to-host),
            `dropped_bytes` (offloads that only released the device copy), `total_bytes` (bytes that crossed the
            bus), `per_component` and `per_call` (the same counters keyed by component name and by call index).
        """
        total = dict(self._total)
        total["per_component"] = {name: dict(counter) for name, counter in self._per_component.items()}
        total["per_call"] = {call: dict(counter) for call, counter in self._per_call.items()}
        return total


class Recorder:
    """The one recorder of one pipeline's moves, of whole components and of blocks: the ledger, and the observers told
    of every move (`(component, direction, module) -> finish(record)`: told before the move, finished after).

    A move is recorded in two steps around it, so that the move itself runs in its mover's frame: `began =
    recorder.begin(...)`, the move, then `recorder.finish(began, ...)`. A move that raises is not recorded.

    Args:
        calls (`CallTracker`): The pipeline's calls (each record's call index and step).
    """

    def __init__(self, calls) -> None:
        self.calls = calls
        self.ledger = TransferLedger()
        self.observers: List[Callable] = []
        self.cause: Optional[str] = None
        self.eviction: Optional[str] = None

    @contextlib.contextmanager
    def caused(self, cause: str):
        """Every move recorded inside is marked with `cause` (`TransferRecord.cause`)."""
        previous, self.cause = self.cause, cause
        try:
            yield
        finally:
            self.cause = previous

    @contextlib.contextmanager
    def evicting(self, cause: Optional[str]):
        """Every offload recorded inside (not the onloads) is marked with `cause`, why it was evicted, unless a
        `caused` cause is in force or an outer `evicting` gave one."""
        previous = self.eviction
        self.eviction = previous or cause
        try:
            yield
        finally:
            self.eviction = previous

    def begin(self, name: str, direction: str, module) -> list:
        """A move of component `name` begins: the observers are told; what they return goes to `finish`."""
        return [observer(name, direction, module) for observer in self.observers] if self.observers else []

    def finish(
        self, began: list, name: str, direction: str, nbytes: int, kind: str, block: Optional[str] = None
    ) -> TransferRecord:
        """The move `began` is made (`nbytes` of `kind`; of one `block` of a streaming component): its record is
        appended and given to the observers."""
        cause = self.cause or (self.eviction if direction == OFFLOAD else None)
        record = TransferRecord(name, direction, nbytes, self.calls.index, kind, self.calls.step, block, cause)
        self.ledger.append(record)
        for finish in began:
            finish(record)
        return record
