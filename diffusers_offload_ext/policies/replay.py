"""The one replay: drive a policy over a recorded trace exactly as the runtime drives it over real calls (offload
armed, then per call: call start, each use, the end-of-call offload), and count what moved.

The planner, the benchmarks, the tracer's replays of stock offload on the CPU and the tests all use it, so that a
prediction and the real ledger come from the same code.
"""

from __future__ import annotations

from typing import Callable, Iterable, List, Mapping, NamedTuple, Optional, Set, Tuple

from ..calls import CallTracker
from ..constants import COPY, DROP, END, OFFLOAD, ONLOAD, PREFETCH, STREAM
from .base import Decision, Facts


class ReplayedMove(NamedTuple):
    """One move of a replay, like a ledger record: `call` is `None` for moves made when offload was armed."""

    direction: str
    component: str
    nbytes: int
    kind: str
    call: Optional[int]


class Replay(NamedTuple):
    """Result of `replay_trace`.

    Args:
        moves (`List[ReplayedMove]`): Every move, in order.
        setup (`int`): Bytes that crossed the bus when offload was armed, before the first call.
        per_call (`List[int]`): Bytes that crossed the bus in each call (onloads, and offloads that copied).
        peak (`int`): Most bytes of weights on the device at once.
    """

    moves: List[ReplayedMove]
    setup: int
    per_call: List[int]
    peak: int

    @property
    def copied(self) -> int:
        """Bytes that crossed the bus in all."""
        return sum(m.nbytes for m in self.moves if m.kind == COPY)

    @property
    def onloaded(self) -> int:
        """Host-to-device bytes in all."""
        return sum(m.nbytes for m in self.moves if m.direction == ONLOAD)

    def triples(self) -> List[Tuple[str, str, int]]:
        """`(direction, component, nbytes)` of every move."""
        return [(m.direction, m.component, m.nbytes) for m in self.moves]


def replay_trace(
    policy,
    trace: Iterable[str],
    sizes: Mapping[str, int],
    *,
    zero_copy: bool = False,
    resident: Optional[Iterable[str]] = None,
    check: Optional[Callable[[Optional[str], Set[str], Decision], None]] = None,
    stream_rooms: Optional[Mapping[str, int]] = None,
) -> Replay:
    """Replay `trace` (component names, `END` after each call) through `policy`.

    Args:
        policy (`Policy`): The policy; if it reads a `CallTracker` (`policy.calls`), the replay drives that one.
        trace (`Iterable[str]`): Hooked components in the order they ran; `END` marks the end of each call.
        sizes (`Mapping[str, int]`): Bytes of each component.
        zero_copy (`bool`, defaults to `False`): Evictions only drop the device copy (the weights never change in a
            replay), as the runtime does with zero-copy eviction.
        resident (`Iterable[str]`, *optional*): Components on the device before the trace. When not given, the trace
            starts with offload being armed on an all-on-host pipeline, and that arm's moves are counted.
        stream_rooms (`Mapping[str, int]`, *optional*): The fewest bytes each component can stream its blocks in
            (`Facts.stream_rooms`; the runtime measures them with `blocks.streams.stream_room`). A stream is
            modelled as an onload of the whole component, exact for a component that runs once while it streams (a
            text encoder); a denoiser streamed at every step moves more.
        check (`Callable`, *optional*): Called after every event with the event (`None` for arming, a component name
            or `END`), the resident set after it, and the decision (tests check invariants with it).

    Returns:
        `Replay`: the moves, bytes per call, and the peak.
    """
    calls = policy.calls if policy.calls is not None else CallTracker()
    facts = Facts(sizes, stream_rooms=stream_rooms)
    on_device: Set[str] = set(resident or ())
    moves: List[ReplayedMove] = []
    per_call: List[int] = []
    peak = [sum(sizes[n] for n in on_device)]

    def run(decision, event) -> None:
        for direction, name in decision.moves:
            kind = DROP if direction == OFFLOAD and zero_copy else COPY
            direction = ONLOAD if direction in (PREFETCH, STREAM) else direction  # a stream: modelled as an onload
            moves.append(ReplayedMove(direction, name, sizes[name], kind, calls.index))
            (on_device.add if direction == ONLOAD else on_device.discard)(name)
            if kind == COPY and calls.index is not None:
                per_call[calls.index] += sizes[name]
        peak[0] = max(peak[0], sum(sizes[n] for n in on_device))
        if check is not None:
            check(event, set(on_device), decision)

    if resident is None:
        run(policy.on_enable(on_device, facts), None)
    setup = sum(m.nbytes for m in moves if m.kind == COPY)
    for event in trace:
        if not calls.in_call:
            calls.begin()
            per_call.append(0)
            run(policy.on_call_start(calls), None)
        if event == END:
            calls.end_trace()
            run(policy.on_call_end(on_device, facts), END)
            calls.end()
        else:
            calls.use(event)
            run(policy.on_use(event, on_device, facts), event)
    return Replay(moves, setup, per_call, peak[0])


def replay(policy, trace: Iterable[str], sizes: Mapping[str, int], resident=None) -> List[Tuple[str, str, int]]:
    """The moves `policy` makes on `trace`: `(direction, component, nbytes)` in order (see `replay_trace`)."""
    return replay_trace(policy, trace, sizes, resident=resident).triples()
