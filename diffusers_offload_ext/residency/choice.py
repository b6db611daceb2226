"""Which resident components to keep when one more must fit: the exact choice over value tables, and the greedy rule
used when there are too many components for exact tables."""

from __future__ import annotations

from typing import Iterable, List, Mapping, Sequence, Set, Tuple

from .masks import Universe


def best_subset(candidates: List[Tuple[int, int]], tables: Sequence[List[float]], bit: int) -> int:
    """The candidate mask (with `bit` loaded) whose predicted future costs least.

    With one value table: the least value, the most bytes kept on ties. With two (two guesses about the rest of a
    first call): the least worst regret over both, then the least total, then the most bytes kept.
    """
    if len(tables) == 1:
        table = tables[0]
        return min(candidates, key=lambda c: (table[c[0] | bit], -c[1]))[0]
    lows = [min(table[c | bit] for c, _ in candidates) for table in tables]

    def score(candidate):
        values = [table[candidate[0] | bit] for table in tables]
        return (max(v - low for v, low in zip(values, lows)), sum(values), -candidate[1])

    return min(candidates, key=score)[0]


def exact_choice(u: Universe, name, others: List[str], room: int, tables: Sequence[List[float]], shadow) -> Set[str]:
    """Which of `others` to keep while `name` loads (`None`: at a call boundary) within `room` bytes, exactly for
    the predicted future, among the choices that keep stock's bound (`StockShadow.allows`) when any does."""
    bit = u.mask([name]) if name is not None else 0
    pool = u.mask(others)
    candidates = u.subsets_within(pool, room, alone_may_stay=name is None)
    if name is not None and shadow.fits:
        allowed = [c for c in candidates if shadow.allows(u, c[0], pool, bit)]
        candidates = allowed or candidates
    return set(u.names_of(best_subset(candidates, tables, bit)))


def greedy_choice(
    upcoming: Iterable[str], others: List[str], sizes: Mapping[str, int], room: int, protected: Set[str]
) -> Set[str]:
    """Evict first what the prediction never uses again, then what it uses last, larger first on ties, what stock
    holds (`protected`) last, until the rest fits in `room`."""
    first = {}
    for position, event in enumerate(upcoming):
        first.setdefault(event, position)
    ranked = sorted(others, key=lambda n: (n in protected, n in first, -first.get(n, 0), -sizes[n]))
    keep = set(others)
    held = sum(sizes[n] for n in others)
    for victim in ranked:
        if held <= room:
            break
        keep.discard(victim)
        held -= sizes[victim]
    return keep
