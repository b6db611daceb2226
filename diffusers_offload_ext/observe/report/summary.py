"""The summary of a trace: counts, bytes and measured seconds in total, per component, per call and per source."""

from __future__ import annotations

from typing import Dict, Optional

from ...ledger import count, new_counter
from ..trace.records import REPLAYED


def new_timed_counter() -> dict:
    """The ledger's counters, plus measured seconds and how many moves were timed."""
    return {**new_counter(), "seconds": 0.0, "timed_moves": 0}


def add(counter: dict, record) -> None:
    count(counter, record)
    if record.duration_s is not None:
        counter["seconds"] += record.duration_s
        counter["timed_moves"] += 1


def call_key(call: Optional[int]) -> str:
    return "setup" if call is None else str(call)


def summarize(trace) -> dict:
    """Counts, bytes (`total_bytes` = bytes that crossed the bus) and measured seconds.

    Returns:
        `dict`: `total`, `per_component` (every component, in the pipeline's order), `per_call` (keys `"0"`, `"1"`,
        ..., and `"setup"` for moves outside calls; each also has `steps`, `mode` and `replayed`), `per_source`,
        `replayed` and `notes`.
    """
    total = new_timed_counter()
    per_component: Dict[str, dict] = {name: new_timed_counter() for name in trace.components}
    per_call: Dict[str, dict] = {}
    per_source: Dict[str, dict] = {}
    for call in trace.calls:
        per_call[call_key(call.index)] = {**new_timed_counter(), "steps": call.steps, "mode": call.mode}
        per_call[call_key(call.index)]["replayed"] = False
    for record in trace.records:
        add(total, record)
        add(per_component.setdefault(record.component, new_timed_counter()), record)
        key = call_key(record.call)
        if key not in per_call:
            per_call[key] = {**new_timed_counter(), "steps": 0, "mode": None, "replayed": False}
        add(per_call[key], record)
        if record.source == REPLAYED:
            per_call[key]["replayed"] = True
        add(per_source.setdefault(record.source, new_timed_counter()), record)
    for call in trace.calls:
        if call.replayed:
            per_call[call_key(call.index)]["replayed"] = True
    return {
        "total": total,
        "per_component": per_component,
        "per_call": per_call,
        "per_source": per_source,
        "replayed": trace.replayed,
        "notes": list(trace.notes),
    }
