"""Which blocks stay on the device: the knapsack of block residency, in pure Python (sizes and use counts in, names
out).

A block kept on the device saves, at every call, as many transfers of its bytes as it has uses in the call (a
denoiser block runs once per step, a text-encoder layer once per call). Minimising the bytes streamed per call within
a room of `room` bytes is a 0/1 knapsack whose item values are `nbytes * uses` and weights `nbytes`: every item has
the value density `uses`. `keep_most_used` takes blocks by uses (the density), most first, and adds every block that
still fits. Its saving is at most one block's value below the optimum: the blocks taken in density order up to the
first that does not fit are the fractional optimum's whole items, and the fractional optimum is worth no more than
those plus that one block (the classic bound; `tests/test_block_residency.py` checks it against brute force). The
exact answer differs when blocks of equal uses leave a gap that another combination of sizes fills better (a subset
sum); with the equal-sized repeated blocks of real models the gap is smaller than one block.

Streamed blocks pass through a ring of `depth + 1` device buffers, each as large as the largest streamed block: the
one running and `depth` prefetched ahead. The ring is part of the room, so keeping the largest blocks can shrink it;
`choose_blocks` tries every slot size a block has and keeps the choice that streams the fewest bytes.
"""

from __future__ import annotations

from typing import FrozenSet, Hashable, Iterable, List, NamedTuple, Optional, Sequence, Tuple

#: Blocks prefetched ahead of the one running (the ring has `DEPTH + 1` slots).
DEPTH = 2
#: Most blocks `choose_blocks` accepts (it is quadratic in their number).
MAX_BLOCKS = 4096


class Item(NamedTuple):
    """A block as the knapsack sees it: `key`, `nbytes` on the device, `uses` per call, and the bytes of the ring
    buffer it needs when it streams (`slot`; 0: `nbytes`; at run time its tensors' bytes, each start aligned)."""

    key: Hashable
    nbytes: int
    uses: int
    slot: int = 0

    @property
    def ring_slot(self) -> int:
        return self.slot or self.nbytes


class BlockChoice(NamedTuple):
    """How one component runs within a room smaller than itself.

    Args:
        kept (`Tuple`): Keys of the blocks on the device for as long as the component streams.
        streamed (`Tuple`): Keys of the blocks onloaded into the ring just before they run, in the items' order.
        slot_bytes (`int`): Bytes of one ring buffer (the largest streamed block).
        slots (`int`): Ring buffers (`depth + 1`, fewer when fewer blocks stream).
        kept_bytes (`int`): Bytes of the kept blocks.
        streamed_bytes (`int`): Bytes streamed per call (each streamed block's bytes times its uses).
    """

    kept: Tuple
    streamed: Tuple
    slot_bytes: int
    slots: int
    kept_bytes: int
    streamed_bytes: int

    @property
    def ring_bytes(self) -> int:
        return self.slot_bytes * self.slots

    @property
    def device_bytes(self) -> int:
        """Bytes on the device while the component streams: the kept blocks and the ring."""
        return self.kept_bytes + self.ring_bytes


def _checked(items: Iterable[Item]) -> Tuple[Item, ...]:
    items = tuple(Item(*item) for item in items)
    for item in items:
        if item.nbytes < 0 or item.uses < 0:
            raise ValueError(f"`items` must have non-negative `nbytes` and `uses`, got {item!r}.")
    if len({item.key for item in items}) != len(items):
        raise ValueError("`items` must have distinct keys.")
    return items


def keep_most_used(items: Iterable[Item], room: int) -> FrozenSet:
    """Keys of the blocks to keep within `room` bytes: most uses first (ties: larger first, then spread along the
    given order, `spread_ranks`), each block that still fits; never a block without uses (keeping it would only cost
    its copy). At most one block's value (`nbytes * uses`) short of the best choice."""
    items = _checked(items)
    ranks = spread_ranks([(item.uses, item.nbytes) for item in items])
    order = sorted(range(len(items)), key=lambda i: (-items[i].uses, -items[i].nbytes, ranks[i]))
    kept, left = set(), int(room)
    for i in order:
        if items[i].uses and items[i].nbytes <= left:
            kept.add(items[i].key)
            left -= items[i].nbytes
    return frozenset(kept)


