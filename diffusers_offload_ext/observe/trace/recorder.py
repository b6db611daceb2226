"""Making records: each move becomes a `TraceRecord` with its call, step and phase, its time, the component's bytes
on the execution device after it, and its duration (CUDA-timed ones are read when the trace stops)."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

from diffusers.utils import logging

from .records import REPLAYED, TraceRecord

logger = logging.get_logger(f"diffusers.{__name__}")


class Recorder:
    """Appends records to a trace.

    Args:
        records (`List[TraceRecord]`): The trace's records.
        calls (`TracedCalls`): Where the pipeline's call is.
        now (`Callable[[], float]`): Seconds since the trace began.

    Attributes:
        resident (`Dict[str, int]`): Bytes of each component on the execution device, as the moves left them.
    """

    def __init__(self, records: List[TraceRecord], calls, now: Callable[[], float]) -> None:
        self.records = records
        self.calls = calls
        self.now = now
        self.resident: Dict[str, int] = {}
        self.pending: List[Tuple[TraceRecord, Callable[[], float]]] = []

    def add(
        self,
        component,
        direction,
        nbytes,
        kind,
        source,
        src,
        dst,
        where,
        seconds=None,
        clock=None,
        block=None,
        cause=None,
    ) -> None:
        """Record one move (of one `block` of a streaming component, if given; forced by an out-of-memory recovery
        when `cause` says so). `seconds` (a function, see `Clock.stop`) gives its duration; `clock` timed it."""
        phase, step = self.calls.position()
        info = self.calls.info
        record = TraceRecord(
            index=len(self.records),
            call=info.index if info is not None else None,
            step=step,
            phase=phase,
            component=component,
            direction=direction,
            nbytes=int(nbytes),
            kind=kind,
            source=source,
            src=src,
            dst=dst,
            t=self.now(),
            timing=clock.timing if (seconds is not None and clock is not None) else None,
            where=where,
            resident_bytes=int(self.resident.get(component, 0)),
            block=block,
            cause=cause,
        )
        self.records.append(record)
        if seconds is not None:
            if clock is not None and clock.cuda:
                self.pending.append((record, seconds))
            else:
                record.duration_s = float(seconds())
        if info is not None and source == REPLAYED:
            info.replayed = True

    def settle(self) -> None:
        """Read the durations timed with CUDA events (this synchronises)."""
        for record, seconds in self.pending:
            try:
                record.duration_s = float(seconds())
            except Exception:  # a CUDA error must not lose the trace
                logger.warning(f"Could not read the duration of trace record {record.index}.")
        self.pending.clear()

    def start_over(self, resident: Optional[Dict[str, int]] = None) -> None:
        """Take `resident` as the bytes on the device now (tracing starts)."""
        self.resident.clear()
        self.resident.update(resident or {})
