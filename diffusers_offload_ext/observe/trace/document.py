"""`Trace`, what `doe.trace(pipe)` returns: a context manager that records while it is active, and the recorded
moves and calls read back as a summary, a table, a timeline or a JSON document."""

from __future__ import annotations

import json
import time
from typing import Dict, List, Optional, Tuple

from .records import REPLAYED, SOURCES, CallInfo, TraceRecord, read_document, to_document


class Trace:
    """What `doe.trace(pipe)` recorded. Use it as a context manager, around one call or several.

    Attributes:
        records (`List[TraceRecord]`): Every move, in order.
        calls (`List[CallInfo]`): Every pipeline call, with its component-call trace.
        components (`Dict[str, int]`): Bytes of each module component, in the pipeline's order.
        initial_resident (`Dict[str, int]`): Bytes of each component on the execution device when tracing began.
        device (`str` or `None`): The execution device.
        pipeline (`str` or `None`): The pipeline's class name.
        notes (`List[str]`): What the reader must know, such as "moves REPLAYED, not measured".
    """

    def __init__(self, pipe=None) -> None:
        self.records: List[TraceRecord] = []
        self.calls: List[CallInfo] = []
        self.components: Dict[str, int] = {}
        self.initial_resident: Dict[str, int] = {}
        self.device: Optional[str] = None
        self.pipeline: Optional[str] = type(pipe).__name__ if pipe is not None else None
        self.notes: List[str] = []
        self._pipe = pipe
        self._tracer = None
        self._t0: Optional[float] = None

    # -- context manager ---------------------------------------------------------------------------------------
    def __enter__(self) -> "Trace":
        from .tracer import Tracer

        if self._pipe is None:
            raise RuntimeError("This trace was loaded from a file; it cannot record. Use `doe.trace(pipe)`.")
        if self._tracer is not None:
            raise RuntimeError("This trace is already recording.")
        if self._t0 is None:
            self._t0 = time.perf_counter()
        tracer = Tracer(self, self._pipe, self._t0)
        try:
            tracer.start()
        except BaseException:
            tracer.stop()
            raise
        self._tracer = tracer
        return self

    def __exit__(self, *exc_info) -> None:
        tracer, self._tracer = self._tracer, None
        if tracer is not None:
            tracer.stop()

    # -- reading -----------------------------------------------------------------------------------------------
    @property
    def replayed(self) -> bool:
        """Whether some moves were replayed from stock's policy instead of being measured."""
        return any(r.source == REPLAYED for r in self.records) or any(c.replayed for c in self.calls)

    @property
    def sources(self) -> List[str]:
        """The sources of the records, in `SOURCES` order."""
        present = {r.source for r in self.records}
        return [s for s in SOURCES if s in present]

    def add_note(self, note: str) -> None:
        if note not in self.notes:
            self.notes.append(note)

    def component_trace(self, call: int) -> Tuple[str, ...]:
        """Names of the components that ran in call `call`, in order (one entry per time one started running)."""
        return tuple(u.component for u in self.calls[call].uses)

    def summary(self) -> dict:
        """Counts, bytes and seconds in total, per component, per call and per source (see `report.summarize`)."""
        from ..report import summarize

        return summarize(self)

    def to_dict(self) -> dict:
        """A JSON-ready `dict` (`Trace.from_dict` reads it back)."""
        return to_document(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Trace":
        """Read what `to_dict` wrote.

        Raises:
            `ValueError`: `data` is not a trace of a format version this package reads.
        """
        trace = cls()
        read_document(data, trace)
        return trace

    def to_json(self, path: Optional[str] = None, **kwargs) -> str:
        """The trace as JSON text; written to `path` too when given."""
        text = json.dumps(self.to_dict(), **{"indent": 1, **kwargs})
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        return text

    @classmethod
    def load(cls, path: str) -> "Trace":
        """Read a trace written by `to_json(path)`."""
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def table(self, *, by: str = "component"):
        """A `rich.table.Table` of moves and bytes per component (`by="component"`) or per call (`by="call"`)."""
        from ..report import summary_table

        return summary_table(self, by=by)

    def plot(self, path: Optional[str] = None, *, x: str = "step", title: Optional[str] = None):
        """A timeline (matplotlib `Figure`, Agg canvas): one lane per component, moves as marks sized by bytes,
        resident intervals shaded. `x="step"` (calls side by side, slots for before the loop, each step and after it)
        or `x="time"` (seconds). Saved as PNG to `path` when given."""
        from ..report import plot_traces

        return plot_traces([(title, self)], path, x=x)

    def __eq__(self, other) -> bool:
        """Equal when they hold the same records, calls, components, device, pipeline and notes (what `to_json`
        writes): `Trace.load(path) == trace` after `trace.to_json(path)`."""
        if not isinstance(other, Trace):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    __hash__ = None  # a trace grows while it records

    def __repr__(self) -> str:
        replayed = ", REPLAYED moves" if self.replayed else ""
        return f"Trace({self.pipeline}, {len(self.calls)} calls, {len(self.records)} moves{replayed})"


def trace(pipe) -> Trace:
    r"""
    Record every move of a pipeline's component weights while the returned context manager is active.

    Each record says the call and denoising step, the component, the direction, the bytes, the duration (CUDA events
    on CUDA, wall clock elsewhere) and where it came from: this extension's own moves, moves observed from where the
    parameters really are (before and after every offload hook, whatever the hook is called), or, on the CPU where
    stock diffusers' model and group offload move nothing visible, moves replayed from stock's policy (always marked
    as replayed). Each move runs inside a `torch.profiler.record_function` range (and an NVTX range on CUDA).

    Args:
        pipe (`DiffusionPipeline`): The pipeline to trace.

    Returns:
        `Trace`: a context manager; after it exits, `.records`, `.calls`, `.summary()`, `.table()`,
        `.to_json()` and `.plot()` describe what happened. Entering it again records more calls into it.

    Example:

    ```py
    >>> import diffusers_offload_ext as doe

    >>> pipe.enable_model_cpu_offload()
    >>> with doe.trace(pipe) as t:
    ...     pipe("a cat", num_inference_steps=28)
    >>> t.summary()["total"]["onload_bytes"]
    >>> t.plot("timeline.png")
    ```
    """
    from diffusers import DiffusionPipeline

    if not isinstance(pipe, DiffusionPipeline):
        raise TypeError(f"`pipe` must be a `DiffusionPipeline`, got {pipe!r}.")
    return Trace(pipe)
