"""Block sets: what one component holds on the device when it keeps some of its blocks, what one use of it costs,
and which of its blocks to keep within a room (pure Python).

A component is a set of blocks (`Spec`): those of a component that can stream (`blocks.find_blocks`, its rest
first), or one block for a component that cannot (`WHOLE`). While it runs, the blocks it keeps are on the device,
and when some are not, its rest is (`forced`) and a ring of `DEPTH + 1` buffers as large as the largest streamed
block's slot holds the others as they pass (fewer buffers when fewer blocks stream). A use copies every block it
runs that is not kept, once, and every block newly kept; dropping a kept block is free (zero-copy eviction).
"""

from __future__ import annotations

from typing import Dict, FrozenSet, Iterable, List, NamedTuple, Optional, Sequence, Tuple

from ..blocks.choice import DEPTH, Item
from ..constants import END

#: The one block of a component that cannot stream (no repeated blocks, or a tensor that cannot pass a ring).
WHOLE = "<whole>"
#: The rest of a component (`blocks.find.REST`, named again here: this module imports no torch).
REST = "<rest>"
#: Most partial sums `fill` keeps before it answers greedily instead of exactly.
MAX_SUMS = 4096
#: Most blocks (of all offloaded components together) whose choice is valued exactly (`block_tables.py`: 2**MAX_BLOCKS
#: sets per table); above, Belady's rule with roll-outs (`belady.py`).
MAX_BLOCKS = 14


class Spec(NamedTuple):
    """One component's blocks as residency sees them.

    Args:
        name (`str`): The component.
        items (`Tuple[Item, ...]`): Its blocks: key, bytes kept on the device, uses (0: it did not run the last time
            the component streamed) and ring slot bytes.
        forced (`FrozenSet[str]`): Blocks that must be kept whenever it runs with others streaming (its rest).
        streams (`bool`): Whether it can stream at all (else it runs whole or not at all).
    """

    name: str
    items: Tuple[Item, ...]
    forced: FrozenSet[str]
    streams: bool

    @property
    def keys(self) -> FrozenSet[str]:
        return frozenset(item.key for item in self.items)

    @property
    def total(self) -> int:
        return sum(item.nbytes for item in self.items)


def spec_of(name: str, blocks: Optional[Sequence], size: int) -> Spec:
    """The `Spec` of component `name` from its block facts (`Facts.blocks`), or one `WHOLE` block of `size` bytes
    when it has none."""
    if not blocks:
        return Spec(name, (Item(WHOLE, int(size), 1),), frozenset([WHOLE]), False)
    items = tuple(Item(*item) for item in blocks)
    forced = frozenset(item.key for item in items if item.key == REST)
    return Spec(name, items, forced, len(items) > 1)


def at_use(spec: Spec, runs: Optional[Iterable[str]]) -> Spec:
    """`spec` for one use that runs the blocks `runs` (its rest always; `None`: as `spec` says): a VAE's encode runs
    its encoder blocks, its decode its decoder blocks."""
    if runs is None or not spec.streams:
        return spec
    runs = set(runs)
    return spec._replace(
        items=tuple(item._replace(uses=int(item.key == REST or item.key in runs)) for item in spec.items)
    )


def use_indices(events: Sequence[str], done: Iterable[str] = ()) -> List[int]:
    """For each event of `events` (`END` between calls), which use of its component in its call it is (0 for the
    first), the uses `done` already in the call in progress counted."""
    counts: Dict[str, int] = {}
    for name in done:
        counts[name] = counts.get(name, 0) + 1
    found = []
    for event in events:
        if event == END:
            counts, index = {}, -1
        else:
            index = counts.get(event, 0)
            counts[event] = index + 1
        found.append(index)
    return found


def whole(spec: Spec) -> Spec:
    """`spec` as one block: a component loaded whole (not streaming) can only stay whole or leave."""
    return spec if not spec.streams else Spec(spec.name, (Item(WHOLE, spec.total, 1),), frozenset([WHOLE]), False)


def kept_bytes(spec: Spec, kept: Iterable) -> int:
    kept = set(kept)
    return sum(item.nbytes for item in spec.items if item.key in kept)


def ring_bytes(spec: Spec, kept: Iterable) -> int:
    """Bytes of the ring while it runs keeping `kept`: `DEPTH + 1` buffers (fewer when fewer blocks stream) as large as
    the largest streamed block's slot; 0 when nothing streams."""
    kept = set(kept)
    slots = [item.ring_slot for item in spec.items if item.key not in kept]
    return min(DEPTH + 1, len(slots)) * max(slots) if slots else 0


def footprint(spec: Spec, kept: Iterable) -> int:
    """Device bytes while it runs keeping `kept`: those blocks and the ring."""
    kept = set(kept)
    return kept_bytes(spec, kept) + ring_bytes(spec, kept)


def runnable(spec: Spec, kept: Iterable) -> bool:
    """Whether it can run keeping `kept`: all of it, or (where it streams) its rest at least."""
    kept = set(kept)
    return spec.keys <= kept or (spec.streams and spec.forced <= kept)


