"""The `rich` table of a trace: moves, bytes and seconds per component or per call, with a caption that says what
was replayed and where the moves come from."""

from __future__ import annotations

from typing import List, Optional

from ...units import format_size
from .summary import summarize

_COUNTS = ("onloads", "offloads", "onloaded", "offloaded", "dropped", "seconds")


def format_seconds(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def caption(trace) -> str:
    parts = []
    if trace.replayed:
        parts.append("[bold red]REPLAYED, not measured:[/] moves marked 'replayed' come from stock's policy.")
    parts.extend(trace.notes)
    parts.extend(streamed_notes(trace))
    sources = ", ".join(trace.sources) or "none"
    parts.append(f"Sources of the moves: {sources}. Seconds: measured moves only.")
    return "\n".join(parts)


def streamed_notes(trace) -> List[str]:
    """One line per component that streamed its blocks: how many, and the bytes streamed per call and per step."""
    lines = []
    for name in dict.fromkeys(r.component for r in trace.records if r.block is not None):
        onloads = [r for r in trace.records if r.component == name and r.block is not None and r.direction == "onload"]
        calls = {r.call for r in onloads}
        steps = {(r.call, r.step) for r in onloads if r.step is not None}
        total = sum(r.nbytes for r in onloads)
        lines.append(
            f"`{name}` streamed its blocks ({len({r.block for r in onloads})} moved): {format_size(total / max(len(calls), 1))}"
            f" per call, {format_size(total / max(len(steps), 1))} per denoising step; its lane's shade is its "
            "blocks on the device."
        )
    return lines


def cells(counter: dict) -> List[str]:
    """The count columns of one row."""
    seconds = format_seconds(counter["seconds"]) if counter["timed_moves"] else "-"
    return [
        str(counter["onloads"]),
        str(counter["offloads"]),
        format_size(counter["onload_bytes"]),
        format_size(counter["offload_bytes"]),
        format_size(counter["dropped_bytes"]),
        seconds,
    ]


def summary_table(trace, *, by: str = "component"):
    """A `rich.table.Table`: moves, bytes and seconds per component (`by="component"`) or per call (`by="call"`)."""
    from rich.table import Table

    if by not in ("component", "call"):
        raise ValueError(f"`by` must be 'component' or 'call', got {by!r}.")
    summary = summarize(trace)
    title = f"{trace.pipeline or 'pipeline'} on {trace.device or 'unknown device'}: {len(trace.calls)} call(s)"
    table = Table(title=title, caption=caption(trace), caption_justify="left")
    if by == "component":
        table.add_column("component")
        table.add_column("size", justify="right")
    else:
        table.add_column("call")
        table.add_column("steps", justify="right")
        table.add_column("offload", justify="left")
    for column in _COUNTS:
        table.add_column(column, justify="right")
    table.add_column("sources" if by == "component" else "replayed")
    (_component_rows if by == "component" else _call_rows)(table, trace, summary)
    return table


def _component_rows(table, trace, summary: dict) -> None:
    for name, counter in summary["per_component"].items():
        sources = sorted({r.source for r in trace.records if r.component == name})
        size = format_size(trace.components[name]) if name in trace.components else "?"
        table.add_row(name, size, *cells(counter), ", ".join(sources) or "-")
    table.add_row("[bold]total[/]", format_size(sum(trace.components.values())), *cells(summary["total"]), "")


def _call_rows(table, trace, summary: dict) -> None:
    for key, counter in summary["per_call"].items():
        replayed = "[bold red]yes[/]" if counter["replayed"] else "no"
        table.add_row(key, str(counter["steps"]), str(counter["mode"] or "-"), *cells(counter), replayed)
    table.add_row("[bold]total[/]", "", "", *cells(summary["total"]), "yes" if trace.replayed else "no")
