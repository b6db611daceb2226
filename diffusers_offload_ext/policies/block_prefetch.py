"""When streamed blocks are prefetched: which blocks of a component that streams are copied into the ring ahead of
their use, along the order its blocks ran in. A "when", like the prefetch of whole components (`prefetch.py`); the
ring (`transfer/streaming.py`) carries it out."""

from __future__ import annotations

from typing import List, Optional, Sequence


def blocks_ahead(
    order: Sequence[str], running: Optional[str], depth: int, uses: int = 0, passes: Optional[int] = None
) -> List[str]:
    """The streamed blocks to have in the ring ahead of their use, at most `depth`, in the order they will run.

    Args:
        order (`Sequence[str]`): The streamed blocks in the order they ran the last time (module order before that).
        running (`str` or `None`): The block about to run; `None`: the component starts streaming.
        depth (`int`): Blocks prefetched ahead of the running one.
        uses (`int`, defaults to 0): Times `running` has run since the component started streaming.
        passes (`int`, *optional*): Forwards the component is expected to run (as many as the last time); `None`
            when unknown (its first stream): then nothing is prefetched before the first block runs, nor past the
            end of a forward (no bytes for a forward that may not come). Past the end of a forward, the prefetch
            runs into the next one only while one is expected.
    """
    if running is None:
        return list(order[:depth]) if passes is not None else []
    if running not in order:
        return []  # a block that did not run before: nothing known to follow it
    index = order.index(running)
    upcoming = [order[(index + k) % len(order)] for k in range(1, depth + 1)]
    if passes is None or uses >= passes:
        upcoming = upcoming[: max(len(order) - 1 - index, 0)]
    return upcoming
