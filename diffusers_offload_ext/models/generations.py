"""What a strategy moves over many generations: its policy replayed (`policies.replay_trace`, the one replay; with
streams booked block by block, `block_model.replay_streaming`) over the first generations, the bytes split by
direction and by generation, and the rest extrapolated from the period the replayed generations settle into."""

from __future__ import annotations

import dataclasses
from typing import Dict, FrozenSet, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from ..constants import COPY, END, ONLOAD, STREAM
from ..policies import replay_trace
from .block_model import replay_streaming
from .bounds import REPLAYED_GENERATIONS

#: Longest period (in generations) looked for in the replayed generations.
MAX_PERIOD = 3


@dataclasses.dataclass(frozen=True)
class Moved:
    """Bytes host-to-device, bytes device-to-host and onloads, of the setup or of some generations."""

    h2d: int = 0
    d2h: int = 0
    onloads: int = 0

    def __add__(self, other: "Moved") -> "Moved":
        return Moved(self.h2d + other.h2d, self.d2h + other.d2h, self.onloads + other.onloads)

    def times(self, numerator: int, denominator: int = 1) -> "Moved":
        """`self * numerator / denominator`, in whole numbers (bytes can exceed what a float holds exactly)."""
        return Moved(*(value * numerator // denominator for value in (self.h2d, self.d2h, self.onloads)))

    @property
    def nbytes(self) -> int:
        return self.h2d + self.d2h


def total(moved: Iterable[Moved]) -> Moved:
    result = Moved()
    for item in moved:
        result = result + item
    return result


class Generations(NamedTuple):
    """A strategy over `generations` generations.

    Args:
        setup (`Moved`): When offload is enabled, before the first generation.
        first (`Moved`): The first generation (setup excluded).
        total (`Moved`): All generations (setup excluded).
        peak (`int`): Most bytes of weights on the device at once.
        generations (`int`): Generations covered.
        replayed (`int`): Generations replayed move by move; the others are extrapolated.
        period (`int` or `None`): The period the replayed generations settled into (`None`: all replayed, or no
            period found and the mean of the last replayed generations extrapolated).
        calls (`Tuple[Moved, ...]`): Each replayed generation.
        passes (`Tuple[Dict[str, Tuple[int, int]], ...]`): Per replayed generation, `{component: (passes, bytes)}`
            of the components that streamed their blocks (their passes are in `h2d`, not in `onloads`).
        loaded (`Tuple[FrozenSet[str], ...]`): Per replayed generation, the components onloaded in it: whole, or
            a stream's kept blocks as it started (a stream that stayed from the generation before is not).
    """

    setup: Moved
    first: Moved
    total: Moved
    peak: int
    generations: int
    replayed: int
    period: Optional[int]
    calls: Tuple[Moved, ...] = ()
    passes: Tuple[Dict[str, Tuple[int, int]], ...] = ()
    loaded: Tuple[FrozenSet[str], ...] = ()

    @property
    def extrapolated(self) -> bool:
        return self.replayed < self.generations


def replay_generations(
    policy, call: Sequence[str], sizes: Mapping[str, int], generations: int, *, zero_copy: bool, plans=None
) -> Generations:
    """Replay `policy` over `generations` calls of `call` from an all-on-host pipeline (at most
    `REPLAYED_GENERATIONS` of them move by move); with `plans` (`block_model.BlockPlans`), components that stream
    are booked block by block."""
    replayed = min(generations, REPLAYED_GENERATIONS)
    trace = (list(call) + [END]) * replayed
    if plans is None:
        result = replay_trace(policy, trace, sizes, zero_copy=zero_copy)
        moves, peak = result.moves, result.peak
    else:
        moves, peak = replay_streaming(policy, trace, sizes, plans, zero_copy=zero_copy)
    setup, per_call, states, passes, loaded = _split(moves, replayed)
    period = None
    rest = Moved()
    if generations > replayed:
        period = find_period(list(zip(per_call, states)))
        rest = extrapolate(per_call, period, generations - replayed)
    total_moved = total(per_call) + rest
    return Generations(
        setup, per_call[0], total_moved, peak, generations, replayed, period, tuple(per_call), tuple(passes), loaded
    )


def _split(moves, calls: int):
    """Setup, each call's `Moved`, the resident set at each call's end, each call's block passes, and the components
    each call onloaded (whole, or a stream's kept blocks)."""
    setup, per_call = Moved(), [Moved() for _ in range(calls)]
    states: List[Optional[FrozenSet[str]]] = [None] * calls
    passes: List[Dict[str, Tuple[int, int]]] = [{} for _ in range(calls)]
    loaded: List[set] = [set() for _ in range(calls)]
    resident = set()
    for move in moves:
        if move.kind == STREAM:
            count, nbytes = passes[move.call].get(move.component, (0, 0))
            passes[move.call][move.component] = (count + 1, nbytes + move.nbytes)
        copied = move.nbytes if move.kind in (COPY, STREAM) else 0
        onload = move.direction == ONLOAD
        moved = Moved(copied if onload else 0, 0 if onload else copied, int(onload and move.kind != STREAM))
        (resident.add if onload else resident.discard)(move.component)
        if move.call is None:
            setup = setup + moved
        else:
            per_call[move.call] = per_call[move.call] + moved
            if onload and move.kind != STREAM:
                loaded[move.call].add(move.component)
            states[move.call] = frozenset(resident)
    for index in range(calls):  # a call without moves ends as the one before it
        if states[index] is None:
            states[index] = states[index - 1] if index else frozenset()
    return setup, per_call, tuple(states), passes, tuple(frozenset(names) for names in loaded)


def find_period(calls: Sequence) -> Optional[int]:
    """The shortest period (at most `MAX_PERIOD`) that the last three periods' worth of `calls` repeat with."""
    for period in range(1, MAX_PERIOD + 1):
        tail = calls[-3 * period :]
        if len(tail) == 3 * period and all(tail[i] == tail[i + period] for i in range(2 * period)):
            return period
    return None


def extrapolate(per_call: Sequence[Moved], period: Optional[int], remaining: int) -> Moved:
    """What `remaining` more generations move: the last `period` generations repeated in order, or without a
    period the mean of the last four."""
    if period is None:
        window = per_call[-4:]
        return total(window).times(remaining, len(window))
    cycle = per_call[-period:]
    return total(cycle).times(remaining // period) + total(cycle[: remaining % period])
