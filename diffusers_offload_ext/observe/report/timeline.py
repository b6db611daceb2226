"""The timeline figure: one panel per trace, stacked, with a legend and the traces' notes underneath; written as a
PNG when asked."""

from __future__ import annotations

import textwrap
from typing import List, Optional, Sequence, Tuple

from ...constants import OUT_OF_MEMORY
from ...units import format_size
from .panel import DROP_COLOR, OFFLOAD_COLOR, ONLOAD_COLOR, RECOVERY_COLOR, RESIDENT_COLOR, USE_COLOR, draw, place
from .table import streamed_notes


def plot_traces(items: Sequence[Tuple[Optional[str], object]], path: Optional[str] = None, *, x: str = "step"):
    """Timelines of one or more traces, stacked (one panel each). Returns the `Figure`; saves a PNG to `path`.

    Args:
        items (`Sequence[Tuple[str or None, Trace]]`): `(panel title, trace)` pairs.
        path (`str`, *optional*): Where to write the PNG.
        x (`str`, defaults to `"step"`): `"step"` or `"time"` (seconds since the trace began).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if x not in ("step", "time"):
        raise ValueError(f"`x` must be 'step' or 'time', got {x!r}.")
    panels = [place(trace, x) for _, trace in items]
    widest = max([1.0] + [panel.end for panel in panels if x == "step"])
    width = min(20.0, max(10.0, 5.0 + widest * 0.03))
    heights = [1.2 + 0.62 * max(1, len(trace.components)) for _, trace in items]
    notes = _notes(items)
    fig = Figure(figsize=(width, sum(heights) + 0.9 * len(items) + 1.2 + 0.35 * len(set(notes))), dpi=110)
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(len(items), 1, height_ratios=heights, hspace=0.42)
    for row, ((title, trace), panel) in enumerate(zip(items, panels)):
        draw(fig.add_subplot(grid[row, 0]), trace, panel, title)
    recovered = any(_recoveries(trace) for _, trace in items)
    _footer(fig, _legend(any(trace.replayed for _, trace in items), recovered), notes, width)
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


def _notes(items) -> List[str]:
    """Every trace's notes, each once, in order."""
    notes: List[str] = []
    for _, trace in items:
        notes += [n for n in trace.notes + streamed_notes(trace) + _recovery_notes(trace) if n not in notes]
    return notes


def _recoveries(trace) -> list:
    return [r for r in trace.records if getattr(r, "cause", None) == OUT_OF_MEMORY]


def _recovery_notes(trace) -> List[str]:
    """One note when out-of-memory recoveries forced moves: how many, of what."""
    forced = _recoveries(trace)
    if not forced:
        return []
    names = ", ".join(dict.fromkeys(r.component for r in forced))
    return [
        f"Starred: {len(forced)} moves ({format_size(sum(r.nbytes for r in forced))}) forced by out-of-memory "
        f"recoveries ({names}): evictions that made room, and components restarted to stream in less room."
    ]


def _legend(replayed: bool, recovered: bool = False) -> list:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [
        Line2D([0], [0], color=ONLOAD_COLOR, marker="^", lw=2, label="onload (up), height ~ bytes"),
        Line2D([0], [0], color=OFFLOAD_COLOR, marker="v", lw=2, label="offload (down), height ~ bytes"),
        Line2D([0], [0], color=DROP_COLOR, marker="x", lw=2, ls=":", label="dropped (device copy released)"),
        Patch(facecolor=RESIDENT_COLOR, alpha=0.3, label="resident on the execution device"),
        Patch(facecolor=USE_COLOR, label="component ran"),
    ]
    if recovered:
        handles.append(
            Line2D([0], [0], color=RECOVERY_COLOR, marker="*", lw=0, markersize=9, label="forced by out of memory")
        )
    if replayed:
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
    return handles


def _footer(fig, handles: list, notes: List[str], width: float) -> None:
    """The notes and the legend under the panels, and margins that leave room for both."""
    text = "\n".join(textwrap.fill(n, int(width * 16)) for n in notes)
    fig.text(0.01, 0.45 / fig.get_figheight(), text, fontsize=7, color="#444444", va="bottom", ha="left")
    columns = len(handles) if width >= 16 else 3
    fig.legend(handles=handles, loc="lower center", ncol=columns, fontsize=8, frameon=False)
    legend_rows = -(-len(handles) // columns)
    fig.texts[-1].set_y((0.15 + 0.22 * legend_rows) / fig.get_figheight())
    bottom = (0.75 + 0.22 * legend_rows + 0.16 * len(text.splitlines())) / fig.get_figheight()
    fig.subplots_adjust(left=0.1, right=0.98, top=1 - 0.6 / fig.get_figheight(), bottom=bottom)
