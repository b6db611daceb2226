"""`ReplayBook`: what a replay (`replay.py`) holds on the device, whole components and the kept blocks and ring of
the others, what it has learnt of the blocks each use runs, and the moves it books (pure Python)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Dict, List, NamedTuple, Optional, Set

from ..constants import COPY, DROP, KEEP, OFFLOAD, ONLOAD, STREAM
from ..residency.block_sets import at_use, kept_bytes, ring_bytes, spec_of, streamed_bytes


class ReplayedMove(NamedTuple):
    """One move of a replay, like a ledger record: `call` is `None` for moves made when offload was armed."""

    direction: str
    component: str
    nbytes: int
    kind: str
    call: Optional[int]


class ReplayBook:
    """The device of one replay, and its moves.

    Args:
        sizes, blocks, zero_copy, calls, runs: As `replay_trace` takes them (`calls` is the replay's tracker).
    """

    def __init__(self, sizes, blocks, zero_copy: bool, calls, runs=None) -> None:
        self.sizes, self.blocks, self.zero_copy, self.calls = sizes, blocks, zero_copy, calls
        self.runs = {
            name: found if isinstance(found, Mapping) else frozenset(found) for name, found in (runs or {}).items()
        }
        self.learned: Set[str] = set()  # components whose blocks that do not run the policy is told of
        self.streamed: Set[str] = set()  # those that ran keeping their blocks in the call in progress
        self.on_device: Set[str] = set()
        self.kept: dict = {}  # name -> (kept blocks, ring bytes) of a component keeping some of its blocks
        self.moves: List = []
        self.per_call: List[int] = []
        self.uses: Dict[str, int] = {}  # uses of each component in the call in progress

    # -- what runs ------------------------------------------------------------------------------------------------
    def runs_at(self, name: str, index: int) -> Optional[frozenset]:
        """The blocks use `index` of `name` runs (`None`: all of those marked as run)."""
        found = self.runs.get(name)
        if isinstance(found, Mapping):
            return frozenset(found[index]) if index in found else None
        return found

    def _union(self, name: str) -> Optional[frozenset]:
        found = self.runs.get(name)
        if isinstance(found, Mapping):
            return frozenset().union(*map(frozenset, found.values())) if found else None
        return found

    def facts(self):
        """`(Facts.blocks, Facts.runs)`: the blocks, those that do not run marked where that is learnt, and the
        blocks each use runs where uses differ."""
        if self.blocks is None or not self.learned:
            return self.blocks, None
        blocks, runs = {}, {}
        for name, items in self.blocks.items():
            union = self._union(name) if name in self.learned else None
            blocks[name] = (
                items if union is None else tuple(item._replace(uses=int(item.key in union)) for item in items)
            )
            if name in self.learned and isinstance(self.runs.get(name), Mapping):
                runs[name] = {index: frozenset(found) for index, found in self.runs[name].items()}
        return blocks, runs or None

    def learn(self) -> None:
        """A call ended: what the components that ran keeping their blocks ran is known from now on."""
        self.learned |= self.streamed
        self.streamed, self.uses = set(), {}

    def _spec(self, name: str):
        blocks, _ = self.facts()
        return spec_of(name, (blocks or {}).get(name), self.sizes[name])

    # -- moves ----------------------------------------------------------------------------------------------------
    def book(self, direction: str, name: str, nbytes: int, kind: str) -> None:
        self.moves.append(ReplayedMove(direction, name, nbytes, kind, self.calls.index))
        if kind in (COPY, STREAM) and self.calls.index is not None:
            self.per_call[self.calls.index] += nbytes

    def move(self, direction: str, name: str, keep) -> None:
        drop = DROP if self.zero_copy else COPY
        if direction == KEEP:
            spec = self._spec(name)
            before = (
                self.kept[name][0] if name in self.kept else (spec.keys if name in self.on_device else frozenset())
            )
            if before - keep.blocks:
                self.book(OFFLOAD, name, kept_bytes(spec, before - keep.blocks), drop)
            if keep.blocks - before:
                self.book(ONLOAD, name, kept_bytes(spec, keep.blocks - before), COPY)
            self.kept[name] = (frozenset(keep.blocks), ring_bytes(spec, keep.blocks) if keep.ring else 0)
            self.on_device.add(name)
        elif direction == OFFLOAD:
            held = self.kept.pop(name, None)
            nbytes = kept_bytes(self._spec(name), held[0]) if held is not None else self.sizes[name]
            self.book(OFFLOAD, name, nbytes, drop)
            self.on_device.discard(name)
        else:  # an onload (a stream modelled as one)
            self.kept.pop(name, None)
            self.book(ONLOAD, name, self.sizes[name], COPY)
            self.on_device.add(name)

    def passed(self, name: str) -> None:
        """`name` ran: where it keeps only some blocks, those this use runs and it does not keep crossed."""
        index = self.uses.get(name, 0)
        self.uses[name] = index + 1
        if name in self.kept:
            self.streamed.add(name)
            spec = at_use(spec_of(name, (self.blocks or {}).get(name), self.sizes[name]), self.runs_at(name, index))
            streamed = streamed_bytes(spec, self.kept[name][0])
            if streamed:
                self.book(ONLOAD, name, streamed, STREAM)

    # -- what it holds --------------------------------------------------------------------------------------------
    def held(self) -> int:
        total = 0
        for name in self.on_device:
            if name in self.kept:
                blocks, ring = self.kept[name]
                total += kept_bytes(self._spec(name), blocks) + ring
            else:
                total += self.sizes[name]
        return total

    def streaming(self) -> dict:
        return {n: kept_bytes(self._spec(n), blocks) + ring for n, (blocks, ring) in self.kept.items()}

    def kept_facts(self) -> dict:
        return {n: (blocks, ring) for n, (blocks, ring) in self.kept.items()}
