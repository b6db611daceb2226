"""`doe.trace(pipe)`: which component's weights really moved, in which call and step, how many bytes, how long.

Three sources of records, always named in the record (`source`) and in every output:

- `"extension"`: a move this extension made (`OffloadState.move`), timed around its single `.to()`.
- `"observed"`: parameters or buffers found on another device than the last time they were looked at. The trace
  looks before and after every offload hook method (accelerate's `_hf_hook` objects, diffusers' hook registries)
  and every pipeline method that moves weights, and when a component starts running. It never infers a move from a
  hook's name or type: only a changed `tensor.device` counts.
- `"replayed"`: on the CPU the execution device is the host, so stock's model offload and group offload move
  nothing that can be seen. The trace then records the component-call trace and derives stock's moves from stock's
  policy (`ChainPolicy` for model offload, the hooks' groups for group offload). These are predictions, not
  measurements.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

import torch
from diffusers.utils import logging

from ..constants import COPY, DROP, OFFLOAD, ONLOAD
from ..policies import ChainPolicy, apply
from ..runtime.arming import get_session as get_state

logger = logging.get_logger(__name__)

FORMAT = "diffusers-offload-trace"
FORMAT_VERSION = 1

#: A move this extension made, timed around its `.to()`.
EXTENSION = "extension"
#: A change of `tensor.device` that the trace saw.
OBSERVED = "observed"
#: Not seen: what stock's policy does on the recorded component-call trace (CPU only).
REPLAYED = "replayed"
SOURCES = (EXTENSION, OBSERVED, REPLAYED)

#: Outside any pipeline call (enabling offload, `pipe.to(...)`).
SETUP = "setup"
#: In a call, before the denoising loop (text encoders, VAE encode).
BEFORE = "before-loop"
#: In the denoising loop; `step` says which step.
LOOP = "denoising"
#: In a call, after the denoising loop (VAE decode, end-of-call offload).
AFTER = "after-loop"
PHASES = (SETUP, BEFORE, LOOP, AFTER)

#: Where a move was seen when no hook or pipeline method was running.
BETWEEN = "between hooks"

REPLAY_NOTE = (
    "REPLAYED, not measured: on {device} stock's {what} moves nothing that can be seen (the execution device is the "
    "host), so its moves here are replayed from {policy} over the recorded component-call trace."
)
EXTENSION_CPU_NOTE = (
    "The execution device is the CPU: the extension's moves are its `.to()` calls as its ledger records them; no "
    "bytes crossed a bus."
)

_PIPELINE_METHODS = (
    "enable_model_cpu_offload",
    "enable_sequential_cpu_offload",
    "enable_group_offload",
    "maybe_free_model_hooks",
    "remove_all_hooks",
    "reset_device_map",
    "to",
)
_TRACER_ATTR = "_offload_ext_tracer"
_HOOK_METHODS = ("pre_forward", "post_forward", "init_hook")


@dataclasses.dataclass
class TraceRecord:
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
        source (`str`): `"extension"`, `"observed"` or `"replayed"` (see the module docstring).
        src (`str`): Device the tensors were on.
        dst (`str`): Device they went to.
        t (`float`): Seconds since the trace started when the move ended.
        duration_s (`float` or `None`): Seconds the move took (CUDA events on CUDA, wall clock elsewhere); for an
            observed move, the duration of the hook method it happened in, shared by the moves of that method; `None`
            when unknown (seen between hooks, or replayed).
        timing (`str` or `None`): `"cuda-events"`, `"wall-clock"` or `None`.
        where (`str`): The hook method or pipeline method running when it was seen, or `"between hooks"`.
        resident_bytes (`int`): Bytes of the component on the execution device after the move.
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

    @property
    def copied_bytes(self) -> int:
        """Bytes that crossed the bus (0 for a drop)."""
        return 0 if self.kind == DROP else self.nbytes


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
    """

    index: int
    start: float
    end: Optional[float] = None
    steps: int = 0
    failed: bool = False
    mode: str = "none"
    replayed: bool = False
    uses: List[ComponentUse] = dataclasses.field(default_factory=list)


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
        self._session: Optional[_Tracer] = None
        self._t0: Optional[float] = None

    # -- context manager ---------------------------------------------------------------------------------------
    def __enter__(self) -> "Trace":
        if self._pipe is None:
            raise RuntimeError("This trace was loaded from a file; it cannot record. Use `doe.trace(pipe)`.")
        if self._session is not None:
            raise RuntimeError("This trace is already recording.")
        if self._t0 is None:
            self._t0 = time.perf_counter()
        session = _Tracer(self, self._pipe)
        try:
            session.start()
        except BaseException:
            session.stop()
            raise
        self._session = session
        return self

    def __exit__(self, *exc_info) -> None:
        session, self._session = self._session, None
        if session is not None:
            session.stop()

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
        """Counts, bytes and seconds in total, per component, per call and per source (see `_report.summarize`)."""
        from .report import summarize

        return summarize(self)

    def to_dict(self) -> dict:
        """A JSON-ready `dict` (`Trace.from_dict` reads it back)."""
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "pipeline": self.pipeline,
            "device": self.device,
            "replayed": self.replayed,
            "sources": self.sources,
            "notes": list(self.notes),
            "components": dict(self.components),
            "initial_resident": dict(self.initial_resident),
            "calls": [dataclasses.asdict(c) for c in self.calls],
            "records": [dataclasses.asdict(r) for r in self.records],
            "summary": self.summary(),
        }

    @classmethod
    def from_dict(cls, data: dict) -> "Trace":
        """Read what `to_dict` wrote.

        Raises:
            `ValueError`: `data` is not a trace of a format version this package reads.
        """
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"Not a {FORMAT} JSON document.")
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(f"Trace format version {data.get('version')!r} is not {FORMAT_VERSION}.")
        trace = cls()
        trace.pipeline = data.get("pipeline")
        trace.device = data.get("device")
        trace.notes = list(data.get("notes", []))
        trace.components = {k: int(v) for k, v in data.get("components", {}).items()}
        trace.initial_resident = {k: int(v) for k, v in data.get("initial_resident", {}).items()}
        for call in data.get("calls", []):
            uses = [ComponentUse(**u) for u in call.get("uses", [])]
            trace.calls.append(CallInfo(**{**call, "uses": uses}))
        trace.records = [TraceRecord(**r) for r in data.get("records", [])]
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
        from .report import summary_table

        return summary_table(self, by=by)

    def plot(self, path: Optional[str] = None, *, x: str = "step", title: Optional[str] = None):
        """A timeline (matplotlib `Figure`, Agg canvas): one lane per component, moves as marks sized by bytes,
        resident intervals shaded. `x="step"` (calls side by side, slots for before the loop, each step and after it)
        or `x="time"` (seconds). Saved as PNG to `path` when given."""
        from .report import plot_traces

        return plot_traces([(title, self)], path, x=x)

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


