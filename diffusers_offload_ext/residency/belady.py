"""The block choice above `block_tables.MAX_BLOCKS` blocks: the device holds the blocks the predicted future uses
soonest (Belady's rule, per byte), with a short look-ahead where that rule and the rings disagree (pure Python).

When component `C` is about to run, every resident component and `C` itself are ranked by their next predicted use
(for `C`, its use after this one). In that order each keeps what it has, as much as fits (`block_sets.shrunk`: the
fewest bytes go); `C`, at its rank, gets the room left (never less than its least footprint) and keeps the blocks
that copy the fewest bytes in it (`block_sets.running_choice`), the others streaming through its ring. Blocks of
equal next use are worth the same per byte, so which go is a knapsack over a component's blocks, not a ranking.

Belady's rule is optimal when bytes are divisible and a use needs no room beyond its bytes. A streaming component also
needs its ring and its rest, so sometimes a component used sooner should give `C` room (a small VAE dropped for one
more transformer block that its ring's room then brings back for less). So for each component ranked before `C`,
the choice where it ranks after `C` is tried too, and each choice is valued by replaying the same rule over the
predicted events up to `C`'s next use (a roll-out); the cheapest wins, ties to Belady's.
"""

from __future__ import annotations

from typing import Callable, Dict, FrozenSet, Mapping, Optional, Sequence, Tuple

from ..constants import END
from .block_sets import Spec, footprint, kept_bytes, least_footprint, running_choice, shrunk, use_cost

Kept = Dict[str, FrozenSet[str]]
INF = float("inf")
#: Decisions remembered per policy (the same states recur at every step and every call).
MEMO_ENTRIES = 20000


class Chooser:
    """Belady's rule with roll-outs over one pipeline's components.

    Args:
        specs (`Mapping[str, Spec]`): Every offloaded component's blocks.
        room_of (`Callable[[str], int]`): The room while a component runs (its limit: the budget, or less where its
            activations need more), the ring included.
        keep_between (`bool`): Whether what is kept stays from one call to the next (else a call's end empties it).
    """

    def __init__(self, specs: Mapping[str, Spec], room_of: Callable[[str], int], keep_between: bool) -> None:
        self.specs, self.room_of, self.keep_between = dict(specs), room_of, keep_between
        self.memo: Dict[tuple, object] = {}

    # -- one decision -----------------------------------------------------------------------------------------------
    def decide(self, name: str, kept: Kept, upcoming: Sequence[str], room: Optional[int] = None) -> Optional[Kept]:
        """What every component keeps while `name` runs (in `room`, its own room if not given), given what they keep
        (`kept`) and the predicted events after this use (`upcoming`, `END` between calls); `None` when `name` cannot
        run within its room even alone."""
        upcoming = tuple(upcoming)
        key = ("decide", name, _frozen(kept), upcoming, room)
        if key in self.memo:
            return self.memo[key]
        nexts = _next_uses(upcoming)
        base = self.allocate(name, kept, nexts, room=room)
        sooner = [n for n in sorted(kept) if n != name and kept[n] and nexts.get(n, INF) < nexts.get(name, INF)]
        candidates = [base] + [self.allocate(name, kept, nexts, late=(n,), room=room) for n in sooner]
        if len(sooner) > 1:
            candidates.append(self.allocate(name, kept, nexts, late=tuple(sooner), room=room))
        candidates = [c for c in candidates if c is not None]
        if len(candidates) > 1:
            stop = min(nexts.get(name, len(upcoming)), len(upcoming) - 1) + 1
            scored = []
            for index, candidate in enumerate(candidates):
                cost = use_cost(self.specs[name], kept.get(name, ()), candidate[name])
                scored.append((cost + self.rollout(candidate, upcoming[:stop]), index))
            base = candidates[min(scored)[1]]
        return self._remember(key, base)

    def allocate(
        self, name: str, kept: Kept, nexts: Mapping[str, int], late: Tuple[str, ...] = (), room: Optional[int] = None
    ) -> Optional[Kept]:
        """Belady's rule for the use of `name` (see the module docstring) in `room` (its own if not given);
        components in `late` rank after it."""
        others = [n for n in kept if n != name and kept[n]]
        order = tuple(sorted(others + [name], key=lambda n: (n in late, nexts.get(n, INF), n != name, n)))
        room = self.room_of(name) if room is None else room
        key = ("allocate", name, _frozen(kept), order, room)
        if key in self.memo:
            return self.memo[key]
        spec = self.specs[name]
        reserve = least_footprint(spec)
        if reserve > room:
            return self._remember(key, None)
        left, new = room - reserve, {}
        for n in order:
            if n == name:
                chosen = running_choice(spec, left + reserve, kept.get(name, ()))
                if chosen is None:
                    return self._remember(key, None)
                new[name] = chosen
                left += reserve - footprint(spec, chosen)
                reserve = 0
            else:  # the blocks it runs; those it does not (never used again) only in what is left at the end
                new[n] = shrunk(self.specs[n], kept[n] & _runs(self.specs[n]), left)
                left -= kept_bytes(self.specs[n], new[n])
        for n in order:
            idle = kept.get(n, frozenset()) - _runs(self.specs[n]) if n != name else frozenset()
            for item in self.specs[n].items:
                if item.key in idle and item.nbytes <= left:
                    new[n], left = new[n] | {item.key}, left - item.nbytes
        return self._remember(key, {n: blocks for n, blocks in new.items() if blocks})

    def rollout(self, kept: Kept, events: Sequence[str]) -> float:
        """Bytes copied over `events` from `kept` on, each use decided by Belady's rule alone."""
        total = 0
        for index, event in enumerate(events):
            if event == END:
                if not self.keep_between:
                    kept = {}
                continue
            if event not in self.specs:
                continue
            new = self.allocate(event, kept, _next_uses(events[index + 1 :]))
            if new is None:
                return INF
            total += use_cost(self.specs[event], kept.get(event, ()), new[event])
            kept = new
        return total

    def _remember(self, key, value):
        if len(self.memo) >= MEMO_ENTRIES:
            self.memo.clear()
        self.memo[key] = value
        return value


def _runs(spec: Spec) -> FrozenSet[str]:
    """The blocks of `spec` that run when it runs."""
    return frozenset(item.key for item in spec.items if item.uses)


def _frozen(kept: Kept) -> tuple:
    return tuple(sorted((n, blocks) for n, blocks in kept.items() if blocks))


def _next_uses(events: Sequence[str]) -> Dict[str, int]:
    """Where each component next runs in `events` (its first position)."""
    found: Dict[str, int] = {}
    for position, event in enumerate(events):
        if event != END and event not in found:
            found[event] = position
    return found


def next_use_words(name: str, upcoming: Sequence[str]) -> str:
    """When `name` is predicted to run next, in words."""
    nexts = _next_uses(upcoming)
    if name not in nexts:
        return "not predicted to run again"
    position = nexts[name]
    if any(event == END for event in upcoming[:position]):
        return "next used in a later call"
    if not position:
        return "used again next"
    return f"used again after {position} other use{'s' if position > 1 else ''}"
