"""The planner's block optimum: the least bytes any schedule moves over a whole known trace when each component keeps,
at every moment, its rest and its blocks largest first (the kept set is a prefix of that order), found exactly by a
forward dynamic programme over those kept sets (numpy). At real sizes, where a component's repeated blocks are equal,
a larger block kept first is what a choice of that many bytes keeps anyway, so this is the optimum over every block
schedule up to the rounding of a block; the residency manager, which may keep any set, can beat it by a little.

The model is the residency manager's (`residency/block_sets.py`): a use of a component copies the blocks it runs that
are not kept; while it runs, every kept block and its ring (`DEPTH + 1` buffers as large as its largest streamed
block, fewer when fewer stream) fit its room, and streaming needs its rest kept; eviction is free at any moment; a
component that cannot stream (no repeated blocks) runs whole, kept; one that cannot run within the budget even alone
runs whole and alone, over it, as the runtime loads it (with a warning).
"""

from __future__ import annotations

from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence

import numpy as np

from ..blocks.choice import DEPTH, Item
from ..constants import END

#: Most kept-set combinations the programme walks (the product of each component's number of prefixes).
MAX_STATES = 3_000_000
INF = np.iinfo(np.int64).max // 4


class Levels(NamedTuple):
    """One component's prefixes: bytes kept and ring bytes while it runs with each, and whether it can run so."""

    kept: np.ndarray
    ring: np.ndarray
    runs: np.ndarray


def levels(items: Optional[Sequence[Item]], size: int) -> Levels:
    """The prefixes of a component's blocks (`None`: it cannot stream, one block of `size` bytes): its rest, then its
    blocks by ring slot, largest first."""
    if not items or len(items) < 2:
        return Levels(np.array([0, int(size)]), np.array([0, 0]), np.array([False, True]))  # it runs whole
    rest = [item for item in items if item.key == "<rest>"]
    ordered = rest + sorted((item for item in items if item.key != "<rest>"), key=lambda item: -item.ring_slot)
    kept, ring, runs = [0], [], []
    for item in ordered:
        kept.append(kept[-1] + item.nbytes)
    for count in range(len(ordered) + 1):
        streamed = ordered[count:]
        slots = min(DEPTH + 1, len(streamed))
        ring.append(slots * max((item.ring_slot for item in streamed), default=0))
        runs.append(not streamed or count >= len(rest))  # streaming keeps the rest
    return Levels(np.array(kept), np.array(ring), np.array(runs))


class Optimum(NamedTuple):
    """`after_call[k]`: the least bytes of the trace's calls up to and including the `k`-th; the difference of the
    last two is the steady cost of one more call."""

    after_call: List[int]

    @property
    def steady(self) -> Optional[int]:
        return self.after_call[-1] - self.after_call[-2] if len(self.after_call) > 1 else None


def block_optimum(
    trace: Sequence[str],
    blocks: Mapping[str, Sequence[Item]],
    sizes: Mapping[str, int],
    budget: int,
    *,
    keep_between: bool = True,
) -> Optional[Optimum]:
    """The block optimum of `trace` (component names, `END` after each call) within `budget` bytes for the offloaded
    components; `None` when the kept-set combinations exceed `MAX_STATES` or some use cannot run in the budget."""
    names = [n for n in dict.fromkeys(trace) if n != END]
    table: Dict[str, Levels] = {n: levels(blocks.get(n), sizes[n]) for n in names}
    shape = tuple(len(table[n].kept) for n in names)
    if int(np.prod(shape, dtype=np.float64)) > MAX_STATES:
        return None
    axis = {n: i for i, n in enumerate(names)}

    def along(name: str, values: np.ndarray) -> np.ndarray:
        return values.reshape([len(values) if i == axis[name] else 1 for i in range(len(names))])

    held = sum(along(n, table[n].kept) for n in names)
    feasible = {n: (held + along(n, table[n].ring) <= budget) & along(n, table[n].runs) for n in names}
    for n in names:
        if not feasible[n].any():  # it cannot run in the budget even alone: as the runtime, whole and alone, over it
            top = np.arange(len(table[n].kept)) == len(table[n].kept) - 1
            feasible[n] = (held == along(n, table[n].kept)) & along(n, top)
    reach = np.full(shape, INF, dtype=np.int64)
    reach[(0,) * len(names)] = 0
    after: List[int] = []
    dirty = set(range(len(names)))  # axes along which `reach` may not yet be the least over larger prefixes
    for event in trace:
        if event == END:
            if not keep_between:
                low, reach = reach.min(), np.full(shape, INF, dtype=np.int64)
                reach[(0,) * len(names)] = low
                dirty = set(range(len(names)))
            after.append(int(reach.min()))
            continue
        down = reach
        for i in sorted(dirty):  # free eviction: any smaller prefix of any component
            down = np.flip(np.minimum.accumulate(np.flip(down, i), axis=i), i)
        # After a use, the values grow with every other component's prefix where feasible (and feasibility shrinks
        # with it): only the used component's axis needs the free eviction at the next use.
        dirty = {axis[event]}
        kept = table[event].kept
        gain = np.minimum.accumulate(down - along(event, kept), axis=axis[event])  # kept before, up to this prefix
        reach = np.where(feasible[event] & (gain < INF // 2), gain + int(kept[-1]), INF)
        if reach.min() >= INF:
            return None
    return Optimum(after)


#: Calls the programme walks for a plan's row: enough for the schedule to repeat (with a period of one or two calls).
CALLS = 4
LABEL = "block optimum (exact schedule)"


def optimum_row(plans, hooked: Sequence[str], call: Sequence[str], sizes: Mapping[str, int], room: int, rate: int):
    """A plan's `block_optimum` row (`models.block_compare`): the block optimum's first and steady generation (the
    mean of the last two, the schedule may alternate), priced at `rate` (nothing hidden behind compute); `None` when
    it cannot be computed (too many kept sets)."""
    found = block_optimum((list(call) + [END]) * CALLS, plans.facts(hooked), sizes, room)
    if found is None:
        return None
    first, steady = found.after_call[0], (found.after_call[-1] - found.after_call[-3]) / 2
    return {
        "label": LABEL,
        "first_generation_bytes": first,
        "steady_generation_bytes": steady,
        "seconds_first": first / rate,
        "seconds_steady": steady / rate,
        "fits": True,
    }


def add_optimum(rows: dict, plans, hooked, call, sizes, room: int, rate: int) -> None:
    """Add the block optimum's row to a plan's `rows`, and the budget row's ratio to it (`to_block_optimum`)."""
    row = optimum_row(plans, hooked, call, sizes, room, rate)
    if row is None:
        return
    rows["block_optimum"] = row
    steady = rows["budget"]["steady_generation_bytes"]
    if steady is not None and row["steady_generation_bytes"]:
        rows["budget"]["to_block_optimum"] = steady / row["steady_generation_bytes"]
