"""Prefetch as a policy's decision: `PrefetchPolicy`, the residency manager plus an onload of the component the call
is predicted to run next, issued while the current one runs, when the budget has room for both; and
`ChainPrefetchPolicy`, stock's chain (with its options) plus an onload of the next component of the chain, issued
while the current one runs, when the device's free memory holds it beside everything there."""

from __future__ import annotations

from typing import AbstractSet, Optional

from ..constants import END, PREFETCH
from ..policies.base import Decision, Facts, apply
from ..policies.chain import ChainPolicy
from ..blocks.kept_streams import held_bytes
from ..residency.blockwise import block_mode, held_after
from ..residency.policy import ResidencyPolicy


class PrefetchPolicy(ResidencyPolicy):
    """A `ResidencyPolicy` whose decision at each use also starts the onload of the next component predicted from the
    previous call, if it is offloaded, not on the device, and fits within the limit with everything on the device
    after this use. It is counted against the budget from then on, like any resident component.

    Block by block (`residency/blockwise.py`: the budget binds), the next component is prefetched whole where it
    fits beside the blocks the decision keeps; it is then whole on the device (it stays whole or leaves, as any
    component loaded whole). Which components move is unchanged when the prediction holds: the prefetched component would have been onloaded
    at its use without an eviction (it is the very next component to run, and it fits). When the call departs from
    the previous one, a prefetched component may be evicted unused: bytes that stock would not have moved. A first
    call has no prediction and prefetches nothing.
    """

    kind = "residency"

    @property
    def config(self) -> tuple:
        return super().config + (PREFETCH,)

    def on_use(self, name: str, resident: AbstractSet[str], facts: Facts) -> Decision:
        decision = super().on_use(name, resident, facts)
        if not self.calls.history:
            return decision
        after = set(resident)
        apply(decision.moves, after)
        following = self._following(name)
        if following is None or following in after or following not in self.hooked:
            return decision
        need = self.sizes[following]
        # The room is read from what is on the device now (the free memory read does not know of this use's onload
        # yet); the bytes that must fit are those after this use's moves, and the prefetched component.
        limit = self._limit(resident, facts, name)
        if block_mode(self, facts):  # what the decision leaves: kept blocks (the running one's ring too)
            held = held_after(self, name, decision, after, facts)
        else:
            held = sum(held_bytes(self, n, facts) for n in self.offloaded if n in after)
        if limit is not None and need + held > limit:
            return decision
        self.shadow.count(onloaded=need)
        return Decision.of(decision.moves + ((PREFETCH, following),), decision.overflow, decision.kept)

    def _following(self, name: str) -> Optional[str]:
        """The first component other than `name` the rest of this call is predicted to run; `None` if none."""
        upcoming = self.forecaster.upcoming(self.calls.current, self.model, self.chain, True)
        for event in upcoming:
            if event == END:
                return None
            if event != name:
                return event
        return None


class ChainPrefetchPolicy(ChainPolicy):
    """`ChainPolicy` (stock's chain, `exclude_from_offload`, `keep_on_device_during_generation`) whose decision when a
    component runs also starts the onload of the next offloaded component of `model_cpu_offload_seq` after it, if it
    is not on the device and the device's free memory holds it beside everything there now, `memory_reserve` left
    for activations (`Facts.capacity`; where free memory cannot be read, the device counts as unlimited, as for the
    automatic budget). Every component still runs where the chain puts it, and every eviction is the chain's: the
    prefetched one arrives earlier, that is all (the ledger's `kind` is `"prefetch"` for that onload). A component the
    call does not run after all (a call that ends early) goes back at the call's end, as every offloaded one.
    """

    kind = "chain"

    def __init__(self, **arguments) -> None:
        super().__init__(**arguments)
        self.following = {earlier: later for later, earlier in self.previous.items()}

    def on_use(self, name: str, resident: AbstractSet[str], facts: Optional[Facts] = None) -> Decision:
        decision = super().on_use(name, resident, facts)
        following = self._following(name)
        if following is None:
            return decision
        after = set(resident)
        apply(decision.moves, after)
        if following in after or not self._fits(following, resident, after, facts):
            return decision
        return Decision.of(decision.moves + ((PREFETCH, following),), decision.overflow)

    def _following(self, name: str) -> Optional[str]:
        """The next component of the chain after `name` that the chain moves (excluded ones stay: passed over)."""
        seen, following = {name}, self.following.get(name)
        while following is not None and following in self.excluded and following not in seen:
            seen.add(following)
            following = self.following.get(following)
        return following if following in self.hooked and following not in self.excluded else None

    @staticmethod
    def _fits(name: str, resident: AbstractSet[str], after: AbstractSet[str], facts: Optional[Facts]) -> bool:
        """Whether `name` fits beside the components on the device after this use's moves (`after`), in the room
        for weights the device has now (free memory read with `resident` on the device, less the reserve)."""
        if facts is None or facts.capacity is None:
            return True
        room = facts.capacity(sum(facts.sizes[n] for n in resident))
        return room is None or sum(facts.sizes[n] for n in after) + facts.sizes[name] <= room
