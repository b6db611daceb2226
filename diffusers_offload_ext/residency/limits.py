"""`ComponentLimits`: the most bytes of weights a budgeted policy allows on the device while one component runs,
below its budget where that component's activations need more room (learnt per call shape, or shown by an
out-of-memory error)."""

from __future__ import annotations

from typing import AbstractSet, Callable, Dict, Optional

from ..constants import OFFLOAD, STREAM
from ..policies.base import NOTHING, Decision, Facts, Overflow
from ..blocks.kept_streams import held_bytes


class ComponentLimits:
    """A mixin for `ResidencyPolicy`: `limits` by component, what they allow, and the evictions of an
    out-of-memory recovery told to the shadow of stock's chain."""

    budget: Optional[int] = None
    limits: Dict[str, int]

    def allowed(self, name: str) -> Optional[int]:
        """The most bytes of weights on the device while `name` runs (`None`: no limit)."""
        found = [n for n in (self.budget, self.limits.get(name)) if n is not None]
        return min(found) if found else None

    def within_own(self, limit: Optional[int], name: Optional[str], facts) -> Optional[int]:
        """`limit` (bytes for offloaded components), lowered to `name`'s own limit where it has one; never below the
        least room it streams in (`Facts.stream_rooms`), though: streaming in that is its smallest residency."""
        if name not in self.limits:
            return limit
        stays_bytes = sum(self.sizes[n] for n in self.stays if n in self.sizes)
        own = max(self.limits[name] - stays_bytes, (facts.stream_rooms or {}).get(name, 0))
        return own if limit is None else min(limit, own)

    def _limit(self, resident: AbstractSet[str], facts: Facts, name: Optional[str] = None) -> Optional[int]:
        """The most bytes of offloaded weights while `name` runs: its limit, and where free memory is read, what the
        device can hold now beside what never leaves it."""
        limit = self.within_own(self.avail, name, facts)
        if facts.capacity is not None:
            stays_bytes = sum(self.sizes[n] for n in self.stays if n in self.sizes)
            held = stays_bytes + sum(held_bytes(self, n, facts) for n in self.offloaded if n in resident)
            capacity = facts.capacity(held)
            if capacity is not None:
                room = max(int(capacity) - stays_bytes, 0)
                limit = room if limit is None else min(limit, room)
        return limit

    def noting(self, decision: Decision) -> Decision:
        """`decision`, after noting which components it streams (in this call: streams stop at every call's end)."""
        streaming = self.__dict__.setdefault("_streaming", {})
        for direction, name in decision.moves:
            if direction == STREAM:
                streaming[name] = self.calls.index
            elif direction == OFFLOAD:
                streaming.pop(name, None)
        return decision

    def is_streaming(self, name: str) -> bool:
        """Whether a decision of this call streams `name` (it holds less than its size on the device)."""
        return self.__dict__.get("_streaming", {}).get(name, ()) == self.calls.index

    def limit_while(self, name: str, nbytes: int) -> None:
        """Fewer bytes of weights fit beside `name`'s activations than allowed (an out-of-memory error showed it):
        while it runs, at most `nbytes` from now on (never more than before)."""
        self.limits[name] = min(self.limits.get(name, int(nbytes)), int(nbytes))

    def on_out_of_memory(self, name, resident, facts, running=(), held=0, least=None) -> Decision:
        decision = super().on_out_of_memory(name, resident, facts, running, held, least)
        evicted = [n for direction, n in decision.moves if direction == OFFLOAD and n != name]
        self.shadow.count(evicted=sum(self.sizes.get(n, 0) for n in evicted))  # stock's shadow is told
        self.beside.difference_update(evicted)
        return self.noting(decision)

    def within_limit(self, name: str, resident: AbstractSet[str], facts, choose: Callable) -> Decision:
        """`name`, on the device already, runs again: the others leave where its activations need their room (its
        limit is lower than the budget); `choose(policy, name, others, room)` keeps some of them."""
        others = [n for n in self.offloaded if n in resident and n != name]
        limit = self._limit(resident, facts, name)
        if limit is None or sum(held_bytes(self, n, facts) for n in [name] + others) <= limit:
            return NOTHING
        keep = choose(self, name, others, limit) if self.sizes[name] <= limit else set()
        evicted = [n for n in others if n not in keep]
        self.shadow.count(evicted=sum(self.sizes[n] for n in evicted))
        moves = [(OFFLOAD, n) for n in evicted]
        if self.sizes[name] <= limit or self.is_streaming(name):
            return Decision.of(moves)
        # Whole on the device, more than it may hold beside its activations: it streams within its limit instead.
        moves += [(OFFLOAD, name), (STREAM, name)]
        return self.noting(Decision.of(moves, Overflow(name, self.sizes[name], limit)))

    def within_budget(self, name: str, resident: AbstractSet[str], facts, choose: Callable) -> Decision:
        """`name`, on the device already, runs again with more than the budget on the device (moved there from outside:
        `pipe.to(device)`): the others leave (`choose` keeps what fits beside it), and where it is whole on the device,
        larger than the budget, and can stream within it, it streams instead. Reads no free memory: a hot path."""
        limit = self.avail
        if limit is None:
            return NOTHING
        others = [n for n in self.offloaded if n in resident and n != name]
        if sum(held_bytes(self, n, facts) for n in [name] + others) <= limit:
            return NOTHING
        held = held_bytes(self, name, facts)
        keep = choose(self, name, others, limit - held + self.sizes[name]) if held <= limit else set()
        evicted = [n for n in others if n not in keep]
        self.shadow.count(evicted=sum(self.sizes[n] for n in evicted))
        moves = [(OFFLOAD, n) for n in evicted]
        room = (facts.stream_rooms or {}).get(name)
        if held <= limit or room is None or room > limit:
            return Decision.of(moves)  # within the budget now, or it cannot stream in it: it runs alone
        moves += [(OFFLOAD, name), (STREAM, name)]
        return self.noting(Decision.of(moves, Overflow(name, self.sizes[name], limit)))
