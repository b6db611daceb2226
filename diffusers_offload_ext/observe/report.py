"""Outputs of a `Trace`: a summary `dict`, a `rich` table and a matplotlib timeline (Agg canvas, no pyplot state)."""

from __future__ import annotations

import math
import textwrap
from typing import Dict, List, Optional, Sequence, Tuple

from ..constants import DROP, ONLOAD
from .ledger import count, new_counter

ONLOAD_COLOR = "#1f6fb4"
OFFLOAD_COLOR = "#c8372d"
DROP_COLOR = "#7f7f7f"
RESIDENT_COLOR = "#2ca02c"
USE_COLOR = "#444444"


def format_bytes(nbytes: float) -> str:
    """`1536` -> `"1.50 KiB"`: binary units, three significant digits."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{int(value)} B"
            return f"{value:.3g} {unit}" if abs(value) >= 100 else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def format_seconds(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def _counter() -> dict:
    return {**new_counter(), "seconds": 0.0, "timed_moves": 0}


def _add(counter: dict, record) -> None:
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
    total = _counter()
    per_component: Dict[str, dict] = {name: _counter() for name in trace.components}
    per_call: Dict[str, dict] = {}
    per_source: Dict[str, dict] = {}
    for call in trace.calls:
        per_call[call_key(call.index)] = {**_counter(), "steps": call.steps, "mode": call.mode, "replayed": False}
    for record in trace.records:
        _add(total, record)
        _add(per_component.setdefault(record.component, _counter()), record)
        key = call_key(record.call)
        if key not in per_call:
            per_call[key] = {**_counter(), "steps": 0, "mode": None, "replayed": False}
        _add(per_call[key], record)
        if record.source == "replayed":
            per_call[key]["replayed"] = True
        _add(per_source.setdefault(record.source, _counter()), record)
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


# ----------------------------------------------------------------------------------------------------------------
# rich table
# ----------------------------------------------------------------------------------------------------------------


def _caption(trace) -> str:
    parts = []
    if trace.replayed:
        parts.append("[bold red]REPLAYED, not measured:[/] moves marked 'replayed' come from stock's policy.")
    parts.extend(trace.notes)
    sources = ", ".join(trace.sources) or "none"
    parts.append(f"Sources of the moves: {sources}. Seconds: measured moves only.")
    return "\n".join(parts)


def summary_table(trace, *, by: str = "component"):
    """A `rich.table.Table`: moves, bytes and seconds per component (`by="component"`) or per call (`by="call"`)."""
    from rich.table import Table

    if by not in ("component", "call"):
        raise ValueError(f"`by` must be 'component' or 'call', got {by!r}.")
    summary = summarize(trace)
    title = f"{trace.pipeline or 'pipeline'} on {trace.device or 'unknown device'}: {len(trace.calls)} call(s)"
    table = Table(title=title, caption=_caption(trace), caption_justify="left")
    first = "component" if by == "component" else "call"
    table.add_column(first)
    if by == "component":
        table.add_column("size", justify="right")
    else:
        table.add_column("steps", justify="right")
        table.add_column("offload", justify="left")
    for column in ("onloads", "offloads", "onloaded", "offloaded", "dropped", "seconds"):
        table.add_column(column, justify="right")
    table.add_column("sources" if by == "component" else "replayed")

    def cells(counter: dict) -> List[str]:
        seconds = format_seconds(counter["seconds"]) if counter["timed_moves"] else "-"
        return [
            str(counter["onloads"]),
            str(counter["offloads"]),
            format_bytes(counter["onload_bytes"]),
            format_bytes(counter["offload_bytes"]),
            format_bytes(counter["dropped_bytes"]),
            seconds,
        ]

    if by == "component":
        for name, counter in summary["per_component"].items():
            sources = sorted({r.source for r in trace.records if r.component == name})
            size = format_bytes(trace.components[name]) if name in trace.components else "?"
            table.add_row(name, size, *cells(counter), ", ".join(sources) or "-")
        table.add_row("[bold]total[/]", format_bytes(sum(trace.components.values())), *cells(summary["total"]), "")
    else:
        for key, counter in summary["per_call"].items():
            table.add_row(
                key,
                str(counter["steps"]),
                str(counter["mode"] or "-"),
                *cells(counter),
                "[bold red]yes[/]" if counter["replayed"] else "no",
            )
        table.add_row("[bold]total[/]", "", "", *cells(summary["total"]), "yes" if trace.replayed else "no")
    return table


# ----------------------------------------------------------------------------------------------------------------
# timeline
# ----------------------------------------------------------------------------------------------------------------


def _step_layout(trace) -> Tuple[List[float], List[float], Dict[int, float], Dict[int, Tuple[float, float]], float]:
    """x positions (step axis) of every record and every component use, call spans, and the end of the axis.

    Each call gets a slot before its loop, one per step, one after it; moves outside calls get a slot before the
    call that follows them (or at the end). Several events in one slot are spread across it.
    """
    starts = [c.start for c in trace.calls]

    def slot_of(call, phase, step, t) -> Tuple:
        if call is None:
            following = next((i for i, s in enumerate(starts) if s >= t), len(starts))
            return (following, 0, 0)
        if phase == "before-loop":
            return (call, 1, 0)
        if phase == "denoising":
            return (call, 2, step or 0)
        return (call, 3, 0)

    record_slots = [slot_of(r.call, r.phase, r.step, r.t) for r in trace.records]
    use_slots = [(slot_of(c.index, u.phase, u.step, u.t), c.index) for c in trace.calls for u in c.uses]
    setup_before = {s[0] for s in record_slots if s[1] == 0}
    # Slot origins.
    origin: Dict[Tuple, float] = {}
    call_span: Dict[int, Tuple[float, float]] = {}
    x = 0.0
    for index, call in enumerate(trace.calls):
        if index in setup_before:
            origin[(index, 0, 0)] = x
            x += 1
        begin = x
        origin[(index, 1, 0)] = x
        x += 1
        steps = max(call.steps, 1 + max([s[2] for s in record_slots if s[0] == index and s[1] == 2] or [-1]))
        for step in range(steps):
            origin[(index, 2, step)] = x
            x += 1
        origin[(index, 3, 0)] = x
        x += 1
        call_span[index] = (begin, x)
        x += 0.6
    if len(trace.calls) in setup_before:
        origin[(len(trace.calls), 0, 0)] = x
        x += 1
    end = x
    counts: Dict[Tuple, int] = {}
    for slot in record_slots:
        counts[slot] = counts.get(slot, 0) + 1
    seen: Dict[Tuple, int] = {}
    record_x = []
    for slot in record_slots:
        seen[slot] = seen.get(slot, 0) + 1
        record_x.append(origin.get(slot, 0.0) + seen[slot] / (counts[slot] + 1))
    use_x = [origin.get(slot, 0.0) for slot, _ in use_slots]
    loop_start = {i: origin[(i, 2, 0)] for i in range(len(trace.calls)) if (i, 2, 0) in origin}
    return record_x, use_x, loop_start, call_span, end


def plot_traces(items: Sequence[Tuple[Optional[str], object]], path: Optional[str] = None, *, x: str = "step"):
    """Timelines of one or more traces, stacked (one panel each). Returns the `Figure`; saves a PNG to `path`.

    Args:
        items (`Sequence[Tuple[str or None, Trace]]`): `(panel title, trace)` pairs.
        path (`str`, *optional*): Where to write the PNG.
        x (`str`, defaults to `"step"`): `"step"` or `"time"` (seconds since the trace began).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    if x not in ("step", "time"):
        raise ValueError(f"`x` must be 'step' or 'time', got {x!r}.")
    layouts = []
    widest = 1.0
    for _, trace in items:
        layout = _step_layout(trace) if x == "step" else None
        layouts.append(layout)
        if layout is not None:
            widest = max(widest, layout[4])
    lanes = [max(1, len(trace.components)) for _, trace in items]
    width = min(20.0, max(10.0, 5.0 + widest * 0.03))
    heights = [1.2 + 0.62 * n for n in lanes]
    notes_count = len({n for _, trace in items for n in trace.notes})
    fig = Figure(figsize=(width, sum(heights) + 0.9 * len(items) + 1.2 + 0.35 * notes_count), dpi=110)
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(len(items), 1, height_ratios=heights, hspace=0.42)
    for row, ((title, trace), layout) in enumerate(zip(items, layouts)):
        ax = fig.add_subplot(grid[row, 0])
        _draw(ax, trace, layout, x, title)
    handles = [
        Line2D([0], [0], color=ONLOAD_COLOR, marker="^", lw=2, label="onload (up), height ~ bytes"),
        Line2D([0], [0], color=OFFLOAD_COLOR, marker="v", lw=2, label="offload (down), height ~ bytes"),
        Line2D([0], [0], color=DROP_COLOR, marker="x", lw=2, ls=":", label="dropped (device copy released)"),
        Patch(facecolor=RESIDENT_COLOR, alpha=0.3, label="resident on the execution device"),
        Patch(facecolor=USE_COLOR, label="component ran"),
    ]
    if any(trace.replayed for _, trace in items):
        handles.append(
            Line2D(
                [0],
                [0],
                color=OFFLOAD_COLOR,
                marker="v",
                lw=1.5,
                alpha=0.6,
                mfc="none",
                label="REPLAYED move (hollow)",
            )
        )
    notes = []
    for _, trace in items:
        notes += [n for n in trace.notes if n not in notes]
    text = "\n".join(textwrap.fill(n, int(width * 16)) for n in notes)
    fig.text(0.01, 0.45 / fig.get_figheight(), text, fontsize=7, color="#444444", va="bottom", ha="left")
    columns = len(handles) if width >= 16 else 3
    fig.legend(handles=handles, loc="lower center", ncol=columns, fontsize=8, frameon=False)
    legend_rows = -(-len(handles) // columns)
    fig.texts[-1].set_y((0.15 + 0.22 * legend_rows) / fig.get_figheight())
    bottom = (0.75 + 0.22 * legend_rows + 0.16 * len(text.splitlines())) / fig.get_figheight()
    fig.subplots_adjust(left=0.1, right=0.98, top=1 - 0.6 / fig.get_figheight(), bottom=bottom)
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


def _draw(ax, trace, layout, x_mode: str, title: Optional[str]) -> None:
    fb = format_bytes
    names = list(trace.components) or sorted({r.component for r in trace.records})
    for record in trace.records:
        if record.component not in names:
            names.append(record.component)
    lane = {name: len(names) - 1 - i for i, name in enumerate(names)}
    sizes = dict(trace.components)
    if x_mode == "step":
        record_x, use_x, loop_start, call_span, end = layout
    else:
        record_x = [r.t - (r.duration_s or 0.0) / 2 for r in trace.records]
        use_x = [u.t for c in trace.calls for u in c.uses]
        call_span = {c.index: (c.start, c.end if c.end is not None else c.start) for c in trace.calls}
        loop_start = {}
        end = max([c.end or c.start for c in trace.calls] + [r.t for r in trace.records] + [1e-6]) * 1.02
    start = 0.0 if x_mode == "step" else -0.01 * end

    # Calls: alternate background bands, labels on top.
    many = len(call_span) > 12
    for index, (begin, finish) in call_span.items():
        if index % 2 == 0:
            ax.axvspan(begin, finish, color="#f2f2f2", zorder=0)
        if not many or index % max(1, len(call_span) // 10) == 0:
            ax.text(
                (begin + finish) / 2,
                len(names) - 0.35,
                f"call {index}",
                ha="center",
                va="bottom",
                fontsize=7,
                color="#555555",
            )

    # Resident intervals.
    by_component: Dict[str, List[Tuple[float, int]]] = {}
    for record, xpos in zip(trace.records, record_x):
        by_component.setdefault(record.component, []).append((xpos, record.resident_bytes))
    for name in names:
        full = max(sizes.get(name, 0), 1)
        level = trace.initial_resident.get(name, 0)
        cursor = start
        spans: Dict[float, List[Tuple[float, float]]] = {}
        for xpos, resident in by_component.get(name, []) + [(end, None)]:
            if level > 0 and xpos > cursor:
                alpha = round(0.12 + 0.3 * min(1.0, level / full), 2)
                spans.setdefault(alpha, []).append((cursor, xpos - cursor))
            cursor = xpos
            if resident is not None:
                level = resident
        for alpha, bars in spans.items():
            ax.broken_barh(bars, (lane[name] - 0.38, 0.76), facecolors=RESIDENT_COLOR, alpha=alpha, zorder=1)

    # Component uses: in step mode a dark segment under the lane for each slot it ran in; in time mode a tick.
    uses = [(u.component, xpos) for (c, u), xpos in zip([(c, u) for c in trace.calls for u in c.uses], use_x)]
    if uses and x_mode == "step":
        for name in names:
            slots = sorted({xpos for component, xpos in uses if component == name})
            if slots:
                ax.broken_barh(
                    [(xpos + 0.08, 0.84) for xpos in slots],
                    (lane[name] - 0.45, 0.07),
                    facecolors=USE_COLOR,
                    zorder=2,
                )
    elif uses:
        ax.scatter(
            [xpos for _, xpos in uses],
            [lane.get(name, 0) - 0.41 for name, _ in uses],
            marker="|",
            s=30,
            color=USE_COLOR,
            linewidths=0.8,
            zorder=2,
        )

    # Moves: a vertical tick from the lane's centre, up for onloads and down for offloads, height ~ sqrt(bytes).
    biggest = max([r.nbytes for r in trace.records] + [1])
    span_points = ax.get_position().width * ax.figure.get_figwidth() * 72
    slot_points = span_points / max(end - start, 1e-9) * (1.0 if x_mode == "step" else 0.0)
    show_caps = x_mode == "time" or slot_points >= 5 or len(trace.records) < 400
    linewidth = 2.0 if slot_points >= 4 or x_mode == "time" else 1.2
    for record, xpos in zip(trace.records, record_x):
        height = 0.12 + 0.3 * math.sqrt(record.nbytes / biggest)
        y0 = lane.get(record.component, 0)
        up = record.direction == ONLOAD
        color = ONLOAD_COLOR if up else (DROP_COLOR if record.kind == DROP else OFFLOAD_COLOR)
        style = ":" if record.kind == DROP else "-"
        alpha = 0.6 if record.source == "replayed" else 1.0
        tip = y0 + height if up else y0 - height
        ax.plot(
            [xpos, xpos], [y0, tip], color=color, lw=linewidth, ls=style, alpha=alpha, zorder=3, solid_capstyle="butt"
        )
        if show_caps:
            marker = "^" if up else ("x" if record.kind == DROP else "v")
            face = "none" if record.source == "replayed" else color
            ax.plot(
                [xpos],
                [tip],
                marker=marker,
                markersize=3 + 5 * math.sqrt(record.nbytes / biggest),
                color=color,
                mfc=face,
                lw=0,
                zorder=4,
            )

    ax.set_ylim(-0.6, len(names) - 0.05)
    ax.set_xlim(start, end)
    ax.set_yticks([lane[n] for n in names])
    ax.set_yticklabels([f"{n}\n{fb(sizes[n])}" if n in sizes else n for n in names], fontsize=8)
    for name in names:
        ax.axhline(lane[name] - 0.5, color="#dddddd", lw=0.5, zorder=0)
    if x_mode == "step":
        steps = max([c.steps for c in trace.calls] + [0])
        stride = next(
            s
            for s in (1, 2, 5, 10, 20, 25, 50, 100, 250, 1000, 10**9)
            if steps / s <= 60 / max(len(loop_start), 1) or s == 10**9
        )
        ticks, labels = [], []
        for index, begin in sorted(loop_start.items()):
            count = trace.calls[index].steps
            for step in range(0, max(count, 1), stride):
                ticks.append(begin + step + 0.5)
                labels.append(str(step))
        ax.set_xticks(ticks)
        ax.set_xticklabels(labels, fontsize=6)
        ax.set_xlabel(
            f"denoising step within each call (up to {steps}); each call also has a slot before and one after its loop",
            fontsize=8,
        )
    else:
        ax.set_xlabel("seconds since the trace began", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    copied = sum(r.copied_bytes for r in trace.records)
    heading = title or f"{trace.pipeline or 'pipeline'} on {trace.device or '?'}"
    heading += f": {len(trace.calls)} call(s), {len(trace.records)} moves, {fb(copied)} copied"
    ax.set_title(heading, fontsize=10, loc="left")
    if trace.replayed:
        ax.text(
            1.0,
            1.02,
            "REPLAYED from stock's policy, not measured",
            transform=ax.transAxes,
            ha="right",
            va="bottom",
            fontsize=9,
            color=OFFLOAD_COLOR,
            fontweight="bold",
        )
    for spine in ("top", "right"):
        ax.spines[spine].set_visible(False)
