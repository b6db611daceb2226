"""What the rest of a pipeline call will use, predicted from the call so far and the previous call's trace."""

from __future__ import annotations

from typing import List, Sequence


def chain_after(events: Sequence[str], chain: Sequence[str]) -> List[str]:
    """The chain components after the last chain position `events` reached (what a chain-ordered call does next)."""
    reached = [chain.index(e) for e in events if e in chain]
    return list(chain[max(reached) + 1 :]) if reached else list(chain)


def predict_rest(
    current: Sequence[str],
    model: Sequence[str],
    *,
    chain: Sequence[str] = (),
    learned: bool = True,
    window: int = 8,
    loops: int = 8,
) -> List[str]:
    """The events predicted to follow `current` in this call.

    - `current` is a prefix of `model`: the rest of `model`.
    - With a `learned` model (the previous call's trace): the longest suffix of `current` (at most `window` events)
      found in `model`, at the occurrence that ends nearest to the current position; what followed it there.
    - Otherwise, or if nothing matches: a loop. The longest suffix of `current` that occurred earlier in this call, at
      its latest occurrence, gives a period; the last period repeats `loops` times, then the `chain` goes on after
      the last chain position the loop reached (a denoising loop, then the VAE).
    - Nothing matches at all: the `chain` after the last chain position reached.
    """
    current = tuple(current)
    model = tuple(model)
    k = len(current)
    if k <= len(model) and model[:k] == current:
        return list(model[k:])
    if learned:
        found = _nearest_match(current, model, window)
        if found is not None:
            return list(model[found + 1 :])
    for length in range(min(window, k - 1), 0, -1):
        tail = current[k - length :]
        for end in range(k - 2, length - 2, -1):
            if current[end - length + 1 : end + 1] == tail:
                unit = current[end + 1 :]
                return list(unit) * loops + chain_after(unit, chain)
    return chain_after(current, chain)


def _nearest_match(current: tuple, model: tuple, window: int):
    """Where in `model` the longest suffix of `current` ends, nearest to the current position; `None` if nowhere."""
    k = len(current)
    for length in range(min(window, k), 0, -1):
        tail = current[k - length :]
        best = None
        for end in range(length - 1, len(model)):
            if model[end - length + 1 : end + 1] == tail and (best is None or abs(end - k + 1) < abs(best - k + 1)):
                best = end
        if best is not None:
            return best
    return None
