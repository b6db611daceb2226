"""One panel of a timeline: one lane per component, calls as bands, resident intervals shaded, component runs as
marks under the lane, and each move as a tick up (onload) or down (offload) whose height grows with its bytes."""

from __future__ import annotations

import math
from typing import Dict, List, NamedTuple, Optional, Tuple

from ...constants import DROP, ONLOAD, OUT_OF_MEMORY
from ...units import format_size
from ..trace.records import REPLAYED
from .slots import step_axis

ONLOAD_COLOR = "#1f6fb4"
OFFLOAD_COLOR = "#c8372d"
DROP_COLOR = "#7f7f7f"
RESIDENT_COLOR = "#2ca02c"
USE_COLOR = "#444444"
RECOVERY_COLOR = "#e377c2"
_STRIDES = (1, 2, 5, 10, 20, 25, 50, 100, 250, 1000, 10**9)


class Panel(NamedTuple):
    """Where everything of one trace goes: lanes (y) and positions (x)."""

    names: List[str]
    lane: Dict[str, int]
    record_x: List[float]
    use_x: List[float]
    loop_start: Dict[int, float]
    call_span: Dict[int, Tuple[float, float]]
    start: float
    end: float
    x_mode: str
    use_width: Tuple[float, ...] = ()


def place(trace, x_mode: str) -> Panel:
    """Lanes in the pipeline's order (components seen only in records after them); x in denoising-step slots
    (`"step"`) or seconds (`"time"`)."""
    names = list(trace.components) or sorted({r.component for r in trace.records})
    for record in trace.records:
        if record.component not in names:
            names.append(record.component)
    lane = {name: len(names) - 1 - i for i, name in enumerate(names)}
    if x_mode == "step":
        axis = step_axis(trace)
        return Panel(
            names,
            lane,
            axis.record_x,
            axis.use_x,
            axis.loop_start,
            axis.call_span,
            0.0,
            axis.end,
            x_mode,
            axis.use_width,
        )
    record_x = [r.t - (r.duration_s or 0.0) / 2 for r in trace.records]
    use_x = [u.t for c in trace.calls for u in c.uses]
    call_span = {c.index: (c.start, c.end if c.end is not None else c.start) for c in trace.calls}
    end = max([c.end or c.start for c in trace.calls] + [r.t for r in trace.records] + [1e-6]) * 1.02
    return Panel(names, lane, record_x, use_x, {}, call_span, -0.01 * end, end, x_mode)


def draw(ax, trace, panel: Panel, title: Optional[str]) -> None:
    """Draw `trace` on `ax` where `panel` places it."""
    draw_calls(ax, panel)
    draw_resident(ax, trace, panel)
    draw_uses(ax, trace, panel)
    draw_moves(ax, trace, panel)
    label_axes(ax, trace, panel)
    label_title(ax, trace, title)


