"""When streamed blocks are prefetched: which blocks of a component that streams are copied into the ring ahead of
their use, along the order its blocks ran in. A "when", like the prefetch of whole components (`prefetch.py`); the
ring (`blocks/streamer.py`) carries it out."""

from __future__ import annotations

from typing import List, Optional, Sequence


def blocks_ahead(order: Sequence[str], running: Optional[str], depth: int, passes: Optional[int] = None) -> List[str]:
    """The streamed blocks to have in the ring ahead of their use, at most `depth`, in the order they will run: never
    past the end of the forward that runs. Between two forwards runs pipeline code, a step callback that may edit the
    weights among it; a block copied before it would run with the weights of before the edit.

    Args:
        order (`Sequence[str]`): The streamed blocks in the order they ran the last time (module order before that).
        running (`str` or `None`): The block about to run; `None`: the component starts streaming (in its first
            forward's pre-hook, after any callback).
        depth (`int`): Blocks prefetched ahead of the running one.
        passes (`int`, *optional*): Forwards the component is expected to run (as many as the last time); `None`
            when unknown (its first stream): then nothing is prefetched before the first block runs.
    """
    if running is None:
        return list(order[:depth]) if passes is not None else []
    if running not in order:
        return []  # a block that did not run before: nothing known to follow it
    index = order.index(running)
    return list(order[index + 1 : index + 1 + depth])