# ----------------------------------------------------------------------------------------------------------------
# NVTX and timing: small and separate, so that tests can check them with mocks.
# ----------------------------------------------------------------------------------------------------------------


def _nvtx_enabled(device: Optional[torch.device]) -> bool:
    return device is not None and device.type == "cuda" and torch.cuda.is_available()


@contextlib.contextmanager
def nvtx_range(message: str, device: Optional[torch.device]):
    """An NVTX range named `message` when `device` is a CUDA device (so it shows in Nsight), else nothing."""
    if not _nvtx_enabled(device):
        yield
        return
    torch.cuda.nvtx.range_push(message)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


class _Clock:
    """Times spans: CUDA events on a CUDA execution device (read when the trace ends), wall clock elsewhere."""

    def __init__(self, device: Optional[torch.device]) -> None:
        self.cuda = _nvtx_enabled(device)
        self.timing = "cuda-events" if self.cuda else "wall-clock"

    def start(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, token) -> Callable[[], float]:
        """A function that returns the span's seconds (for CUDA, after synchronising)."""
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()

            def seconds() -> float:
                end.synchronize()
                return token.elapsed_time(end) / 1000.0

            return seconds
        elapsed = time.perf_counter() - token
        return lambda: elapsed


# ----------------------------------------------------------------------------------------------------------------
# The live machinery.
# ----------------------------------------------------------------------------------------------------------------


_DEVICE_NAMES: Dict[Any, str] = {}


