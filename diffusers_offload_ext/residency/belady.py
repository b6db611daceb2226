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
from .block_sets import (
    Spec,
    at_use,
    footprint,
    kept_bytes,
    least_footprint,
    running_choice,
    shrunk,
    use_cost,
    use_indices,
)

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

    def __init__(
        self, specs: Mapping[str, Spec], room_of: Callable[[str], int], keep_between: bool, runs=None
    ) -> None:
        self.specs, self.room_of, self.keep_between = dict(specs), room_of, keep_between
        self.runs = {name: dict(found) for name, found in (runs or {}).items()}
        self.memo: Dict[tuple, object] = {}

    def spec_at(self, name: str, index: int) -> Spec:
        """`name`'s blocks at use `index` of it in its call (which of them that use runs, where known)."""
        return at_use(self.specs[name], self.runs.get(name, {}).get(index))

    # -- one decision -----------------------------------------------------------------------------------------------
    def decide(
        self,
        name: str,
        kept: Kept,
        upcoming: Sequence[str],
        room: Optional[int] = None,
        guesses: Sequence = (),
        done: Sequence[str] = (),
    ) -> Optional[Kept]:
        """What every component keeps while `name` runs (in `room`, its own room if not given), given what they keep
        (`kept`) and the predicted events after this use (`upcoming`, `END` between calls; `done`: the uses of this
        call so far, this one included); `None` when `name` cannot run within its room even alone. With `guesses`
        (other predictions, on a first call), the choice whose worst regret over `upcoming` and them is least."""
        upcoming, guesses, done = tuple(upcoming), tuple(tuple(g) for g in guesses), tuple(done)
        counts = tuple(sorted((n, done.count(n)) for n in set(done)))
        key = ("decide", name, _frozen(kept), upcoming, room, guesses, counts)
        if key in self.memo:
            return self.memo[key]
        nexts, index = _next_uses(upcoming), max(done.count(name) - 1, 0)
        base = self.allocate(name, kept, nexts, room=room, index=index)
        others = [n for n in sorted(kept) if n != name and kept[n]]
        sooner = [n for n in others if nexts.get(n, INF) < nexts.get(name, INF)] if not guesses else others
        candidates = [base] + [self.allocate(name, kept, nexts, late=(n,), room=room, index=index) for n in sooner]
        if len(sooner) > 1:
            candidates.append(self.allocate(name, kept, nexts, late=tuple(sooner), room=room, index=index))
        candidates = [c for c in candidates if c is not None]
        if len(candidates) > 1:
            costs = [
                [self._valued(name, kept, c, events, done, index) for c in candidates]
                for events in (upcoming,) + guesses
            ]
            regret = [max(row[i] - min(row) for row in costs) for i in range(len(candidates))]
            base = candidates[min(range(len(candidates)), key=lambda i: (regret[i], sum(r[i] for r in costs), i))]
        return self._remember(key, base)

    def _valued(self, name: str, kept: Kept, candidate: Kept, events: Sequence[str], done, index: int) -> float:
        """What `candidate` costs: this use, and Belady's rule over `events` up to `name`'s next use."""
        stop = min(_next_uses(events).get(name, len(events)), len(events) - 1) + 1
        now = use_cost(self.spec_at(name, index), kept.get(name, ()), candidate[name])
        return now + self.rollout(candidate, events[:stop], done)

    def allocate(
        self,
        name: str,
        kept: Kept,
        nexts: Mapping[str, int],
        late: Tuple[str, ...] = (),
        room: Optional[int] = None,
        index: int = 0,
    ) -> Optional[Kept]:
        """Belady's rule for use `index` of `name` in its call (see the module docstring) in `room` (its own if not
        given); components in `late` rank after it."""
        others = [n for n in kept if n != name and kept[n]]
        order = tuple(sorted(others + [name], key=lambda n: (n in late, nexts.get(n, INF), n != name, n)))
        room = self.room_of(name) if room is None else room
        spec = self.spec_at(name, index)
        key = ("allocate", name, _frozen(kept), order, room, tuple(item.uses for item in spec.items))
        if key in self.memo:
            return self.memo[key]
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

    def rollout(self, kept: Kept, events: Sequence[str], done: Sequence[str] = ()) -> float:
        """Bytes copied over `events` (after the uses `done` of this call) from `kept` on, each use decided by
        Belady's rule alone."""
        total, uses = 0, use_indices(events, done)
        for index, event in enumerate(events):
            if event == END:
                if not self.keep_between:
                    kept = {}
                continue
            if event not in self.specs:
                continue
            new = self.allocate(event, kept, _next_uses(events[index + 1 :]), index=uses[index])
            if new is None:
                return INF
            total += use_cost(self.spec_at(event, uses[index]), kept.get(event, ()), new[event])
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
