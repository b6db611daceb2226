"""The reserve the budget leaves for a call shape's activations (pure Python): what its calls were seen to need beyond
the weights, and a margin, widened by each out-of-memory error since."""

from __future__ import annotations

from ..constants import MiB

#: The margin kept above the activations observed for a call shape: a quarter of them, and at least this many bytes.
MARGIN_FLOOR = 256 * MiB
#: Each out-of-memory error of a call shape whose activations were observed widens its margin by one more margin, up
#: to this many.
MAX_MISSES = 4


def reserve_for(activations: int, misses: int = 0) -> int:
    """The reserve for a call shape whose calls needed `activations` bytes beyond the weights: those and a margin
    (a quarter, at least `MARGIN_FLOOR`), widened once for each of `misses` out-of-memory errors since.

    Example:

    ```py
    >>> reserve_for(4 << 30) == (5 << 30)
    True
    ```
    """
    margin = max(int(activations) // 4, MARGIN_FLOOR)
    return int(activations) + margin * (1 + min(max(int(misses), 0), MAX_MISSES))