def _norm_device(device: Any) -> Optional[str]:
    """A device as a string with an index for accelerators (`"cuda:0"`), `None` when unknown."""
    if device is None:
        return None
    try:
        return _DEVICE_NAMES[device]
    except (KeyError, TypeError):
        pass
    key = device
    if isinstance(device, int):
        device = torch.device("cuda", device)
    device = torch.device(device)
    if device.type in ("cpu", "meta"):
        name = device.type
    elif device.index is None:
        index = 0
        module = getattr(torch, device.type, None)
        if module is not None and hasattr(module, "current_device"):
            try:
                index = module.current_device()
            except Exception:  # not initialised: index 0 is what torch would pick
                index = 0
        return f"{device.type}:{index}"
    else:
        name = str(device)
    try:
        _DEVICE_NAMES[key] = name
    except TypeError:
        pass
    return name


def _slots(module: torch.nn.Module, prefix: str = "") -> List[Tuple[str, Any, str, bool]]:
    """`(qualified name, owning module, local name, is parameter)` of every parameter and buffer under `module`,
    each tensor once, so that a check reads the current tensor even when a hook replaced it."""
    out = []
    seen: Set[int] = set()
    for name, sub in module.named_modules(prefix=prefix):
        for local, tensor in sub._parameters.items():
            if tensor is not None and id(tensor) not in seen:
                seen.add(id(tensor))
                out.append((f"{name}.{local}" if name else local, sub, local, True))
        for local, tensor in sub._buffers.items():
            if tensor is not None and id(tensor) not in seen:
                seen.add(id(tensor))
                out.append((f"{name}.{local}" if name else local, sub, local, False))
    return out


def _tensors(module: torch.nn.Module, prefix: str = ""):
    """`(qualified name, tensor)` for the parameters and buffers of `module`, each tensor once."""
    for name, tensor in module.named_parameters(prefix=prefix):
        yield name, tensor
    for name, tensor in module.named_buffers(prefix=prefix):
        yield name, tensor


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _hook_chain(hook) -> List[Any]:
    """An accelerate hook and the hooks it chains (`SequentialHook.hooks`)."""
    found = [hook]
    for inner in getattr(hook, "hooks", None) or ():
        found.extend(_hook_chain(inner))
    return found


def _is_cpu_offload(hook) -> bool:
    from accelerate.hooks import CpuOffload

    return any(isinstance(h, CpuOffload) for h in _hook_chain(hook))


def _is_extension_hook(hook) -> bool:
    from ..runtime.hook import DeferredCpuOffload

    return any(isinstance(h, DeferredCpuOffload) for h in _hook_chain(hook))


def _registry_hooks(module) -> List[Any]:
    registry = getattr(module, "_diffusers_hook", None)
    hooks = getattr(registry, "hooks", None)
    return list(hooks.values()) if isinstance(hooks, dict) else []


class _StepBar:
    """Wraps a pipeline's progress bar: tells the tracer when the loop starts, advances and ends."""

    def __init__(self, bar, tracer: "_Tracer", total: Optional[int]) -> None:
        self._bar = bar
        self._tracer = tracer
        self._total = total

    def __enter__(self):
        self._bar.__enter__()
        self._tracer.loop_started(self._total)
        return self

    def __exit__(self, *exc_info):
        self._tracer.loop_ended()
        return self._bar.__exit__(*exc_info)

    def update(self, n: int = 1):
        result = self._bar.update(n)
        self._tracer.advance(n)
        return result

    def __iter__(self):
        self._tracer.loop_started(self._total)
        try:
            for index, item in enumerate(self._bar):
                self._tracer.set_step(index)
                yield item
        finally:
            self._tracer.loop_ended()

    def __len__(self):
        return len(self._bar)

    def __getattr__(self, name):
        return getattr(self._bar, name)


def _traced_class(cls: type, tracer: "_Tracer") -> type:
    """A subclass of the pipeline's class whose calls, progress bars and offload methods tell `tracer`."""
    from ..runtime.arming import MARK

    def __call__(self, *args, **kwargs):
        failed = True
        tracer.begin_call()
        try:
            result = super(traced, self).__call__(*args, **kwargs)
            failed = False
            return result
        finally:
            tracer.end_call(failed)

    setattr(__call__, MARK, cls.__call__)

    def progress_bar(self, iterable=None, total=None):
        bar = super(traced, self).progress_bar(iterable=iterable, total=total)
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        return tracer.wrap_bar(bar, total)

    namespace = {
        "__call__": __call__,
        "progress_bar": progress_bar,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
        _TRACER_ATTR: tracer,
    }

    def pipeline_method(name):
        def method(self, *args, **kwargs):
            stock = getattr(super(traced, self), name)
            return tracer.bracket_pipeline(name, lambda: stock(*args, **kwargs))

        method.__name__ = name
        return method

    for name in _PIPELINE_METHODS:
        if hasattr(cls, name):
            namespace[name] = pipeline_method(name)
    traced = type(cls.__name__, (cls,), namespace)
    return traced


