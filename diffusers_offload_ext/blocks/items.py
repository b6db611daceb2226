"""A component's blocks as block residency sees them: their bytes on the device, the bytes of the ring buffer each
needs when it streams, whether they ran; the fewest bytes a component can stream in; and the plan of a stream that
keeps a given set of blocks or fits a given room."""

from __future__ import annotations

from typing import Dict, Iterable, Optional, Tuple

from .find import REST, find_blocks
from .choice import DEPTH, Item, BlockChoice, least_room, choose_blocks
from .streamed_block import ring_hosts
from ..transfer.parts import streamable
from .ring import aligned_nbytes
from ..units import format_size


def _items(module, uses: Optional[Dict[str, int]] = None) -> Tuple[Optional[list], list, str]:
    """`(items, blocks, why not)`: `module`'s blocks as the knapsack sees them (ring slots sized as the ring lays blocks
    out, each weighed by `uses`, 1 if not given); the items are `None` when it cannot stream, and `why not` says
    why."""
    blocks = find_blocks(module)
    if not [b for b in blocks if b.name != REST]:
        return None, blocks, "it has no repeated blocks to stream"
    for block in blocks:
        odd = [t for t in _tensors(block) if not streamable(t)]
        if block.name != REST and odd:
            return None, blocks, f"block `{block.name}` holds a tensor that cannot stream ({type(odd[0]).__name__})"
    known = bool(uses)  # from the last stream: a block that did not run then weighs nothing
    items = [  # a streamed block's ring buffer holds its quantization state too
        Item(
            b.name,
            b.nbytes if b.name == REST else aligned_nbytes(ring_hosts(b.slots)),
            uses.get(b.name, 0) if known else 1,
        )
        for b in blocks
    ]
    return items, blocks, ""


def _forced(blocks) -> list:
    return [REST] if blocks and blocks[0].name == REST else []


def stream_room(module, depth: int = DEPTH) -> Optional[int]:
    """The fewest device bytes `module` can stream its blocks in (its rest, any block larger than the ring's buffers,
    the ring of `depth + 1` buffers); `None` when it cannot stream at all. A choice exists (`block_choice`) for any
    room at least this."""
    items, blocks, _ = _items(module)
    return None if items is None else least_room(items, depth=depth, forced=_forced(blocks))


def block_choice(
    module, room: int, uses: Optional[Dict[str, int]] = None, depths: Tuple[int, ...] = (DEPTH,)
) -> Tuple[Optional[BlockChoice], list, str]:
    """`(choice, blocks, why not)`: how `module` streams within `room` bytes (`blocks.choice.choose_blocks` over its
    blocks, its rest kept, each block weighed by `uses`, 1 if not given), with a ring of `depth + 1` buffers for the
    first of `depths` that fits (smaller rings: an out-of-memory recovery's last rungs); the choice is `None` when it
    cannot stream, and `why not` says why."""
    items, blocks, why = _items(module, uses)
    if items is None:
        return None, blocks, why
    forced = _forced(blocks)
    choice = None
    for depth in depths:
        choice = choice or choose_blocks(items, room, depth=depth, forced=forced)
    if choice is None:
        least = least_room(items, depth=DEPTH, forced=forced)
        need, have = format_size(least), format_size(room)
        if need == have:
            need, have = f"{least:,} bytes", f"{room:,} bytes"
        why = (
            f"to stream it needs at least {need} on the device, for its rest, any block larger than the ring's "
            f"buffers and a ring of {DEPTH + 1} buffers, and it has {have}"
        )
        return None, blocks, why
    return choice, blocks, ""


def _tensors(block):
    return [(sub._parameters if is_param else sub._buffers)[key] for sub, is_param, key in block.slots]


def block_items(module, uses: Optional[Dict[str, int]] = None) -> Optional[Tuple[Item, ...]]:
    """`Facts.blocks` of `module`: each block's bytes on the device, whether it runs (0 where the last stream saw it
    not run: the VAE's encoder during decodes; 1 before any stream), and its ring slot (the tensors' bytes, each
    start aligned: `ring.aligned_nbytes`), the rest first; `None` when it cannot stream."""
    items, blocks, _ = _items(module)
    if items is None:
        return None
    known = bool(uses) and any(uses.values())
    return tuple(
        Item(block.name, block.nbytes, int(uses.get(block.name, 0) > 0) if known else 1, item.nbytes)
        for block, item in zip(blocks, items)
    )


def kept_choice(blocks, kept: Iterable[str]) -> BlockChoice:
    """The plan of a stream of `blocks` (`find.Block`s) that keeps `kept`: a ring of `DEPTH + 1` buffers (fewer when
    fewer blocks stream) as large as the largest streamed block's slot. A rest not kept does not stream (no hook can
    bring it in): it is kept again before the component runs."""
    kept = set(kept)
    streamed = [b for b in blocks if b.name not in kept and b.name != REST]
    slot = max((aligned_nbytes(ring_hosts(b.slots)) for b in streamed), default=0)
    return BlockChoice(
        kept=tuple(b.name for b in blocks if b.name in kept),
        streamed=tuple(b.name for b in streamed),
        slot_bytes=slot,
        slots=min(DEPTH + 1, len(streamed)),
        kept_bytes=sum(b.nbytes for b in blocks if b.name in kept),
        streamed_bytes=sum(b.nbytes for b in streamed),
    )
