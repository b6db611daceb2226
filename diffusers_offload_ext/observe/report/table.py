"""The `rich` table of a trace: moves, bytes and seconds per component or per call, with a caption that says what
was replayed and where the moves come from."""

from __future__ import annotations

from typing import List, Optional

from ...units import format_size
from .summary import summarize

#: The count columns: moves (onloads, offloads), their bytes and the dropped bytes, seconds (the caption says so).
_COUNTS = ("on", "off", "onloaded", "offloaded", "dropped", "seconds")


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
        parts.append(
            "[bold red]REPLAYED, not measured:[/] moves marked 'replayed' (calls marked *) come from stock's policy."
        )
    parts.extend(trace.notes)
    parts.extend(streamed_notes(trace))
    sources = ", ".join(trace.sources) or "none"
    parts.append(
        "on, off: onloads and offloads; onloaded, offloaded: their bytes; dropped: bytes released without a copy."
    )
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


def short_size(nbytes: float) -> str:
    """`format_size` with three significant digits at most (`"85.2 KiB"`), for narrow columns."""
    text = format_size(nbytes)
    number, _, unit = text.partition(" ")
    return text if unit == "B" else f"{float(number):.3g} {unit}"


def cells(counter: dict) -> List[str]:
    """The count columns of one row."""
    seconds = format_seconds(counter["seconds"]) if counter["timed_moves"] else "-"
    return [
        str(counter["onloads"]),
        str(counter["offloads"]),
        short_size(counter["onload_bytes"]),
        short_size(counter["offload_bytes"]),
        short_size(counter["dropped_bytes"]),
        seconds,
    ]


def summary_table(trace, *, by: str = "component"):
    """A `rich.table.Table`: moves, bytes and seconds per component (`by="component"`) or per call (`by="call"`).

    Readable at 80 columns: no vertical rules, short headers (the caption says what they count), the sources column
    only when the moves come from more than one source (the caption names them), replayed calls marked `*`.
    """
    from rich import box
    from rich.table import Table

    if by not in ("component", "call"):
        raise ValueError(f"`by` must be 'component' or 'call', got {by!r}.")
    summary = summarize(trace)
    title = f"{trace.pipeline or 'pipeline'} on {trace.device or 'unknown device'}: {len(trace.calls)} call(s)"
    table = Table(
        title=title,
        caption=caption(trace),
        caption_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )

    def column(header: str, justify: str = "right") -> None:
        table.add_column(header, justify=justify, no_wrap=True)

    if by == "component":
        column("component", "left")
        column("size")
    else:
        column("call", "left")
        column("steps")
        column("mode", "left")
    for name in _COUNTS:
        column(name)
    several = len(trace.sources) > 1 and by == "component"
    if several:
        column("sources", "left")
    (_component_rows if by == "component" else _call_rows)(table, trace, summary, several)
    return table


def _component_rows(table, trace, summary: dict, several: bool) -> None:
    for name, counter in summary["per_component"].items():
        sources = sorted({r.source for r in trace.records if r.component == name})
        size = short_size(trace.components[name]) if name in trace.components else "?"
        extra = [", ".join(sources) or "-"] if several else []
        table.add_row(name, size, *cells(counter), *extra)
    extra = [""] if several else []
    table.add_row("[bold]total[/]", short_size(sum(trace.components.values())), *cells(summary["total"]), *extra)


def _call_rows(table, trace, summary: dict, several: bool) -> None:
    for key, counter in summary["per_call"].items():
        call = f"{key} [bold red]*[/]" if counter["replayed"] else key  # the caption says what * means
        table.add_row(call, str(counter["steps"]), str(counter["mode"] or "-"), *cells(counter))
    table.add_row("[bold]total[/]", "", "", *cells(summary["total"]))