def spread_ranks(classes: Sequence[Hashable]) -> List[int]:
    """For items in running order, each with its class (equal blocks: equal class), a rank per item such that, within
    a class, the items of the lowest ranks lie evenly along the order (a van der Corput order of their positions):
    kept blocks taken by rank leave the streamed ones spread through the forward, each streamed block's copy
    overlapping the kept blocks that run before it, instead of a run of streamed blocks at the end whose copies the
    ring can only take two at a time (issue 31). It changes which of equal blocks stay, never how many bytes."""
    members: dict = {}
    for index, key in enumerate(classes):
        members.setdefault(key, []).append(index)
    ranks = [0] * len(classes)
    for indices in members.values():
        for rank, position in enumerate(_spread_order(len(indices))):
            ranks[indices[position]] = rank
    return ranks


def _spread_order(count: int) -> List[int]:
    """Positions `0..count-1` in an order whose every prefix lies evenly spread (van der Corput: bit-reversed
    fractions of `count`; at most `2 * count` steps)."""
    order, seen, step = [], set(), 0
    while len(order) < count:
        fraction, bit, rest = 0.0, 0.5, step
        while rest:
            fraction += bit * (rest & 1)
            rest, bit = rest >> 1, bit / 2
        position = int(fraction * count)
        if position not in seen:
            seen.add(position)
            order.append(position)
        step += 1
    return order


def streamed_bytes(items: Iterable[Item], kept: Iterable) -> int:
    """Bytes streamed per call when the blocks `kept` stay: every other block's bytes times its uses."""
    kept = set(kept)
    return sum(item.nbytes * item.uses for item in _checked(items) if item.key not in kept)


def choose_blocks(
    items: Sequence[Item], room: int, *, depth: int = DEPTH, forced: Iterable = ()
) -> Optional[BlockChoice]:
    """The choice that streams the fewest bytes per call with the kept blocks and the ring within `room` bytes; `None`
    when none fits (the `forced` blocks and the smallest ring alone exceed it).

    Args:
        items (`Sequence[Item]`): The component's blocks, in their running order.
        room (`int`): Device bytes the component may take while it runs.
        depth (`int`, defaults to `DEPTH`): Blocks prefetched ahead of the running one.
        forced (`Iterable`): Keys that must stay (the component's rest, needed whenever it runs).
    """
    items = _checked(items)
    best = None
    for must, free, ring in _rings(items, depth, forced):
        left = room - ring - sum(item.nbytes for item in must)
        if left < 0:
            continue
        kept = keep_most_used(free, left) | {item.key for item in must}
        choice = _choice(items, kept, depth)
        if best is None or (choice.streamed_bytes, choice.device_bytes) < (best.streamed_bytes, best.device_bytes):
            best = choice
    return best


def least_room(items: Sequence[Item], *, depth: int = DEPTH, forced: Iterable = ()) -> int:
    """The fewest device bytes any block choice of `items` needs (`choose_blocks` finds one in that room): the `forced`
    blocks, those larger than the ring's buffers, and the ring."""
    return min(ring + sum(item.nbytes for item in must) for must, free, ring in _rings(_checked(items), depth, forced))


def _rings(items: Tuple[Item, ...], depth: int, forced: Iterable):
    """`(must keep, may stream, ring bytes)` for each ring buffer size worth trying (0: nothing streams)."""
    if len(items) > MAX_BLOCKS:
        raise ValueError(f"`items` has {len(items)} blocks; at most {MAX_BLOCKS} can be chosen among.")
    if depth < 1:
        raise ValueError(f"`depth` must be at least 1, got {depth!r}.")
    forced = set(forced)
    for slot in sorted({0} | {item.nbytes for item in items if item.key not in forced}):
        must = [item for item in items if item.key in forced or item.nbytes > slot]
        free = [item for item in items if item.key not in forced and item.nbytes <= slot]
        yield must, free, slot * min(depth + 1, len(free))


def _choice(items: Tuple[Item, ...], kept: FrozenSet, depth: int) -> BlockChoice:
    streamed = [item for item in items if item.key not in kept]
    slot = max((item.nbytes for item in streamed), default=0)
    return BlockChoice(
        kept=tuple(item.key for item in items if item.key in kept),
        streamed=tuple(item.key for item in streamed),
        slot_bytes=slot,
        slots=min(depth + 1, len(streamed)),
        kept_bytes=sum(item.nbytes for item in items if item.key in kept),
        streamed_bytes=sum(item.nbytes * item.uses for item in streamed),
    )
