"""The trace's data: one `TraceRecord` per move, one `CallInfo` per pipeline call with its `ComponentUse`s, the three
sources a record can come from, and their JSON form (format `diffusers-offload-trace`, version 1)."""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

from ...ledger import CopiedBytes

FORMAT = "diffusers-offload-trace"
FORMAT_VERSION = 1

#: A move this extension made, timed around its transfer.
EXTENSION = "extension"
#: A change of `tensor.device` that the trace saw.
OBSERVED = "observed"
#: Not seen: what stock's policy does on the recorded component-call trace (CPU only).
REPLAYED = "replayed"
SOURCES = (EXTENSION, OBSERVED, REPLAYED)

#: Where a move was seen when no hook or pipeline method was running.
BETWEEN = "between hooks"


@dataclasses.dataclass
class TraceRecord(CopiedBytes):
    """One move of (part of) one component's weights.

    Args:
        index (`int`): Position in the trace.
        call (`int` or `None`): Index of the pipeline call made inside the trace (0 = first), `None` outside calls.
        step (`int` or `None`): Denoising step (the pipeline's progress bar position), `None` outside the loop.
        phase (`str`): `"setup"`, `"before-loop"`, `"denoising"` or `"after-loop"`.
        component (`str`): The pipeline component.
        direction (`str`): `"onload"` (to the execution device) or `"offload"` (away from it).
        nbytes (`int`): Bytes of the parameters and buffers that moved.
        kind (`str`): `"copy"` (bytes crossed the bus) or `"drop"` (the device copy was released and nothing was
            copied back: a zero-copy eviction of the residency manager, or tensors observed going to `meta`).
        source (`str`): `"extension"`, `"observed"` or `"replayed"` (see `diffusers_offload_ext.observe.trace`).
        src (`str`): Device the tensors were on.
        dst (`str`): Device they went to.
        t (`float`): Seconds since the trace started when the move ended.
        duration_s (`float` or `None`): Seconds the move took (CUDA events on CUDA, wall clock elsewhere); for an
            observed move, the duration of the hook method it happened in, shared by the moves of that method; `None`
            when unknown (seen between hooks, or replayed).
        timing (`str` or `None`): `"cuda-events"`, `"wall-clock"` or `None`.
        where (`str`): The hook method or pipeline method running when it was seen, or `"between hooks"`.
        resident_bytes (`int`): Bytes of the component on the execution device after the move (of a streaming
            component: its blocks on the device, resident or in the ring).
        block (`str` or `None`): For a component that streams its blocks (larger than the memory budget), the block
            that moved; `None` for a move of the whole component.
        cause (`str` or `None`): `"out-of-memory"` for a move an out-of-memory recovery forced (the ledger's
            `TransferRecord.cause`); `None` otherwise.
    """

    index: int
    call: Optional[int]
    step: Optional[int]
    phase: str
    component: str
    direction: str
    nbytes: int
    kind: str
    source: str
    src: str
    dst: str
    t: float
    duration_s: Optional[float] = None
    timing: Optional[str] = None
    where: str = ""
    resident_bytes: int = 0
    block: Optional[str] = None
    cause: Optional[str] = None


@dataclasses.dataclass
class ComponentUse:
    """A component started running (its first module was entered) in a traced call."""

    component: str
    step: Optional[int]
    phase: str
    t: float


@dataclasses.dataclass
class CallInfo:
    """One pipeline call made inside a trace.

    Args:
        index (`int`): 0 for the first call of the trace.
        start (`float`), end (`float` or `None`): Seconds since the trace started.
        steps (`int`): Denoising steps the progress bar counted.
        failed (`bool`): The call raised.
        mode (`str`): What offloaded it: `"extension"`, `"model-offload"`, `"sequential-offload"`, `"group-offload"`
            or `"none"`.
        replayed (`bool`): Its moves were replayed from stock's policy (not measured).
        uses (`List[ComponentUse]`): The component-call trace.
        blocks (`Dict[str, dict]`): For each component that ran keeping only some of its blocks on the device (the
            residency manager decides block by block), as it last ran in the call: `kept` (its blocks on the device),
            `streamed` (those that passed through its ring) and `why`, the manager's reason in words.
        host (`dict` or `None`): Under a host budget (`host_memory_budget`), the pipeline's host bytes at the call's
            end: `budget`, `page_locked` (the staging ring included), `anonymous`, `file_backed`; `None` without one.
    """

    index: int
    start: float
    end: Optional[float] = None
    steps: int = 0
    failed: bool = False
    mode: str = "none"
    replayed: bool = False
    uses: List[ComponentUse] = dataclasses.field(default_factory=list)
    blocks: Dict[str, dict] = dataclasses.field(default_factory=dict)
    host: Optional[dict] = None


def to_document(trace) -> dict:
    """`trace` as a JSON-ready `dict` (`read_document` reads it back)."""
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "pipeline": trace.pipeline,
        "device": trace.device,
        "replayed": trace.replayed,
        "sources": trace.sources,
        "notes": list(trace.notes),
        "components": dict(trace.components),
        "initial_resident": dict(trace.initial_resident),
        "calls": [dataclasses.asdict(c) for c in trace.calls],
        "records": [dataclasses.asdict(r) for r in trace.records],
        "summary": trace.summary(),
    }


def read_document(data: dict, trace) -> None:
    """Fill the empty `trace` from what `to_document` wrote.

    Raises:
        `ValueError`: `data` is not a trace of a format version this package reads.
    """
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"Not a {FORMAT} JSON document.")
    if data.get("version") != FORMAT_VERSION:
        raise ValueError(f"Trace format version {data.get('version')!r} is not {FORMAT_VERSION}.")
    trace.pipeline = data.get("pipeline")
    trace.device = data.get("device")
    trace.notes = list(data.get("notes", []))
    trace.components = {k: int(v) for k, v in data.get("components", {}).items()}
    trace.initial_resident = {k: int(v) for k, v in data.get("initial_resident", {}).items()}
    for call in data.get("calls", []):
        uses = [ComponentUse(**u) for u in call.get("uses", [])]
        trace.calls.append(CallInfo(**{**call, "uses": uses}))
    trace.records = [TraceRecord(**r) for r in data.get("records", [])]
