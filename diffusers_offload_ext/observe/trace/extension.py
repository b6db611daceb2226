"""The extension's own moves: the tracer subscribes to its session's observers (the one thing it adds to the
runtime), times each move the session reports and records it as an `"extension"` move."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ...constants import ONLOAD
from .devices import device_name
from .records import EXTENSION
from .timing import Span


class ExtensionMoves:
    """An observer of one session at a time.

    Args:
        placement (`Placement`): Re-read after a move where tensors tell the device.
        recorder (`Recorder`): Where the moves go.
        active (`Callable[[], bool]`): Whether the trace is recording.
    """

    def __init__(self, placement, recorder, active: Callable[[], bool]) -> None:
        self.placement = placement
        self.recorder = recorder
        self.active = active
        self.session = None
        self.blocks: dict = {}  # component -> block -> bytes on the device, for streaming components

    def follow(self, session) -> None:
        """Be told of `session`'s moves (`None`: of no session's), and no longer of another session's."""
        if session is self.session:
            return
        if self.session is not None and self in self.session.observers:
            self.session.observers.remove(self)
        self.session = session
        if session is not None:
            session.observers.append(self)

    def kept_blocks(self, name: str, session) -> Optional[int]:
        """Where component `name` of `session` streams when tracing begins (kept between calls): the bytes of its
        blocks on the device, which its moves from then on add to; `None` when it does not stream."""
        active = session.streams.active
        if name not in active:
            return None
        self.blocks[name] = {block.name: block.nbytes for block in active[name].kept}
        return sum(self.blocks[name].values())

    def __call__(self, name: str, direction: str, module: torch.nn.Module) -> Callable:
        """The session is about to move component `name`; the returned function records the move when it is done."""
        if not self.active() or self.session is None:
            return _ignore
        device = self.session.device
        # The runtime opens the profiler range of every move; the trace adds NVTX and the timing.
        span = Span(f"diffusers_offload_ext::{direction}::{name}", device, profile=False)
        target = device_name(device) or "cpu"
        src, dst = ("cpu", target) if direction == ONLOAD else (target, "cpu")
        readable = device is not None and target != "cpu"  # tensors tell where they are (CUDA, the simulator)

        def finish(record) -> None:
            seconds = span.stop()
            if readable:
                self.placement.remember(name, module)
            block = getattr(record, "block", None)
            if block is not None:  # a streaming component: the bytes of its blocks on the device, from its moves
                held = self.blocks.setdefault(name, {})
                held[block] = record.nbytes if direction == ONLOAD else 0
                self.recorder.resident[name] = sum(held.values())
            else:
                onloaded = self.placement.resident_bytes(name, target) if readable else record.nbytes
                self.recorder.resident[name] = onloaded if direction == ONLOAD else 0
            kind = record.kind
            cause = getattr(record, "cause", None)
            self.recorder.add(
                name, direction, record.nbytes, kind, EXTENSION, src, dst, EXTENSION, seconds, span.clock, block, cause
            )

        return finish


def _ignore(record) -> None:
    pass
