"""`PrefetchPolicy`: the residency manager, plus an onload of the component the call is predicted to run next,
issued while the current one runs, when the budget has room for both."""

from __future__ import annotations

from typing import AbstractSet, Optional

from ..constants import END, PREFETCH
from ..policies.base import Decision, Facts, apply
from ..blocks.kept_streams import held_bytes
from ..residency.policy import ResidencyPolicy


class PrefetchPolicy(ResidencyPolicy):
    """A `ResidencyPolicy` whose decision at each use also starts the onload of the next component predicted from the
    previous call, if it is offloaded, not on the device, and fits within the limit with everything on the device
    after this use. It is counted against the budget from then on, like any resident component.

    Which components move is unchanged when the prediction holds: the prefetched component would have been onloaded
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
        limit = self._limit(after, facts, name)
        if limit is not None and need + sum(held_bytes(self, n, facts) for n in self.offloaded if n in after) > limit:
            return decision
        self.shadow.count(onloaded=need)
        return Decision.of(decision.moves + ((PREFETCH, following),), decision.overflow)

    def _following(self, name: str) -> Optional[str]:
        """The first component other than `name` the rest of this call is predicted to run; `None` if none."""
        upcoming = self.forecaster.upcoming(self.calls.current, self.model, self.chain, True)
        for event in upcoming:
            if event == END:
                return None
            if event != name:
                return event
        return None
