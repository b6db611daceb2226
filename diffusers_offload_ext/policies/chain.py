"""`ChainPolicy`: stock diffusers' chain of offload hooks, plus `exclude_from_offload` and
`keep_on_device_during_generation`."""

from __future__ import annotations

from typing import AbstractSet, Dict, Iterable, Optional, Sequence, Union

from ..constants import OFFLOAD, ONLOAD
from ..layout import PipelineLayout
from .base import NOTHING, Decision, Facts, Policy


class ChainPolicy(Policy):
    """Stock's chain: when a chained component runs, its predecessor in the chain is evicted; at the end of a call
    everything goes back to the host. Excluded components stay on the device; kept ones are never evicted mid-call.

    Args:
        order (`Sequence[str]`): Every module component, in the pipeline's order (end-of-call moves follow it).
        chain (`Sequence[str]`): The hooked components of `model_cpu_offload_seq`, in chain order.
        hooked (`Iterable[str]`): Every component that has an offload hook (the chain and those outside it).
        excluded (`Iterable[str]`, defaults to `()`): `exclude_from_offload`: on the device once, never moved again.
        round_trip (`Iterable[str]`, defaults to `()`): The class's `_exclude_from_cpu_offload` components that the
            user did not exclude: like stock, they go to the host and back up whenever offload is armed.
        kept (`Iterable[str]`, defaults to `()`): `keep_on_device_during_generation`: the chain never evicts them.
    """

    def __init__(
        self,
        *,
        order: Sequence[str],
        chain: Sequence[str],
        hooked: Iterable[str],
        excluded: Iterable[str] = (),
        round_trip: Iterable[str] = (),
        kept: Iterable[str] = (),
    ) -> None:
        self.order = tuple(order)
        self.chain = tuple(chain)
        self.hooked = frozenset(hooked)
        self.excluded = frozenset(excluded)
        self.round_trip = frozenset(round_trip)
        self.kept = frozenset(kept)
        self.stays = self.excluded
        self.previous: Dict[str, str] = {later: earlier for earlier, later in zip(self.chain, self.chain[1:])}

    @classmethod
    def for_layout(
        cls, layout: PipelineLayout, *, excluded: Iterable[str] = (), keep: Union[bool, Iterable[str], None] = None
    ) -> "ChainPolicy":
        """The policy `enable_model_cpu_offload(exclude_from_offload=excluded, keep_on_device_during_generation=keep)`
        arms on a pipeline with this layout."""
        arranged = layout.arrange(excluded)
        if keep is True:
            kept = arranged.hooked
        else:
            kept = [n for n in (keep or ()) if n in arranged.hooked]
        return cls(
            order=layout.order,
            chain=arranged.chain,
            hooked=arranged.hooked,
            excluded=arranged.excluded,
            round_trip=arranged.round_trip,
            kept=kept,
        )

    def on_use(self, name: str, resident: AbstractSet[str], facts: Optional[Facts] = None) -> Decision:
        before = self.previous.get(name)
        evict = before is not None and before in resident and before not in self.kept
        if not evict and name in resident:
            return NOTHING
        moves = [(OFFLOAD, before)] if evict else []
        if name not in resident:
            moves.append((ONLOAD, name))
        return Decision.of(moves)

    def on_offload_request(self, name: str, resident: AbstractSet[str], facts: Optional[Facts] = None) -> Decision:
        if name in resident and name not in self.kept and name not in self.excluded:
            return Decision.of([(OFFLOAD, name)])
        return NOTHING

    def on_enable(self, resident: AbstractSet[str], facts: Optional[Facts] = None) -> Decision:
        moves = [(OFFLOAD, n) for n in self.order if n in resident and n not in self.excluded]
        moves += [(ONLOAD, n) for n in self.order if n in self.round_trip]
        moves += [(ONLOAD, n) for n in self.order if n in self.excluded and n not in resident]
        return Decision.of(moves)
