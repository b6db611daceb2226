"""The call tracker: whether a pipeline call is running, its index and denoising step, the components it has used so
far, and the traces of the last completed calls. The runtime writes it; policies, the replay and observers read it."""

from __future__ import annotations

from typing import List, Optional, Tuple

from .constants import HISTORY

#: Outside any pipeline call (enabling offload, `pipe.to(...)`).
SETUP = "setup"
#: In a call, before the denoising loop (text encoders, VAE encode).
BEFORE = "before-loop"
#: In the denoising loop; `step` says which step.
LOOP = "denoising"
#: In a call, after the denoising loop (VAE decode, end-of-call offload).
AFTER = "after-loop"
PHASES = (SETUP, BEFORE, LOOP, AFTER)


class CallTracker:
    """One pipeline's calls, as the call guard and the progress bar report them.

    Attributes:
        depth (`int`): Pipeline calls in progress (a call may call the pipeline again).
        index (`int` or `None`): Index of the call in progress (0 for the first), `None` outside calls.
        step (`int` or `None`): Denoising step in progress, `None` outside the loop.
        phase (`str`): One of `PHASES`.
        current (`List[str]`): Components used so far in the call in progress (each time one starts running).
        history (`List[Tuple[str, ...]]`): The last `limit` completed calls' traces, oldest first; failed calls and
            calls that used no hooked component are left out.
        version (`int`): Bumped whenever `history` changes.
        callbacks (`bool`): The call in progress may run user code between its components' forwards (a step
            callback was passed: `callback_on_step_end` or `callback`); outside calls, always assumed.
    """

    def __init__(self, limit: int = HISTORY) -> None:
        self.limit = limit
        self.depth = 0
        self.started = 0
        self.index: Optional[int] = None
        self.step: Optional[int] = None
        self.phase = SETUP
        self.current: List[str] = []
        self.history: List[Tuple[str, ...]] = []
        self.version = 0
        self.ended = False
        self.callbacks = True
        self._loops = 0
        self._total: Optional[int] = None

    @property
    def in_call(self) -> bool:
        return self.depth > 0

    def begin(self, callbacks: bool = True) -> bool:
        """A pipeline call starts (`callbacks`: with a step callback); returns whether it is the outermost one."""
        self.depth += 1
        if self.depth > 1:
            return False
        self.index = self.started
        self.started += 1
        self.current = []
        self.ended = False
        self.callbacks = callbacks
        self.step, self.phase, self._loops = None, BEFORE, 0
        return True

    def use(self, name: str) -> None:
        """A component starts running (recorded only inside calls)."""
        if self.depth:
            self.current.append(name)

    def end_trace(self, failed: bool = False) -> None:
        """The call's end-of-call offload runs: its trace joins the history (unless the call failed)."""
        if self.ended or not self.depth:
            return
        self.ended = True
        if not failed and self.current:  # a call that ran no hooked component tells nothing about the next
            self.history.append(tuple(self.current))
            del self.history[: -self.limit]
            self.version += 1
        self.current = []

    def end(self, failed: bool = False) -> bool:
        """A pipeline call returns or raises; returns whether it was the outermost one."""
        if not self.depth:
            return False
        if self.depth == 1:
            self.end_trace(failed)
        self.depth -= 1
        if self.depth:
            return False
        self.index, self.step, self.phase = None, None, SETUP
        return True

    # -- the denoising loop, as the pipeline's progress bar reports it ------------------------------------------------
    def loop_started(self, total: Optional[int]) -> None:
        self._loops += 1
        if self._loops == 1 and self.depth:
            self.phase, self._total, self.step = LOOP, total, 0

    def advance(self, n: int = 1) -> None:
        if self._loops == 1 and self.depth and self.step is not None:
            step = self.step + n
            self.step = step if self._total is None else min(step, max(self._total - 1, 0))

    def set_step(self, step: int) -> None:
        if self._loops == 1 and self.depth:
            self.step = step

    def loop_ended(self) -> None:
        self._loops = max(0, self._loops - 1)
        if self._loops == 0 and self.depth and self.phase == LOOP:
            self.phase, self.step = AFTER, None


class StepBar:
    """Wraps a pipeline's progress bar: tells a `CallTracker` when the denoising loop starts, advances and ends."""

    def __init__(self, bar, calls: CallTracker, total: Optional[int]) -> None:
        self._bar = bar
        self._calls = calls
        self._total = total

    def __enter__(self):
        self._bar.__enter__()
        self._calls.loop_started(self._total)
        return self

    def __exit__(self, *exc_info):
        self._calls.loop_ended()
        return self._bar.__exit__(*exc_info)

    def update(self, n: int = 1):
        result = self._bar.update(n)
        self._calls.advance(n)
        return result

    def __iter__(self):
        self._calls.loop_started(self._total)
        try:
            for index, item in enumerate(self._bar):
                self._calls.set_step(index)
                yield item
        finally:
            self._calls.loop_ended()

    def __len__(self):
        return len(self._bar)

    def __getattr__(self, name):
        return getattr(self._bar, name)
