"""The step axis of a timeline: each call gets a slot before its loop, one per denoising step and one after it;
moves outside calls get a slot before the call that follows them (or at the end); the events of one slot (moves and
component runs together) share it in the order they happened, each in a part of its own."""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Sequence, Tuple

from ...calls import BEFORE, LOOP

#: `(call, part, step)`: part 0 is before the call (setup), 1 before its loop, 2 a step, 3 after its loop.
Slot = Tuple[int, int, int]


class StepAxis(NamedTuple):
    """x positions of every record and every component use (the middle of its part of the slot), the width of a
    use's part, where each call's loop starts, each call's span, and the end of the axis."""

    record_x: List[float]
    use_x: List[float]
    loop_start: Dict[int, float]
    call_span: Dict[int, Tuple[float, float]]
    end: float
    use_width: Tuple[float, ...]


def slot_of(starts: Sequence[float], call, phase: str, step, t: float) -> Slot:
    if call is None:
        following = next((i for i, s in enumerate(starts) if s >= t), len(starts))
        return (following, 0, 0)
    if phase == BEFORE:
        return (call, 1, 0)
    if phase == LOOP:
        return (call, 2, step or 0)
    return (call, 3, 0)


def step_axis(trace) -> StepAxis:
    """Where each record and use of `trace` goes on the step axis."""
    starts = [c.start for c in trace.calls]
    record_slots = [slot_of(starts, r.call, r.phase, r.step, r.t) for r in trace.records]
    uses = [(c.index, u) for c in trace.calls for u in c.uses]
    use_slots = [slot_of(starts, index, u.phase, u.step, u.t) for index, u in uses]
    origin, call_span, end = _origins(trace, record_slots)
    times = [r.t for r in trace.records] + [u.t for _, u in uses]
    xs, widths = _spread(record_slots + use_slots, times, origin)
    count = len(record_slots)
    loop_start = {i: origin[(i, 2, 0)] for i in range(len(trace.calls)) if (i, 2, 0) in origin}
    return StepAxis(xs[:count], xs[count:], loop_start, call_span, end, tuple(widths[count:]))


def _origins(trace, record_slots: List[Slot]) -> Tuple[Dict[Slot, float], Dict[int, Tuple[float, float]], float]:
    """Where each slot starts, each call's span, and the end of the axis."""
    setup_before = {s[0] for s in record_slots if s[1] == 0}
    origin: Dict[Slot, float] = {}
    call_span: Dict[int, Tuple[float, float]] = {}
    x = 0.0
    for index, call in enumerate(trace.calls):
        if index in setup_before:
            origin[(index, 0, 0)] = x
            x += 1
        begin = x
        origin[(index, 1, 0)] = x
        x += 1
        steps = max(call.steps, 1 + max([s[2] for s in record_slots if s[0] == index and s[1] == 2] or [-1]))
        for step in range(steps):
            origin[(index, 2, step)] = x
            x += 1
        origin[(index, 3, 0)] = x
        x += 1
        call_span[index] = (begin, x)
        x += 0.6
    if len(trace.calls) in setup_before:
        origin[(len(trace.calls), 0, 0)] = x
        x += 1
    return origin, call_span, x


def _spread(slots: List[Slot], times: Sequence[float], origin: Dict[Slot, float]) -> Tuple[List[float], List[float]]:
    """x (the middle of its part) and width of the part of each event: the events sharing a slot split it evenly, in
    the order of their times (ties in the order given)."""
    members: Dict[Slot, List[int]] = {}
    for index in sorted(range(len(slots)), key=lambda i: times[i]):
        members.setdefault(slots[index], []).append(index)
    xs, widths = [0.0] * len(slots), [1.0] * len(slots)
    for slot, indices in members.items():
        width = 1.0 / len(indices)
        for rank, index in enumerate(indices):
            xs[index] = origin.get(slot, 0.0) + (rank + 0.5) * width
            widths[index] = width
    return xs, widths
