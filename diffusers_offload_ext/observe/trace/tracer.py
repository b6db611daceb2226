"""`Tracer`: one recording session of a `Trace` on one pipeline. It starts and stops the wiring (the traced class,
the wrapped hooks, torch's global forward hooks, its subscription to the extension's moves) and turns what the
wiring reports into records. It reads the runtime's state and never writes it."""

from __future__ import annotations

import time
from typing import Any, Callable, List, Optional

import torch

from ...constants import ONLOAD
from ...marks import get_session
from ...transfer.book import module_nbytes
from .extension import ExtensionMoves
from .hooks import TRACER_ATTR, Wrappers, traced_class
from .phases import TracedCalls
from .pipeline import EXTENSION_MODE, PipelineView, read_pipeline
from .placement import Placement, classify
from .recorder import Recorder
from .records import BETWEEN, OBSERVED
from .stock import StockReplay
from .timing import Clock, nvtx_range


class Tracer:
    """Records into `trace` what happens to `pipe`'s component weights between `start()` and `stop()`."""

    def __init__(self, trace, pipe, t0: float) -> None:
        self.trace = trace
        self.pipe = pipe
        self.t0 = t0
        self.active = False
        self.original_class: Optional[type] = None
        self.handles: List[Any] = []
        self.inside = 0
        self.view: Optional[PipelineView] = None
        self.clock = Clock(None)
        self.calls = TracedCalls(trace.calls, self.session, self.now)
        self.recorder = Recorder(trace.records, self.calls, self.now)
        self.placement = Placement()
        self.stock = StockReplay(trace.components, self.recorder.resident, self.recorder.add)
        self.wrappers = Wrappers(self.bracket, self.group_event)
        self.extension = ExtensionMoves(self.placement, self.recorder, lambda: self.active)

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def session(self):
        """The pipeline's extension session, or `None`."""
        return get_session(self.pipe)

    def scopes(self):
        """Every tensor of every component."""
        return [(name, module, "") for name, module in self.view.modules.items()]

    # -- start and stop ------------------------------------------------------------------------------------------
    def start(self) -> None:
        pipe = self.pipe
        if getattr(type(pipe), TRACER_ATTR, None) is not None:
            raise RuntimeError("This pipeline is already being traced.")
        self.original_class = type(pipe)
        object.__setattr__(pipe, "__class__", traced_class(self.original_class, self))
        self.refresh(initial=True)
        registration = torch.nn.modules.module
        self.handles.append(registration.register_module_forward_pre_hook(self.module_entered))
        self.handles.append(registration.register_module_forward_hook(self.module_left, always_call=True))
        self.active = True

    def stop(self) -> None:
        self.active = False
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.wrappers.restore()
        self.extension.follow(None)
        if type(self.pipe).__dict__.get(TRACER_ATTR) is self:
            object.__setattr__(self.pipe, "__class__", self.original_class)
        self.recorder.settle()

    # -- what the pipeline has now ------------------------------------------------------------------------------
    def refresh(self, initial: bool = False) -> None:
        """Re-read components, devices, hooks and the offload mode (at start, each call, after offload methods)."""
        session, trace, resident = self.session(), self.trace, self.recorder.resident
        self.placement.forget_structure()
        view = self.view = read_pipeline(self.pipe, session)
        for name, module in view.modules.items():
            if name not in trace.components:
                trace.components[name] = module_nbytes(module)
        if view.device_name is not None and trace.device is None:
            trace.device = view.device_name
        self.clock = Clock(view.device)
        self.extension.follow(session)
        self.wrappers.wrap_all(view.modules, self.scopes())
        for name, module in view.modules.items():
            self.placement.remember(name, module, replace=initial)
            if not initial:
                resident.setdefault(name, 0)
        if initial:
            self.recorder.start_over({name: self.initial_resident(name, session) for name in view.modules})
            for name, nbytes in resident.items():
                trace.initial_resident.setdefault(name, nbytes)
        self.stock.follow(view, initial)
        if initial:
            trace.initial_resident.update({name: resident[name] for name in self.stock.on_device})
        note = view.note()
        if note is not None:
            trace.add_note(note)

    def initial_resident(self, name: str, session) -> int:
        view = self.view
        if view.mode == EXTENSION_MODE:
            if name not in session.resident:
                return 0
            kept = self.extension.kept_blocks(name, session)  # streaming, kept between calls: its kept blocks
            return self.trace.components.get(name, 0) if kept is None else kept
        if view.replays_model_offload or view.replays_group_offload:
            return 0
        return self.placement.resident_bytes(name, view.device_name)

    # -- observed moves ----------------------------------------------------------------------------------------
    def look(self, scopes, where: str, seconds: Optional[Callable[[], float]] = None) -> int:
        """Look at the tensors in `scopes`; record each change of device as an observed move. `seconds` is the
        duration of the hook method `where`, shared by bytes among the moves it made."""
        moved = self.placement.look(scopes)
        total = sum(moved.values())
        resident, view = self.recorder.resident, self.view
        for (component, src, dst), nbytes in moved.items():
            direction, kind = classify(src, dst, view.device_name)
            if view.counts_moves:
                change = nbytes if direction == ONLOAD else -nbytes
                resident[component] = max(0, resident.get(component, 0) + change)
            else:
                resident[component] = self.placement.resident_bytes(component, view.device_name)
            share = seconds
            if seconds is not None and len(moved) > 1:
                share = lambda f=(nbytes / total if total else 1.0): seconds() * f  # noqa: E731
            label = f"diffusers_offload_ext::{direction}::{component}"
            with torch.profiler.record_function(f"{label} (observed in {where})"):
                pass
            self.recorder.add(component, direction, nbytes, kind, OBSERVED, src, dst, where, share, self.clock)
        return len(moved)

    def bracket(self, run: Callable[[], Any], scopes, where: str) -> Any:
        """Run a hook or pipeline method between two looks at `scopes`, timed."""
        if not self.active or self.inside:
            return run()
        self.inside += 1
        seconds = None
        try:
            self.look(scopes, BETWEEN)
            token = self.clock.start()
            label = f"diffusers_offload_ext::hook::{where}"
            with torch.profiler.record_function(label), nvtx_range(label, self.view.device):
                result = run()
            seconds = self.clock.stop(token)
            return result
        finally:
            self.look(scopes, where, seconds)
            self.inside -= 1

    def bracket_pipeline(self, name: str, run: Callable[[], Any]) -> Any:
        if not self.active:
            return run()
        result = self.bracket(run, self.scopes(), f"{type(self.pipe).__name__}.{name}")
        self.refresh()
        if name == "enable_model_cpu_offload":
            self.stock.enabled()
        return result

    def group_event(self, hook, module, component: str, method: str) -> None:
        if self.active and self.view.replays_group_offload:
            self.stock.group_event(hook, module, component, method)

    # -- calls, steps and components running ---------------------------------------------------------------------
    def begin_call(self) -> None:
        if self.calls.outermost and self.active:
            self.refresh()
            self.look(self.scopes(), BETWEEN)
        view = self.view
        self.calls.begin(self.active, view.mode, view.replays_model_offload or view.replays_group_offload)

    def end_call(self, failed: bool) -> None:
        if self.active and self.calls.info is not None and self.calls.own.depth == 1:
            self.look(self.scopes(), BETWEEN)
        self.calls.end(failed)

    def wrap_bar(self, bar, total: Optional[int]):
        return self.calls.wrap_bar(bar, total) if self.active else bar

    def module_entered(self, module, args) -> None:
        component = self.view.owner.get(id(module)) if self.active else None
        if component is not None and self.calls.enter(component):
            if self.inside == 0:
                self.look(self.scopes(), BETWEEN)
            if self.calls.info is not None:
                self.calls.use(component)
                self.stock.used(component)

    def module_left(self, module, args, output) -> None:
        component = self.view.owner.get(id(module))
        if component is not None:
            self.calls.leave(component)
            if self.active and self.calls.info is not None and component not in self.calls.running:
                self.blocks_of(component)

    def blocks_of(self, component: str) -> None:
        """`component` ran: where it keeps only some of its blocks, which, which streamed and why, for the call."""
        session = self.session()
        streams = session.streams if session is not None else None
        if streams is None or component not in streams.active:
            return
        streamer, why = streams.active[component], streams.why
        if streamer.streamed:
            kept = [block.name for block in streamer.kept]
            reason = why[component] if component in why else ""
            self.calls.info.blocks[component] = {"kept": kept, "streamed": list(streamer.order), "why": reason}
