"""`optimal_bytes`: the offline reference. The exact least host-to-device bytes for a whole known trace under a
budget, with free evictions, by a forward dynamic programme over resident sets."""

from __future__ import annotations

from typing import Iterable, List, Mapping, NamedTuple, Optional

from ..constants import END
from .masks import INF, Universe


class Optimum(NamedTuple):
    """Result of `optimal_bytes`.

    Args:
        total (`int`): Least host-to-device bytes for the whole trace.
        after_call (`List[int]`): Least bytes for the calls up to and including each `END` (the optimum of that
            prefix of the trace on its own). `after_call[0]` is the best first call; the difference of the last two
            entries is the steady-state cost of one more call.
    """

    total: int
    after_call: List[int]


def optimal_bytes(
    trace: Iterable[str],
    sizes: Mapping[str, int],
    budget: Optional[int] = None,
    *,
    stays: Iterable[str] = (),
    keep_between: bool = True,
) -> Optimum:
    """The exact least host-to-device bytes to run `trace` within `budget`, evicting for free at any time.

    Everything starts on the host; the running component must be on the device; components in `stays` are always
    there and count against the budget. A component that does not fit even alone may run alone. With
    `keep_between=False` every call's end empties the device, as stock does.

    Args:
        trace (`Iterable[str]`): Component names in the order they ran; `END` marks the end of each call.
        sizes (`Mapping[str, int]`): Bytes of each component.
        budget (`int`, *optional*): Bytes allowed on the device; `None`: unlimited.
        stays (`Iterable[str]`, defaults to `()`): Components always on the device (not moved, not counted as moves).
        keep_between (`bool`, defaults to `True`): Whether components may stay on the device from one call to the next.

    Returns:
        `Optimum`: `total` and `after_call`.
    """
    trace = list(trace)
    stays = set(stays)
    names = [n for n in dict.fromkeys(trace) if n != END and n not in stays]
    avail = None if budget is None else max(int(budget) - sum(sizes[n] for n in stays), 0)
    u = Universe(names, sizes, avail)
    full = u.full
    reach: List[float] = [INF] * full
    reach[0] = 0
    after_call: List[int] = []
    for event in trace:
        if event == END:
            if not keep_between:
                reach = [min(reach)] + [INF] * (full - 1)
            after_call.append(int(min(reach)))
            continue
        if event in stays:
            continue
        i = u.index[event]
        bit, size = 1 << i, u.sizes[i]
        # Free eviction: a set is reachable at the cost of its cheapest superset.
        down = list(reach)
        for j in range(u.n):
            b = 1 << j
            down = [down[m] if m & b else min(down[m], down[m | b]) for m in range(full)]
        reach = [min(down[m], down[m ^ bit] + size) if m & bit and u.feasible[m] else INF for m in range(full)]
    return Optimum(int(min(reach)), after_call)
