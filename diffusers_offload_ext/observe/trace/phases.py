"""Calls, steps and phases as the tracer sees them: read from the pipeline's own `CallTracker` (the extension's
session) while that one tracks a call, from the tracer's own `CallTracker` otherwise (stock offload, no offload);
and the `CallInfo` of each traced call (start, end, steps counted, components that ran)."""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

from ...calls import AFTER, BEFORE, LOOP, CallTracker, StepBar
from ...marks import host_side
from .records import CallInfo, ComponentUse


class TracedCalls:
    """The traced pipeline's calls.

    Args:
        calls (`List[CallInfo]`): The trace's calls; each outermost call made while recording is appended.
        session (`Callable`): Returns the pipeline's extension session, or `None`.
        now (`Callable[[], float]`): Seconds since the trace began.
    """

    def __init__(self, calls: List[CallInfo], session: Callable, now: Callable[[], float]) -> None:
        self.calls = calls
        self.session = session
        self.now = now
        self.own = CallTracker()
        self.info: Optional[CallInfo] = None
        self.running: List[str] = []
        self.by_session = False

    # -- which tracker says where the call is -------------------------------------------------------------------
    def tracker(self) -> CallTracker:
        """The session's tracker while it tracks a call of this pipeline, else the tracer's own."""
        session = self.session()
        if session is not None and session.calls.in_call:
            self.by_session = self.by_session or self.info is not None
            return session.calls
        return self.own

    def position(self) -> Tuple[str, Optional[int]]:
        """`(phase, step)` now; `step` is `None` outside the denoising loop."""
        tracker = self.tracker()
        if tracker is self.own and self.by_session and self.own.in_call:
            # The session's call has returned, the traced call not yet: the call's end.
            return (AFTER if self.info is not None and self.info.steps else BEFORE), None
        phase = tracker.phase
        return phase, (tracker.step if phase == LOOP else None)

    # -- call boundaries ----------------------------------------------------------------------------------------
    @property
    def outermost(self) -> bool:
        """No traced call is running."""
        return not self.own.in_call

    def begin(self, record: bool, mode: str, replayed: bool) -> None:
        """A call starts; when it is the outermost one and `record`, it gets a `CallInfo`."""
        if not self.own.begin() or not record:
            return
        self.info = CallInfo(index=len(self.calls), start=self.now(), mode=mode, replayed=replayed)
        self.calls.append(self.info)
        self.running, self.by_session = [], False

    def end(self, failed: bool) -> None:
        """A call returns or raises."""
        if not self.own.end(failed) or self.info is None:
            return
        self.info.end = self.now()
        self.info.failed = failed
        keeper = host_side(self.session())  # host bytes by kind, measured at the call's end
        self.info.host = keeper.snapshot() if keeper is not None else None
        self.info, self.running, self.by_session = None, [], False

    # -- the denoising loop -------------------------------------------------------------------------------------
    def wrap_bar(self, bar, total: Optional[int]):
        """The pipeline's progress bar, wrapped so that its steps are counted (and followed by the tracer's own
        tracker when no session tracks the call)."""
        if self.info is None:
            return bar
        session = self.session()
        forward = session is None or not session.calls.in_call
        return StepBar(bar, StepWatch(self, forward), total)

    def count_step(self) -> None:
        phase, step = self.position()
        if self.info is not None and phase == LOOP and step is not None:
            self.info.steps = max(self.info.steps, step + 1)

    # -- components running -------------------------------------------------------------------------------------
    def enter(self, component: str) -> bool:
        """`component` enters a module; returns whether it starts running (it was not running already)."""
        starts = component not in self.running
        self.running.append(component)
        return starts

    def leave(self, component: str) -> None:
        for index in range(len(self.running) - 1, -1, -1):
            if self.running[index] == component:
                del self.running[index]
                break

    def use(self, component: str) -> None:
        """`component` started running in the traced call."""
        if self.info is not None:
            phase, step = self.position()
            self.info.uses.append(ComponentUse(component, step, phase, self.now()))


class StepWatch:
    """What a `StepBar` reports, passed on to the tracer's own tracker when it is the one in use (`forward`), and
    read back from whichever tracker is in use to count the call's steps."""

    def __init__(self, calls: TracedCalls, forward: bool) -> None:
        self.calls = calls
        self.own = calls.own if forward else None

    def loop_started(self, total: Optional[int]) -> None:
        if self.own is not None:
            self.own.loop_started(total)
        self.calls.count_step()

    def advance(self, n: int = 1) -> None:
        if self.own is not None:
            self.own.advance(n)
        self.calls.count_step()

    def set_step(self, step: int) -> None:
        if self.own is not None:
            self.own.set_step(step)
        self.calls.count_step()

    def loop_ended(self) -> None:
        self.calls.count_step()
        if self.own is not None:
            self.own.loop_ended()
