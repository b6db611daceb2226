"""Resident sets as bit masks: each set's bytes, which sets fit, and the exact backward programme that values every
set by the least host-to-device bytes a known future costs from it (with free evictions)."""

from __future__ import annotations

from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from ..constants import END

INF = float("inf")
#: Value-iteration rounds for the steady-state values of a repeated call.
MAX_ROUNDS = 24


class Universe:
    """The offloaded components as bits, each mask's bytes, and which masks fit in `avail` bytes.

    A single component larger than `avail` is still allowed on its own: it is loaded alone (with a warning at run
    time), which is all anyone can do with it.
    """

    def __init__(self, names: Sequence[str], sizes: Mapping[str, int], avail: Optional[int]) -> None:
        self.names = tuple(names)
        self.index = {name: i for i, name in enumerate(self.names)}
        self.sizes = [int(sizes[name]) for name in self.names]
        self.n = len(self.names)
        self.full = 1 << self.n
        mask_bytes = [0] * self.full
        for mask in range(1, self.full):
            low = mask & -mask
            mask_bytes[mask] = mask_bytes[mask ^ low] + self.sizes[low.bit_length() - 1]
        self.mask_bytes = mask_bytes
        self.avail = avail
        self.feasible = [avail is None or mask_bytes[m] <= avail or (m & (m - 1)) == 0 for m in range(self.full)]

    def mask(self, names: Iterable[str]) -> int:
        mask = 0
        for name in names:
            i = self.index.get(name)
            if i is not None:
                mask |= 1 << i
        return mask

    def names_of(self, mask: int) -> List[str]:
        return [name for i, name in enumerate(self.names) if mask >> i & 1]

    def subsets_within(self, pool: int, room: int, alone_may_stay: bool = False) -> List[Tuple[int, int]]:
        """`(mask, bytes)` of the subsets of `pool` that fit in `room` (the empty set always); with `alone_may_stay`,
        also each single component, even one that does not fit (at a call boundary it ran that way)."""
        candidates = []
        sub = pool
        while True:
            nbytes = self.mask_bytes[sub]
            if nbytes <= room or sub == 0 or (alone_may_stay and sub & (sub - 1) == 0):
                candidates.append((sub, nbytes))
            if sub == 0:
                return candidates
            sub = (sub - 1) & pool

    def before_use(self, after: List[float], i: int) -> List[float]:
        """One event of the backward programme: values before a use of component `i`, from the values after it."""
        bit, size, full, feasible = 1 << i, self.sizes[i], self.full, self.feasible
        # best[u]: the least value after the event over the sets that may follow from u (subsets holding `bit`).
        best = [after[m] if m & bit and feasible[m] else INF for m in range(full)]
        for j in range(self.n):
            b = 1 << j
            best = [min(best[m], best[m ^ b]) if m & b else best[m] for m in range(full)]
        return [best[m | bit] if m & bit else best[m | bit] + size for m in range(full)]

    def backward(
        self, events: Sequence[str], terminal: List[float], keep_between: bool, done: Sequence[str] = ()
    ) -> List[List[float]]:
        """`tables[k][mask]`: least future bytes before `events[k]` when `mask` is resident; `tables[-1]` = terminal.
        (`done`, the uses of the call in progress before them, matters to blocks only: `block_tables.py`.)"""
        tables: List[List[float]] = [terminal] * (len(events) + 1)
        values = terminal
        for k in range(len(events) - 1, -1, -1):
            event = events[k]
            if event == END:
                if not keep_between:
                    values = [values[0]] * self.full  # the call's end evicts everything
            else:
                i = self.index.get(event)
                if i is not None:
                    values = self.before_use(values, i)
            tables[k] = values
        return tables

    def steady_values(self, model: Sequence[str], keep_between: bool) -> Tuple[List[float], int]:
        """Relative values at a call boundary when the model call repeats for ever, and their period in calls.

        Relative value iteration: apply one call's backward programme to the values, subtract the minimum, until an
        iterate repeats. The iterates of such a min-plus system become periodic; `period` is 1 when they converge
        and more when the optimal schedule alternates between calls (the values are then a fixed point of
        `period` calls, and forecasts must span that many calls to be optimal on average).
        """
        zero: List[float] = [0] * self.full
        if not keep_between:
            return zero, 1
        events = list(model) + [END]
        values = zero
        seen: Dict[Tuple[float, ...], int] = {}
        for round_index in range(MAX_ROUNDS):
            start = self.backward(events, values, True)[0]
            low = min(start)
            relative = tuple(v - low for v in start)
            if relative in seen:
                return list(relative), round_index - seen[relative]
            seen[relative] = round_index
            values = list(relative)
        return values, 1
