"""The exact block choice for a few blocks: every set of blocks on the device valued by the least bytes the predicted
future copies from it (a backward dynamic programme over bit masks, as `masks.py` does for components), so that each
use keeps exactly the blocks that future wants. Used up to `MAX_BLOCKS` blocks in all (tiny pipelines); above, the
roll-out rule of `belady.py`.

The model (`block_sets.py`): a use of component `C` copies its newly kept blocks and the blocks it runs that are not
kept; while it runs, the kept blocks of every component, and `C`'s ring when some of its blocks stream, fit `C`'s
room; streaming needs `C`'s rest kept. Eviction is free at any moment; a component that cannot run in its room even
alone runs alone, whole.
"""

from __future__ import annotations

from typing import Dict, FrozenSet, List, Mapping, Sequence, Tuple

import numpy as np

from ..constants import END
from .block_sets import MAX_BLOCKS, Spec, at_use, least_footprint, use_indices

#: Value-iteration rounds for the steady values of a repeated call.
MAX_ROUNDS = 24
INF = float("inf")


class BlockUniverse:
    """The blocks of `specs` as bits, and the tables over their sets.

    Args:
        specs (`Mapping[str, Spec]`): The components (in a fixed order) and their blocks.
        rooms (`Mapping[str, int]`): The room while each component runs (the budget, or its lower limit).
        avail (`int`): The budget for offloaded components (for the cache key of the forecasts).
    """

    def __init__(self, specs: Mapping[str, Spec], rooms: Mapping[str, int], avail: int, runs=None) -> None:
        self.names = tuple(specs)
        #: The blocks each use of a component runs, where known (`Facts.runs`: name -> use index -> blocks).
        self.runs = {n: dict(runs[n]) for n in self.names if runs and n in runs}
        self.specs = dict(specs)
        self.bits: List[Tuple[str, str]] = [(n, item.key) for n in self.names for item in specs[n].items]
        self.n = len(self.bits)
        if self.n > MAX_BLOCKS:
            raise ValueError(f"{self.n} blocks: at most {MAX_BLOCKS} are valued exactly")
        self.index = {name: i for i, name in enumerate(self.names)}
        self.avail = avail
        #: What the tables depend on besides the events (`Forecaster`'s cache key).
        self.sizes = self.signature(specs, rooms, self.runs)
        self.full = 1 << self.n
        m = np.arange(self.full, dtype=np.int64)
        self.masks = m
        self.nb = np.zeros(self.full)
        position = 0
        self.cmask, self.feasible, self._used = {}, {}, {}
        for name in self.names:
            first = position
            for item in specs[name].items:
                self.nb += ((m >> position) & 1) * item.nbytes
                position += 1
            self.cmask[name] = ((1 << position) - 1) ^ ((1 << first) - 1)
        for name in self.names:
            self.feasible[name] = self._feasible(name, int(rooms[name]))

    @staticmethod
    def signature(specs: Mapping[str, Spec], rooms: Mapping[str, int], runs=None) -> tuple:
        """What the tables of `specs` within `rooms` (each use running `runs`) depend on besides the events."""
        known = {n: tuple(sorted((i, tuple(sorted(b))) for i, b in runs[n].items())) for n in runs or {} if n in specs}
        return tuple(
            (n, spec.items, spec.forced, spec.streams, int(rooms[n]), known.get(n)) for n, spec in specs.items()
        )

    def _feasible(self, name: str, room: int) -> np.ndarray:
        """Sets `name` may run with: they and its ring fit `room`, and it is whole or keeps its rest."""
        spec, m, cmask = self.specs[name], self.masks, self.cmask[name]
        first = self.bits.index((name, spec.items[0].key))
        streamed = cmask & ~m
        count, largest, forced = np.zeros(self.full), np.zeros(self.full), 0
        for offset, item in enumerate(spec.items):
            on = (streamed >> (first + offset)) & 1
            count += on
            largest = np.maximum(largest, on * item.ring_slot)
            if item.key in spec.forced:
                forced |= 1 << (first + offset)
        fits = self.nb + np.minimum(count, 3) * largest <= room
        runs = (streamed == 0) | (spec.streams & ((m & forced) == forced))
        feasible = fits & runs
        if least_footprint(spec) > room:
            feasible = feasible | (m == cmask)  # it runs alone, whole
        return feasible

    # -- the programme -----------------------------------------------------------------------------------------------
    def _superset_min(self, values: np.ndarray, name: str) -> np.ndarray:
        cube = values.copy().reshape((2,) * self.n)
        for bit in self._bits_of(name):
            low, high = self._halves(bit)
            np.minimum(cube[low], cube[high], out=cube[low])
        return cube.reshape(self.full)

    def _subset_min(self, values: np.ndarray) -> np.ndarray:
        cube = values.copy().reshape((2,) * self.n)
        for bit in range(self.n):
            low, high = self._halves(bit)
            np.minimum(cube[high], cube[low], out=cube[high])
        return cube.reshape(self.full)

    def _halves(self, bit: int):
        low, high = [slice(None)] * self.n, [slice(None)] * self.n
        low[self.n - 1 - bit], high[self.n - 1 - bit] = slice(0, 1), slice(1, 2)  # views, even of one bit
        return tuple(low), tuple(high)

    def _bits_of(self, name: str) -> List[int]:
        return [i for i, (owner, _) in enumerate(self.bits) if owner == name]

    def used(self, name: str, index: int) -> Tuple[np.ndarray, float]:
        """`(bytes of the blocks it runs in each set, bytes of all it runs)` for use `index` of `name` in its call."""
        spec = at_use(self.specs[name], self.runs.get(name, {}).get(index))
        key = (name, tuple(item.uses for item in spec.items))
        if key not in self._used:
            first, used = self.bits.index((name, spec.items[0].key)), np.zeros(self.full)
            for offset, item in enumerate(spec.items):
                used += ((self.masks >> (first + offset)) & 1) * (item.nbytes if item.uses else 0)
            self._used[key] = used, float(sum(item.nbytes for item in spec.items if item.uses))
        return self._used[key]

    def before_use(self, after: np.ndarray, name: str, index: int = 0) -> np.ndarray:
        """Values before use `index` of `name` in its call, from the values after it: the least over the sets it may
        run with (any other blocks evicted first, any of its own kept or newly kept) of the bytes the use copies plus
        their value."""
        cmask, (used, total) = self.cmask[name], self.used(name, index)
        masked = np.where(self.feasible[name], after, INF)
        unused = self.nb[self.masks & cmask] - used[self.masks & cmask]  # newly kept blocks it does not run
        # Copied: its newly kept blocks and the streamed blocks it runs; its blocks kept before are not.
        best = self._superset_min(masked + unused, name) - self.nb[self.masks & cmask]
        return total + self._subset_min(best)

    def backward(
        self, events: Sequence[str], terminal: np.ndarray, keep_between: bool, done: Sequence[str] = ()
    ) -> List[np.ndarray]:
        """`tables[k][mask]`: least future bytes before `events[k]` with `mask` kept; `tables[-1]` = terminal. `done`:
        the uses of the call in progress before `events[0]` (which use of its component each event is)."""
        tables: List[np.ndarray] = [terminal] * (len(events) + 1)
        values, indices = terminal, use_indices(events, done)
        for k in range(len(events) - 1, -1, -1):
            event = events[k]
            if event == END:
                if not keep_between:
                    values = np.full(self.full, values[0])
            elif event in self.cmask:
                values = self.before_use(values, event, indices[k])
            tables[k] = values
        return tables

    def steady_values(self, model: Sequence[str], keep_between: bool) -> Tuple[np.ndarray, int]:
        """Relative values at a call boundary when the model call repeats for ever, and their period in calls (as
        `masks.Universe.steady_values`)."""
        values = np.zeros(self.full)
        if not keep_between:
            return values, 1
        events = list(model) + [END]
        seen: Dict[bytes, int] = {}
        for round_index in range(MAX_ROUNDS):
            start = self.backward(events, values, True)[0]
            relative = start - start.min()
            key = relative.tobytes()
            if key in seen:
                return relative, round_index - seen[key]
            seen[key] = round_index
            values = relative
        return values, 1

    # -- a decision --------------------------------------------------------------------------------------------------
    def mask(self, kept: Mapping[str, FrozenSet[str]]) -> int:
        found = 0
        for i, (name, key) in enumerate(self.bits):
            if key in kept.get(name, ()):
                found |= 1 << i
        return found

    def kept_of(self, mask: int) -> Dict[str, FrozenSet[str]]:
        found: Dict[str, set] = {}
        for i, (name, key) in enumerate(self.bits):
            if mask >> i & 1:
                found.setdefault(name, set()).add(key)
        return {name: frozenset(keys) for name, keys in found.items()}

    def choose(self, name: str, kept: Mapping[str, FrozenSet[str]], after: np.ndarray, index: int = 0):
        """What every component keeps while `name` runs (use `index` of it in its call), from `kept`, for the least
        bytes now plus `after` (the values after this use); ties keep the most bytes."""
        state, cmask, m = self.mask(kept), self.cmask[name], self.masks
        used, total = self.used(name, index)
        allowed = ((m & ~cmask & ~state) == 0) & self.feasible[name]
        cost = self.nb[m & cmask & ~state] + total - used[m & cmask] + after
        cost = np.where(allowed, cost, INF)
        low = cost.min()
        ties = np.nonzero(cost <= low)[0]
        return self.kept_of(int(ties[np.argmax(self.nb[ties])]))