def draw_calls(ax, panel: Panel) -> None:
    """Calls: alternate background bands, labels on top."""
    many = len(panel.call_span) > 12
    for index, (begin, finish) in panel.call_span.items():
        if index % 2 == 0:
            ax.axvspan(begin, finish, color="#f2f2f2", zorder=0)
        if not many or index % max(1, len(panel.call_span) // 10) == 0:
            y = len(panel.names) - 0.35
            ax.text((begin + finish) / 2, y, f"call {index}", ha="center", va="bottom", fontsize=7, color="#555555")


def draw_resident(ax, trace, panel: Panel) -> None:
    """Resident intervals: shaded, darker the larger the share of the component on the device."""
    by_component: Dict[str, List[Tuple[float, int]]] = {}
    for record, xpos in zip(trace.records, panel.record_x):
        by_component.setdefault(record.component, []).append((xpos, record.resident_bytes))
    for name in panel.names:
        full = max(trace.components.get(name, 0), 1)
        level = trace.initial_resident.get(name, 0)
        cursor = panel.start
        spans: Dict[float, List[Tuple[float, float]]] = {}
        for xpos, resident in by_component.get(name, []) + [(panel.end, None)]:
            if level > 0 and xpos > cursor:
                alpha = round(0.12 + 0.3 * min(1.0, level / full), 2)
                spans.setdefault(alpha, []).append((cursor, xpos - cursor))
            cursor = xpos
            if resident is not None:
                level = resident
        for alpha, bars in spans.items():
            lane = panel.lane[name]
            ax.broken_barh(bars, (lane - 0.38, 0.76), facecolors=RESIDENT_COLOR, alpha=alpha, zorder=1)


def draw_uses(ax, trace, panel: Panel) -> None:
    """Component runs: in step mode a dark segment under the lane in its part of the slot it ran in (moves and runs
    share a slot in the order they happened); in time mode a tick."""
    uses = [(u.component, xpos) for u, xpos in zip([u for c in trace.calls for u in c.uses], panel.use_x)]
    if uses and panel.x_mode == "step":
        for name in panel.names:
            parts = sorted({(x, w) for (component, x), w in zip(uses, panel.use_width) if component == name})
            if parts:
                bars = [(x - 0.42 * w, 0.84 * w) for x, w in parts]
                ax.broken_barh(bars, (panel.lane[name] - 0.45, 0.07), facecolors=USE_COLOR, zorder=2)
    elif uses:
        xs = [xpos for _, xpos in uses]
        ys = [panel.lane.get(name, 0) - 0.41 for name, _ in uses]
        ax.scatter(xs, ys, marker="|", s=30, color=USE_COLOR, linewidths=0.8, zorder=2)


def draw_moves(ax, trace, panel: Panel) -> None:
    """Moves: a vertical tick from the lane's centre, up for onloads and down for offloads, height ~ sqrt(bytes);
    caps are left out when ticks would be too dense to read."""
    biggest = max([r.nbytes for r in trace.records] + [1])
    span_points = ax.get_position().width * ax.figure.get_figwidth() * 72
    time_mode = panel.x_mode == "time"
    slot_points = span_points / max(panel.end - panel.start, 1e-9) * (0.0 if time_mode else 1.0)
    show_caps = time_mode or slot_points >= 5 or len(trace.records) < 400
    linewidth = 2.0 if slot_points >= 4 or time_mode else 1.2
    for record, xpos in zip(trace.records, panel.record_x):
        scale = math.sqrt(record.nbytes / biggest)
        y0 = panel.lane.get(record.component, 0)
        up = record.direction == ONLOAD
        color = ONLOAD_COLOR if up else (DROP_COLOR if record.kind == DROP else OFFLOAD_COLOR)
        style = ":" if record.kind == DROP else "-"
        alpha = 0.6 if record.source == REPLAYED else 1.0
        tip = y0 + (0.12 + 0.3 * scale) * (1 if up else -1)
        width = linewidth * (0.5 if record.block is not None else 1.0)  # a streamed block: a thin tick
        ax.plot([xpos, xpos], [y0, tip], color=color, lw=width, ls=style, alpha=alpha, zorder=3, solid_capstyle="butt")
        if show_caps:
            marker = "^" if up else ("x" if record.kind == DROP else "v")
            face = "none" if record.source == REPLAYED else color
            ax.plot([xpos], [tip], marker=marker, markersize=3 + 5 * scale, color=color, mfc=face, lw=0, zorder=4)
        if getattr(record, "cause", None) == OUT_OF_MEMORY:  # forced by an out-of-memory recovery: always starred
            ax.plot([xpos], [tip], marker="*", markersize=9, color=RECOVERY_COLOR, lw=0, zorder=5)


def label_axes(ax, trace, panel: Panel) -> None:
    """Lanes labelled with component and size; x ticks at denoising steps (step mode) or seconds."""
    names, lane, sizes = panel.names, panel.lane, trace.components
    ax.set_ylim(-0.6, len(names) - 0.05)
    ax.set_xlim(panel.start, panel.end)
    ax.set_yticks([lane[n] for n in names])
    ax.set_yticklabels([f"{n}\n{format_size(sizes[n])}" if n in sizes else n for n in names], fontsize=8)
    for name in names:
        ax.axhline(lane[name] - 0.5, color="#dddddd", lw=0.5, zorder=0)
    if panel.x_mode == "step":
        steps = max([c.steps for c in trace.calls] + [0])
        calls = max(len(panel.loop_start), 1)
        stride = next(s for s in _STRIDES if steps / s <= 60 / calls or s == 10**9)
        ticks, labels = [], []
        for index, begin in sorted(panel.loop_start.items()):
            for step in range(0, max(trace.calls[index].steps, 1), stride):
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


def label_title(ax, trace, title: Optional[str]) -> None:
    """The panel's title with its totals, and a red label when moves were replayed."""
    copied = sum(r.copied_bytes for r in trace.records)
    heading = title or f"{trace.pipeline or 'pipeline'} on {trace.device or '?'}"
    heading += f": {len(trace.calls)} call(s), {len(trace.records)} moves, {format_size(copied)} copied"
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