def streamed_bytes(spec: Spec, kept: Iterable) -> int:
    """Bytes one use streams keeping `kept`: every block it runs that is not kept."""
    kept = set(kept)
    return sum(item.nbytes for item in spec.items if item.key not in kept and item.uses)


def use_cost(spec: Spec, before: Iterable, during: Iterable) -> int:
    """Bytes one use copies to the device when it kept `before` and runs keeping `during`: the newly kept blocks and
    the streamed ones it runs."""
    before, during = set(before), set(during)
    return kept_bytes(spec, during - before) + streamed_bytes(spec, during)


def _rings(spec: Spec):
    """`(must keep, may stream, slot)` for every ring slot size worth trying."""
    for slot in sorted({item.ring_slot for item in spec.items if item.key not in spec.forced}):
        must = [item for item in spec.items if item.key in spec.forced or item.ring_slot > slot]
        free = [item for item in spec.items if item.key not in spec.forced and item.ring_slot <= slot]
        yield must, free, slot


def least_footprint(spec: Spec) -> int:
    """The fewest device bytes it can run in (its whole size where it cannot stream)."""
    if not spec.streams:
        return spec.total
    least = [spec.total]
    for must, free, slot in _rings(spec):
        least.append(sum(item.nbytes for item in must) + slot * min(DEPTH + 1, len(free)))
    return min(least)


def running_choice(spec: Spec, room: int, now: Iterable = ()) -> Optional[FrozenSet[str]]:
    """The blocks to keep while it runs within `room` bytes (its ring included), having `now` on the device: all of it
    where it fits, else the set that copies the fewest bytes over this use and the next one alike (a block kept now
    saves twice, a newly kept block once); `None` when it cannot run in `room`."""
    if spec.total <= room:
        return spec.keys
    if not spec.streams:
        return None
    now = set(now)
    best = None
    for must, free, slot in _rings(spec):
        left = room - sum(item.nbytes for item in must) - slot * min(DEPTH + 1, len(free))
        if left < 0:
            continue
        values = [(_value(item, now), item.nbytes, item.key) for item in free]
        kept = frozenset(item.key for item in must) | fill(values, left)
        if kept == spec.keys or footprint(spec, kept) > room:
            continue
        score = (use_cost(spec, now, kept) + streamed_bytes(spec, kept), footprint(spec, kept), sorted(map(str, kept)))
        if best is None or score < best[0]:
            best = (score, kept)
    return None if best is None else best[1]


def _value(item: Item, now) -> int:
    """What keeping `item` saves over this use and the next: twice its bytes when it runs and is kept now, once when
    it runs and would be copied in, nothing when it does not run (and, copied in for nothing, a loss)."""
    if not item.uses:
        return 0 if item.key in now else -item.nbytes
    return 2 * item.nbytes if item.key in now else item.nbytes


def shrunk(spec: Spec, kept: Iterable, room: int) -> FrozenSet[str]:
    """The blocks of `kept` to keep within `room` bytes while it does not run: the most bytes of the blocks it runs
    (anything may go, its rest too; a block it does not run goes first)."""
    kept = frozenset(kept)
    if kept_bytes(spec, kept) <= room:
        return kept
    if room <= 0:
        return frozenset()
    items = [item for item in spec.items if item.key in kept]
    return fill([(item.nbytes if item.uses else 0, item.nbytes, item.key) for item in items], room)


def fill(values: Sequence[Tuple[int, int, str]], capacity: int) -> FrozenSet[str]:
    """Keys of the `(value, weight, key)` items of most value within `capacity` weight, items of no value left out:
    exact over the classes of equal items (the repeated blocks of a model are equal, so their partial sums are few),
    greedy by value per byte where more than `MAX_SUMS` partial sums would be needed."""
    classes: Dict[Tuple[int, int], List[str]] = {}
    for value, weight, key in values:
        if value > 0:
            classes.setdefault((value, weight), []).append(key)
    groups = sorted(classes.items(), key=lambda group: (-group[0][0] / max(group[0][1], 1), group[0]))
    sums: Dict[int, Tuple[int, Tuple[int, ...]]] = {0: (0, ())}
    for (value, weight), keys in groups:
        grown: Dict[int, Tuple[int, Tuple[int, ...]]] = {}
        for total, (worth, counts) in sums.items():
            for count in range(len(keys) + 1):
                at = total + count * weight
                if at > capacity:
                    break
                if at not in grown or worth + count * value > grown[at][0]:
                    grown[at] = (worth + count * value, counts + (count,))
        sums, best = {}, -1
        for total in sorted(grown):  # a heavier sum worth no more than a lighter one is never better
            if grown[total][0] > best:
                best, sums[total] = grown[total][0], grown[total]
        if len(sums) > MAX_SUMS:
            return _greedy_fill(groups, capacity)
    counts = max(sums.values())[1]
    return frozenset(key for ((_, _), keys), count in zip(groups, counts) for key in keys[:count])


def _greedy_fill(groups, capacity: int) -> FrozenSet[str]:
    chosen, left = set(), capacity
    for (value, weight), keys in groups:
        for key in keys:
            if weight <= left:
                chosen.add(key)
                left -= weight
    return frozenset(chosen)
