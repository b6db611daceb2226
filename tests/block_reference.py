"""An exact block optimum, written for the tests without the package's policy code: the least bytes any schedule
copies to the device over a known sequence of component uses, by a forward dynamic programme over every set of blocks
kept on the device (numpy arrays indexed by bit masks; at most 18 blocks).

The model, the runtime's: every component is a list of blocks (its rest first where it has repeated blocks; a
component without them is one block). A use of a component runs some of its blocks (`Use.runs`); every block it runs
that is not kept is copied, and so is every block it newly keeps. While it runs, the blocks kept on the device, and a
ring for its blocks that are not kept (three buffers as large as the largest of their slots, fewer when fewer are
not kept), fit the budget; a component of one block runs whole, and one of several keeps its rest whenever any of its
blocks is not kept. Evictions are free and may happen at
any moment."""

from typing import Dict, List, NamedTuple, Sequence

import numpy as np

RING = 3  # buffers: the running block and two prefetched
INF = np.iinfo(np.int64).max // 4


class Block(NamedTuple):
    component: str
    name: str
    nbytes: int  # on the device when kept
    slot: int  # a ring buffer must be this large for it to stream
    rest: bool = False


class Use(NamedTuple):
    component: str
    runs: frozenset  # the names of the blocks this use runs


END = None  # between calls


def _tables(blocks: Sequence[Block]):
    n = len(blocks)
    assert n <= 18, n
    masks = np.arange(1 << n, dtype=np.int64)
    held = np.zeros(1 << n, dtype=np.int64)
    for i, block in enumerate(blocks):
        held += ((masks >> i) & 1) * block.nbytes
    return masks, held


def _feasible(blocks, masks, held, component: str, budget: int) -> np.ndarray:
    """Kept sets (after evictions and new keeps) that `component` can run with."""
    mine = [(i, b) for i, b in enumerate(blocks) if b.component == component]
    count = np.zeros(len(masks), dtype=np.int64)
    largest = np.zeros(len(masks), dtype=np.int64)
    rest_kept = np.ones(len(masks), dtype=bool)
    for i, block in mine:
        missing = ((masks >> i) & 1) == 0
        count += missing
        largest = np.maximum(largest, np.where(missing, block.slot, 0))
        if block.rest:
            rest_kept &= ~missing
    ring = np.minimum(count, RING) * largest
    streams = len(mine) > 1
    return (held + ring <= budget) & ((count == 0) | (rest_kept if streams else False))


def optimum(uses: Sequence, blocks: Sequence[Block], budget: int) -> List[int]:
    """The least bytes for the uses up to and including each call's end (`END` in `uses`), kept between calls."""
    masks, held = _tables(blocks)
    reach = np.full(len(masks), INF, dtype=np.int64)
    reach[0] = 0
    after = []
    feasible = {}
    for use in uses:
        if use is END:
            after.append(int(reach.min()))
            continue
        if use.component not in feasible:
            feasible[use.component] = _feasible(blocks, masks, held, use.component, budget)
        # Free evictions: a kept set is reachable for the least cost of any set holding it.
        down = reach.copy()
        for i in range(len(blocks)):
            without = (masks >> i) & 1 == 0
            down[without] = np.minimum(down[without], down[masks[without] | (1 << i)])
        # While it runs, the kept set is D = others | own; of `own`, the blocks kept before (X, any subset of own)
        # cost nothing, the others of `own` are copied in, and every block it runs outside `own` streams:
        #   reach'[D] = min over X <= own of (down[others | X] - bytes(X)) + bytes(own) + bytes run outside own.
        mine = [i for i, b in enumerate(blocks) if b.component == use.component]
        own_bytes = np.zeros(len(masks), dtype=np.int64)
        runs_outside = np.zeros(len(masks), dtype=np.int64)
        for i in mine:
            kept = (masks >> i) & 1 == 1
            own_bytes += np.where(kept, blocks[i].nbytes, 0)
            runs_outside += np.where(~kept & (blocks[i].name in use.runs), blocks[i].nbytes, 0)
        best = np.where(down < INF, down - own_bytes, INF)
        for i in mine:  # min over the subsets X of `own`, one of its bits at a time
            kept = (masks >> i) & 1 == 1
            best[kept] = np.minimum(best[kept], best[masks[kept] ^ (1 << i)])
        best = np.where(best < INF, best + own_bytes + runs_outside, INF)
        reach = np.where(feasible[use.component], best, INF)
    return after


def steady(per_call_after: Sequence[int]) -> int:
    """The cost of one more call once the schedule repeats: the last call's share."""
    return per_call_after[-1] - per_call_after[-2]


def brute_force(uses: Sequence, blocks: Sequence[Block], budget: int) -> int:
    """The same optimum by trying every kept set after every use (for a few blocks)."""
    n = len(blocks)
    states: Dict[int, int] = {0: 0}
    for use in uses:
        if use is END:
            continue
        mine = [i for i, b in enumerate(blocks) if b.component == use.component]
        grown: Dict[int, int] = {}
        for state, cost in states.items():
            for during in range(1 << n):
                others = [i for i in range(n) if i not in mine and during >> i & 1]
                if any(not state >> i & 1 for i in others):
                    continue  # only its own blocks can come to the device now
                missing = [i for i in mine if not during >> i & 1]
                ring = min(len(missing), RING) * max((blocks[i].slot for i in missing), default=0)
                if sum(b.nbytes for i, b in enumerate(blocks) if during >> i & 1) + ring > budget:
                    continue
                rests = [i for i in mine if blocks[i].rest]
                if missing and (len(mine) < 2 or any(i in missing for i in rests)):
                    continue
                copied = sum(
                    blocks[i].nbytes
                    for i in mine
                    if (during >> i & 1 and not state >> i & 1) or (i in missing and blocks[i].name in use.runs)
                )
                if cost + copied < grown.get(during, INF):
                    grown[during] = cost + copied
        states = grown
    return min(states.values()) if states else INF
