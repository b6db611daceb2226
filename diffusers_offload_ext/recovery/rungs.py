"""The rungs of an out-of-memory recovery, in pure Python: for a component that ran out of device memory, first the
other resident components that may leave, evicted together; when none is left, the component streams its blocks in
less and less room (half of what it holds: fewer blocks kept, down to the least room it can stream in with a ring of
three buffers, then with a ring of two); then nothing is left to try.
`Policy.on_out_of_memory` answers with them."""

from __future__ import annotations

from typing import AbstractSet, Collection, Optional, Sequence, Tuple, Union

from ..constants import OFFLOAD, STREAM


def next_rung(
    name: str,
    order: Sequence[str],
    resident: AbstractSet[str],
    hooked: AbstractSet[str],
    stays: AbstractSet[str],
    running: Collection[str],
    held: int,
    least: Union[None, int, Sequence[int]],
) -> Tuple[Tuple[Tuple[str, str], ...], Optional[int]]:
    """`(moves, room)`: the next rung for component `name`, which ran out of device memory. First the other `resident`
    components that may leave (`hooked`, not in `stays`, not `running`), in the pipeline's `order`, with no room;
    when none is left, `name` (unless it `stays`) streams its blocks in the room `next_room` gives (from the device
    bytes it `held` and the `least` room it can stream in), offloaded first where it is resident. No moves at its
    smallest residency."""
    others = [n for n in order if n in resident and n in hooked and n != name]
    others = [n for n in others if n not in stays and n not in running]
    if others:
        return tuple((OFFLOAD, n) for n in others), None
    if name in stays:
        return (), None  # excluded: it never leaves the device, not even to stream
    room = next_room(held, least)
    if room is None:
        return (), None
    moves = ((OFFLOAD, name),) if name in resident else ()
    return moves + ((STREAM, name),), room


def next_room(held: int, least) -> Optional[int]:
    """The room a component that ran out of device memory streams in at the next rung of the recovery, given the device
    bytes it holds now (`held`: its whole size when it does not stream) and the least room it can stream in (`least`;
    `None`: it cannot stream; or the least rooms with smaller and smaller rings, largest first): half of what it
    holds while that keeps more than the least room with a full ring (fewer blocks kept), then each least room
    below what it holds (a smaller ring); `None` at its smallest."""
    leasts = sorted({int(x) for x in ((least,) if isinstance(least, int) else (least or ())) if x is not None})
    below = [room for room in leasts if room < held]
    if not below:
        return None
    half = int(held) // 2
    return half if half > leasts[-1] else below[-1]
