"""`ChainPolicy`: stock diffusers' chain of offload hooks, plus `exclude_from_offload` and
`keep_on_device_during_generation`."""

from __future__ import annotations

from typing import AbstractSet, Dict, Iterable, Optional, Sequence, Union

from ..constants import OFFLOAD, ONLOAD
from ..layout import PipelineLayout
from .base import NOTHING, Decision, Facts, Policy


class ChainPolicy(Policy):
    """Stock's chain: when a chained component runs, its predecessor in the chain is evicted; at the end of a call
    everything goes back to the host. Excluded components stay on the device, and an excluded component of
    `model_cpu_offload_seq` still evicts its predecessor when it runs, where stock's would; kept ones are never
    evicted mid-call.

    Args:
        order (`Sequence[str]`): Every module component, in the pipeline's order (end-of-call moves follow it).
        chain (`Sequence[str]`): The hooked components of `model_cpu_offload_seq`, in chain order.
        hooked (`Iterable[str]`): Every component that has an offload hook (the chain and those outside it).
        excluded (`Iterable[str]`, defaults to `()`): `exclude_from_offload`: on the device once, never moved again.
        round_trip (`Iterable[str]`, defaults to `()`): The class's `_exclude_from_cpu_offload` components outside
            the chain: no hook, on the device.
        kept (`Iterable[str]`, defaults to `()`): `keep_on_device_during_generation`: the chain never evicts them.
        sequence (`Sequence[str]`, *optional*): The components of `model_cpu_offload_seq` that are present, excluded
            ones included, in order: each one's predecessor in it is the one it evicts. Defaults to `chain`.

    The excluded components are `watched`: the runtime reports their use, and one evicts its predecessor in
    `sequence`. With components excluded, arming moves the class's exclusions (`round_trip`) only onto the device, as
    the patched diffusers does (its hooks move the models); with none, down and up again, as stock's `pipe.to("cpu")`.
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
        sequence: Optional[Sequence[str]] = None,
    ) -> None:
        self.order = tuple(order)
        self.chain = tuple(chain)
        self.hooked = frozenset(hooked)
        self.excluded = frozenset(excluded)
        self.round_trip = frozenset(round_trip)
        self.kept = frozenset(kept)
        self.stays = self.excluded
        self.watched = self.excluded
        sequence = self.chain if sequence is None else tuple(sequence)
        self.previous: Dict[str, str] = {later: earlier for earlier, later in zip(sequence, sequence[1:])}

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
            sequence=tuple(n for n in dict.fromkeys(layout.sequence) if n in layout.order),
            chain=arranged.chain,
            hooked=arranged.hooked,
            excluded=arranged.excluded,
            round_trip=arranged.round_trip,
            kept=kept,
        )

    def on_use(self, name: str, resident: AbstractSet[str], facts: Optional[Facts] = None) -> Decision:
        before = self.previous.get(name)
        evict = before in resident and before not in self.kept and before not in self.excluded
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
        held = (self.excluded | self.round_trip) if self.excluded else frozenset()
        moves = [(OFFLOAD, n) for n in self.order if n in resident and n not in held]
        moves += [(ONLOAD, n) for n in self.order if n in self.round_trip and (n not in resident or n not in held)]
        moves += [(ONLOAD, n) for n in self.order if n in self.excluded and n not in resident]
        return Decision.of(moves)
