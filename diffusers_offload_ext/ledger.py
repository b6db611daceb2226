"""The transfer ledger: one record per move the extension made of one pipeline's component weights, written by the
pipeline's session and read by `doe.transfer_ledger`, the trace and its reports."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Iterator, List, Optional, Tuple

from .constants import DROP, ONLOAD


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
            made room, a component restarted to stream in less room); `None` for a move the policy chose.
    """

    component: str
    direction: str
    nbytes: int
    call_index: Optional[int]
    kind: str = "copy"
    step: Optional[int] = None
    block: Optional[str] = None
    cause: Optional[str] = None


class TransferLedger:
    """The list of moves one pipeline's offloading made, in order.

    Example:

    ```py
    >>> ledger = doe.transfer_ledger(pipe)
    >>> pipe("a cat")
    >>> ledger.summary()["total_bytes"]
    ```
    """

    def __init__(self) -> None:
        self.records: List[TransferRecord] = []

    def append(self, record: TransferRecord) -> None:
        self.records.append(record)

    def clear(self) -> None:
        """Forget every record."""
        self.records.clear()

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[TransferRecord]:
        return iter(self.records)

    def __repr__(self) -> str:
        return f"TransferLedger({len(self.records)} records, {self.copied_bytes()} bytes copied)"

    def copied_bytes(self, direction: Optional[str] = None, call_index: Optional[int] = ...) -> int:
        """Bytes that crossed the bus, optionally only in one `direction` and/or one `call_index`."""
        return sum(
            r.copied_bytes
            for r in self.records
            if (direction is None or r.direction == direction) and (call_index is ... or r.call_index == call_index)
        )

    def summary(self) -> dict:
        """Counts and bytes, in total, per component and per call.

        Returns:
            `dict`: with keys `onloads`, `offloads`, `onload_bytes`, `offload_bytes` (bytes copied device-to-host),
            `dropped_bytes` (offloads that only released the device copy), `total_bytes` (bytes that crossed the
            bus), `per_component` and `per_call` (the same counters keyed by component name and by call index).
        """
        total = new_counter()
        per_component: dict = {}
        per_call: dict = {}
        for record in self.records:
            count(total, record)
            count(per_component.setdefault(record.component, new_counter()), record)
            count(per_call.setdefault(record.call_index, new_counter()), record)
        total["per_component"] = per_component
        total["per_call"] = per_call
        return total


class Recorder:
    """The one recorder of one pipeline's moves, of whole components and of blocks: the ledger, and the observers told
    of every move (`(component, direction, module) -> finish(record)`: told before the move, finished after).

    Args:
        calls (`CallTracker`): The pipeline's calls (each record's call index and step).
    """

    def __init__(self, calls) -> None:
        self.calls = calls
        self.ledger = TransferLedger()
        self.observers: List[Callable] = []
        self.cause: Optional[str] = None

    @contextlib.contextmanager
    def caused(self, cause: str):
        """Every move recorded inside is marked with `cause` (`TransferRecord.cause`)."""
        previous, self.cause = self.cause, cause
        try:
            yield
        finally:
            self.cause = previous

    def record(
        self, name: str, direction: str, module, move: Callable[[], Tuple[int, str]], block: Optional[str] = None
    ) -> TransferRecord:
        """Tell the observers, make the move (`move()` returns the bytes and the kind it moved), append its record
        and give it to the observers."""
        finishers = [observer(name, direction, module) for observer in self.observers]
        nbytes, kind = move()
        record = TransferRecord(name, direction, nbytes, self.calls.index, kind, self.calls.step, block, self.cause)
        self.ledger.append(record)
        for finish in finishers:
            finish(record)
        return record