class _Tracer:
    """One recording session of a `Trace` on one pipeline."""

    def __init__(self, trace: Trace, pipe) -> None:
        self.trace = trace
        self.pipe = pipe
        self.active = False
        self.original_class: Optional[type] = None
        self.handles: List[Any] = []
        self.wrapped: List[Tuple[Any, str, bool, Any]] = []
        self.wrapped_ids: Set[Tuple[int, str]] = set()
        self.pending: List[Tuple[TraceRecord, Callable[[], float]]] = []
        self.depth = 0
        self.call_depth = 0
        self.call: Optional[CallInfo] = None
        self.step: Optional[int] = None
        self.phase = SETUP
        self.bar_depth = 0
        self.total: Optional[int] = None
        self.stack: List[str] = []
        self.modules: Dict[str, torch.nn.Module] = {}
        self.module_component: Dict[int, str] = {}
        self.where: Dict[Tuple[str, str], Tuple[str, int]] = {}
        self.resident: Dict[str, int] = {}
        self.device: Optional[torch.device] = None
        self.exec_device: Optional[str] = None
        self.clock = _Clock(None)
        self.mode = "none"
        self.replay_policy: Optional[ChainPolicy] = None
        self.replay_resident: Set[str] = set()
        self.group_resident: Set[int] = set()
        self.group_bytes: Dict[int, int] = {}
        self.observed_state = None
        self.slot_cache: Dict[Tuple[int, str], List[Tuple[str, Any, str, bool]]] = {}

    # -- start and stop ------------------------------------------------------------------------------------------
    def start(self) -> None:
        pipe = self.pipe
        if getattr(type(pipe), _TRACER_ATTR, None) is not None:
            raise RuntimeError("This pipeline is already being traced.")
        self.original_class = type(pipe)
        object.__setattr__(pipe, "__class__", _traced_class(self.original_class, self))
        register_pre = torch.nn.modules.module.register_module_forward_pre_hook
        register_post = torch.nn.modules.module.register_module_forward_hook
        self.handles.append(register_pre(self.module_entered))
        self.handles.append(register_post(self.module_left, always_call=True))
        self.active = True
        self.refresh(initial=True)

    def stop(self) -> None:
        self.active = False
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for owner, attr, had_own, previous in reversed(self.wrapped):
            if had_own:
                setattr(owner, attr, previous)
            else:
                try:
                    delattr(owner, attr)
                except AttributeError:
                    pass
        self.wrapped.clear()
        self.wrapped_ids.clear()
        self.detach_state()
        if type(self.pipe).__dict__.get(_TRACER_ATTR) is self:
            object.__setattr__(self.pipe, "__class__", self.original_class)
        for record, seconds in self.pending:
            try:
                record.duration_s = float(seconds())
            except Exception:  # a CUDA error must not lose the trace
                logger.warning(f"Could not read the duration of trace record {record.index}.")
        self.pending.clear()

    # -- what the pipeline has now ------------------------------------------------------------------------------
    def now(self) -> float:
        return time.perf_counter() - self.trace._t0

    def refresh(self, initial: bool = False) -> None:
        """Re-read components, devices, hooks and the offload mode (at start, each call, after offload methods)."""
        from ..runtime.options import module_components

        pipe = self.pipe
        self.slot_cache = {}
        modules = module_components(pipe.components)
        sequence = [n.strip() for n in (getattr(pipe, "model_cpu_offload_seq", None) or "").split("->")]
        first = [n for n in dict.fromkeys(sequence) if n in modules]
        self.modules = {n: modules[n] for n in first + [n for n in modules if n not in first]}
        self.module_component = {}
        shared: Set[int] = set()
        for name, module in self.modules.items():
            for sub in module.modules():
                if self.module_component.setdefault(id(sub), name) != name:
                    # Shared between components (old diffusers reuse one activation module everywhere): running it
                    # says nothing about which component runs.
                    shared.add(id(sub))
            if name not in self.trace.components:
                self.trace.components[name] = sum(_nbytes(t) for _, t in _tensors(module))
        for key in shared:
            del self.module_component[key]
        self.device, self.mode = self.detect()
        self.exec_device = _norm_device(self.device)
        if self.exec_device is not None and self.trace.device is None:
            self.trace.device = self.exec_device
        self.clock = _Clock(self.device)
        self.attach_state()
        self.wrap_hooks()
        if initial:
            for name, module in self.modules.items():
                for key, owner, local, is_parameter in self.slots_of(module, ""):
                    tensor = (owner._parameters if is_parameter else owner._buffers)[local]
                    self.where[(name, key)] = (_norm_device(tensor.device), _nbytes(tensor))
            self.resident = {name: self.initial_resident_bytes(name) for name in self.modules}
            for name, nbytes in self.resident.items():
                self.trace.initial_resident.setdefault(name, nbytes)
        else:
            for name, module in self.modules.items():
                for key, owner, local, is_parameter in self.slots_of(module, ""):
                    tensor = (owner._parameters if is_parameter else owner._buffers)[local]
                    self.where.setdefault((name, key), (_norm_device(tensor.device), _nbytes(tensor)))
                self.resident.setdefault(name, 0)
        self.replay_policy = self.stock_chain_policy() if self.replays_model_offload() else None
        if initial and self.replay_policy is not None:
            # Stock re-arms offload at the end of every call: a pipeline between calls is in the post-enable state.
            self.replay_resident = set(self.replay_policy.round_trip)
            for name in self.replay_resident:
                self.resident[name] = self.trace.components.get(name, 0)
                self.trace.initial_resident[name] = self.resident[name]
        self.note_mode()

    def detect(self) -> Tuple[Optional[torch.device], str]:
        pipe = self.pipe
        state = get_state(pipe)
        if state is not None and state.active and state.device is not None:
            return state.device, "extension"
        for module in self.modules.values():
            hook = getattr(module, "_hf_hook", None)
            if hook is not None and not _is_extension_hook(hook) and _is_cpu_offload(hook):
                device = next((h.execution_device for h in _hook_chain(hook) if hasattr(h, "execution_device")), None)
                return torch.device(_norm_device(device) or "cpu"), "model-offload"
        for module in self.modules.values():
            for sub in module.modules():
                for hook in _registry_hooks(sub):
                    group = getattr(hook, "group", None)
                    if group is not None and getattr(group, "onload_device", None) is not None:
                        return torch.device(group.onload_device), "group-offload"
                hook = getattr(sub, "_hf_hook", None)
                if hook is not None and sub is not module:
                    device = next(
                        (h.execution_device for h in _hook_chain(hook) if getattr(h, "execution_device", None)), None
                    )
                    if device is not None:
                        return torch.device(_norm_device(device)), "sequential-offload"
        device = getattr(pipe, "_offload_device", None)
        if device is None:
            try:
                device = pipe._execution_device
            except Exception:
                device = None
        return (torch.device(device) if device is not None else None), "none"

    def replays_model_offload(self) -> bool:
        return self.mode == "model-offload" and self.exec_device == "cpu"

    def replays_group_offload(self) -> bool:
        return self.mode == "group-offload" and self.exec_device == "cpu"

    def note_mode(self) -> None:
        if self.replays_model_offload():
            self.trace.add_note(
                REPLAY_NOTE.format(device="cpu", what="model offload", policy="stock's chain policy (`ChainPolicy`)")
            )
        elif self.replays_group_offload():
            self.trace.add_note(
                REPLAY_NOTE.format(
                    device="cpu",
                    what="group offload",
                    policy="its groups (each group onloaded before its forward, offloaded after)",
                )
            )
        elif self.mode == "extension" and self.exec_device == "cpu":
            self.trace.add_note(EXTENSION_CPU_NOTE)

    def initial_resident_bytes(self, name: str) -> int:
        state = get_state(self.pipe)
        if self.mode == "extension":
            return self.trace.components.get(name, 0) if name in state.resident else 0
        if self.mode in ("model-offload", "group-offload") and self.exec_device == "cpu":
            return 0
        return self.placement_resident(name)

    def placement_resident(self, name: str) -> int:
        target = self.exec_device
        total = 0
        for (component, _), (device, nbytes) in self.where.items():
            if component != name:
                continue
            if (target is not None and device == target) or (target is None and device not in ("cpu", "meta")):
                total += nbytes
        return total

    def stock_chain_policy(self) -> ChainPolicy:
        """Stock's model offload as a `ChainPolicy`, read from the pipeline (its chain and its hooks)."""
        pipe = self.pipe
        modules = {n: m for n, m in self.modules.items() if not getattr(m, "is_loaded_in_8bit", False)}
        hooked = [n for n, m in modules.items() if getattr(m, "_hf_hook", None) is not None]
        sequence = [n.strip() for n in (pipe.model_cpu_offload_seq or "").split("->")]
        chain = [n for n in dict.fromkeys(sequence) if n in hooked]
        excluded = list(getattr(pipe, "_exclude_from_cpu_offload", None) or [])
        bounce = [n for n in modules if n in excluded and n not in hooked]
        return ChainPolicy(
            order=list(modules),
            chain=chain,
            hooked=chain + [n for n in hooked if n not in chain],
            round_trip=bounce,
        )

    # -- the extension's own moves ------------------------------------------------------------------------------
    def attach_state(self) -> None:
        state = get_state(self.pipe)
        if state is self.observed_state:
            return
        self.detach_state()
        if state is not None:
            state.observers.append(self.extension_move)
            self.observed_state = state

    def detach_state(self) -> None:
        state, self.observed_state = self.observed_state, None
        if state is not None and self.extension_move in state.observers:
            state.observers.remove(self.extension_move)

    def extension_move(self, name: str, direction: str, module: torch.nn.Module, nbytes: int):
        if not self.active:
            return lambda record: None
        state = get_state(self.pipe)
        device = state.device if state is not None else self.device
        label = f"diffusers_offload_ext::{direction}::{name}"
        pushed = _nvtx_enabled(device)
        if pushed:
            torch.cuda.nvtx.range_push(label)
        clock = _Clock(device)
        token = clock.start()
        host, target = "cpu", _norm_device(device) or "cpu"
        src, dst = (host, target) if direction == ONLOAD else (target, host)

        def finish(record) -> None:
            seconds = clock.stop(token)
            if pushed:
                torch.cuda.nvtx.range_pop()
            if device is not None and device.type != "cpu":
                self.rebase(name, module)
            self.resident[name] = nbytes if direction == ONLOAD else 0
            self.add(name, direction, record.nbytes, record.kind, EXTENSION, src, dst, "extension", seconds, clock)

        return finish

    # -- records -------------------------------------------------------------------------------------------------
    def add(self, component, direction, nbytes, kind, source, src, dst, where, seconds=None, clock=None) -> None:
        record = TraceRecord(
            index=len(self.trace.records),
            call=self.call.index if self.call is not None else None,
            step=self.step if self.phase == LOOP else None,
            phase=self.phase,
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
        )
        self.trace.records.append(record)
        if seconds is not None:
            if clock is not None and clock.cuda:
                self.pending.append((record, seconds))
            else:
                record.duration_s = float(seconds())
        if self.call is not None and source == REPLAYED:
            self.call.replayed = True

    # -- observing placement -------------------------------------------------------------------------------------
    def rebase(self, name: str, module: torch.nn.Module) -> None:
        for key, owner, local, is_parameter in self.slots_of(module, ""):
            tensor = (owner._parameters if is_parameter else owner._buffers).get(local)
            if tensor is not None:
                self.where[(name, key)] = (_norm_device(tensor.device), _nbytes(tensor))

    def classify(self, src: str, dst: str) -> Tuple[str, str]:
        if dst == "meta":
            return OFFLOAD, DROP
        if self.exec_device is not None:
            return (ONLOAD if dst == self.exec_device else OFFLOAD), COPY
        return (ONLOAD if dst != "cpu" else OFFLOAD), COPY

    def check(self, scopes, where: str, seconds=None) -> int:
        """Compare the placement of the tensors in `scopes` with what was seen last; record each change."""
        moved: Dict[Tuple[str, str, str], int] = {}
        placement = self.where
        for component, module, prefix in scopes:
            for name, owner, local, is_parameter in self.slots_of(module, prefix):
                tensor = (owner._parameters if is_parameter else owner._buffers).get(local)
                if tensor is None:
                    continue
                key = (component, name)
                device = _norm_device(tensor.device)
                before = placement.get(key)
                if before is not None and before[0] == device:
                    continue
                nbytes = _nbytes(tensor)
                placement[key] = (device, nbytes)
                if before is None:
                    continue
                moved_key = (component, before[0], device)
                moved[moved_key] = moved.get(moved_key, 0) + nbytes
        if not moved:
            return 0
        total = sum(moved.values())
        for (component, src, dst), nbytes in moved.items():
            direction, kind = self.classify(src, dst)
            if self.exec_device == "cpu" and self.mode in ("extension", "model-offload", "group-offload"):
                # There, placement on the CPU says nothing about residency: count the move instead.
                change = nbytes if direction == ONLOAD else -nbytes
                self.resident[component] = max(0, self.resident.get(component, 0) + change)
            else:
                self.resident[component] = self.placement_resident(component)
            share = None
            if seconds is not None:
                fraction = nbytes / total if total else 1.0
                share = (lambda f=fraction: seconds() * f) if len(moved) > 1 else seconds
            label = f"diffusers_offload_ext::{direction}::{component}"
            with torch.profiler.record_function(f"{label} (observed in {where})"):
                pass
            self.add(component, direction, nbytes, kind, OBSERVED, src, dst, where, share, self.clock)
        return len(moved)

    def slots_of(self, module: torch.nn.Module, prefix: str):
        key = (id(module), prefix)
        slots = self.slot_cache.get(key)
        if slots is None:
            slots = self.slot_cache[key] = _slots(module, prefix)
        return slots

    def all_scopes(self):
        return [(name, module, "") for name, module in self.modules.items()]

    # -- brackets around hooks and pipeline methods --------------------------------------------------------------
    def bracket(self, call: Callable[[], Any], scopes, where: str) -> Any:
        if not self.active or self.depth:
            return call()
        self.depth += 1
        seconds = None
        try:
            self.check(scopes, BETWEEN)
            token = self.clock.start()
            with (
                torch.profiler.record_function(f"diffusers_offload_ext::hook::{where}"),
                nvtx_range(f"diffusers_offload_ext::hook::{where}", self.device),
            ):
                result = call()
            seconds = self.clock.stop(token)
            return result
        finally:
            self.check(scopes, where, seconds)
            self.depth -= 1

    def bracket_pipeline(self, name: str, call: Callable[[], Any]) -> Any:
        if not self.active:
            return call()
        result = self.bracket(call, self.all_scopes(), f"{type(self.pipe).__name__}.{name}")
        self.refresh()
        if name == "enable_model_cpu_offload" and self.replay_policy is not None:
            self.replay(self.replay_policy.on_enable(self.replay_resident).moves)
        return result

    def wrap_hooks(self) -> None:
        for component, root in self.modules.items():
            for prefix, module in root.named_modules():
                hook = getattr(module, "_hf_hook", None)
                scopes = self.all_scopes() if module is root else [(component, module, prefix)]
                if hook is not None:
                    for inner in _hook_chain(hook):
                        for method in _HOOK_METHODS:
                            self.wrap_method(inner, method, module, component, scopes, prefix)
                for hook in _registry_hooks(module):
                    fn_ref = getattr(hook, "fn_ref", None)
                    if fn_ref is None:
                        continue
                    for method in ("pre_forward", "post_forward"):
                        self.wrap_method(fn_ref, method, module, component, scopes, prefix, group_hook=hook)

    def wrap_method(self, owner, method, module, component, scopes, prefix, group_hook=None) -> None:
        original = getattr(owner, method, None)
        if original is None or (id(owner), method) in self.wrapped_ids:
            return
        tracer = self
        label = f"{type(group_hook or owner).__name__}.{method}({component}{'.' + prefix if prefix else ''})"

        def wrapper(*args, **kwargs):
            result = tracer.bracket(lambda: original(*args, **kwargs), scopes, label)
            if group_hook is not None and tracer.active and tracer.replays_group_offload():
                tracer.replay_group(group_hook, module, component, method)
            return result

        had_own = method in getattr(owner, "__dict__", {})
        self.wrapped.append((owner, method, had_own, original if had_own else None))
        self.wrapped_ids.add((id(owner), method))
        setattr(owner, method, wrapper)

    # -- replays (CPU only) --------------------------------------------------------------------------------------
    def replay(self, moves: Iterable[Tuple[str, str]]) -> None:
        moves = list(moves)
        apply(moves, self.replay_resident)
        device = self.exec_device or "cpu"
        for direction, name in moves:
            nbytes = self.trace.components.get(name, 0)
            self.resident[name] = nbytes if direction == ONLOAD else 0
            src, dst = ("cpu", device) if direction == ONLOAD else (device, "cpu")
            self.add(name, direction, nbytes, COPY, REPLAYED, src, dst, "replay: stock chain policy")

    def replay_group(self, hook, module, component: str, method: str) -> None:
        group = getattr(hook, "group", None)
        if group is None:
            return
        key = id(group)
        if key not in self.group_bytes:
            seen: Set[int] = set()
            total = 0
            tensors = [t for m in getattr(group, "modules", []) or [] for _, t in _tensors(m)]
            tensors += list(getattr(group, "parameters", []) or []) + list(getattr(group, "buffers", []) or [])
            for tensor in tensors:
                if id(tensor) not in seen:
                    seen.add(id(tensor))
                    total += _nbytes(tensor)
            self.group_bytes[key] = total
        nbytes = self.group_bytes[key]
        device = self.exec_device or "cpu"
        if method == "pre_forward" and key not in self.group_resident:
            self.group_resident.add(key)
            self.resident[component] = self.resident.get(component, 0) + nbytes
            self.add(component, ONLOAD, nbytes, COPY, REPLAYED, "cpu", device, "replay: group offload")
        elif method == "post_forward" and key in self.group_resident:
            leader = getattr(group, "offload_leader", None)
            if leader is None or leader is module:
                self.group_resident.discard(key)
                self.resident[component] = max(0, self.resident.get(component, 0) - nbytes)
                self.add(component, OFFLOAD, nbytes, COPY, REPLAYED, device, "cpu", "replay: group offload")

    # -- calls, steps and component entries ----------------------------------------------------------------------
    def begin_call(self) -> None:
        self.call_depth += 1
        if self.call_depth > 1 or not self.active:
            return
        self.refresh()
        self.check(self.all_scopes(), BETWEEN)
        self.call = CallInfo(index=len(self.trace.calls), start=self.now(), mode=self.mode)
        self.call.replayed = self.replays_model_offload() or self.replays_group_offload()
        self.trace.calls.append(self.call)
        self.phase, self.step, self.bar_depth, self.stack = BEFORE, None, 0, []

    def end_call(self, failed: bool) -> None:
        self.call_depth -= 1
        if self.call_depth > 0 or self.call is None:
            return
        if self.active:
            self.check(self.all_scopes(), BETWEEN)
        self.call.end = self.now()
        self.call.failed = failed
        self.call = None
        self.phase, self.step, self.stack = SETUP, None, []
        self.set_state_step(None)

    def wrap_bar(self, bar, total):
        if not self.active or self.call is None:
            return bar
        return _StepBar(bar, self, total)

    def loop_started(self, total: Optional[int]) -> None:
        self.bar_depth += 1
        if self.bar_depth == 1 and self.call is not None:
            self.phase, self.total = LOOP, total
            self.set_step(0)

    def advance(self, n: int) -> None:
        if self.bar_depth == 1 and self.call is not None and self.step is not None:
            step = self.step + n
            if self.total is not None:
                step = min(step, max(self.total - 1, 0))
            self.set_step(step)

    def set_step(self, step: int) -> None:
        if self.call is None or self.bar_depth != 1:
            return
        self.step = step
        self.call.steps = max(self.call.steps, step + 1)
        self.set_state_step(step)

    def loop_ended(self) -> None:
        self.bar_depth = max(0, self.bar_depth - 1)
        if self.bar_depth == 0 and self.call is not None and self.phase == LOOP:
            if self.step is not None:
                self.call.steps = max(self.call.steps, self.step + 1)
            self.phase, self.step = AFTER, None
            self.set_state_step(None)

    def set_state_step(self, step: Optional[int]) -> None:
        """The ledger's step comes from the runtime's own call tracker; observers never write runtime state."""

    def module_entered(self, module, args) -> None:
        component = self.module_component.get(id(module))
        if component is None or not self.active:
            return
        if component not in self.stack:
            self.entered(component)
        self.stack.append(component)

    def module_left(self, module, args, output) -> None:
        component = self.module_component.get(id(module))
        if component is None:
            return
        for index in range(len(self.stack) - 1, -1, -1):
            if self.stack[index] == component:
                del self.stack[index]
                break

    def entered(self, component: str) -> None:
        if self.depth == 0:
            self.check(self.all_scopes(), BETWEEN)
        if self.call is None:
            return
        self.call.uses.append(
            ComponentUse(component, self.step if self.phase == LOOP else None, self.phase, self.now())
        )
        policy = self.replay_policy
        if policy is not None and component in policy.hooked:
            self.replay(policy.on_use(component, self.replay_resident).moves)
