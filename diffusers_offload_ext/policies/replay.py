"""The one replay: drive a policy over a recorded trace exactly as the runtime drives it over real calls (offload
armed, then per call: call start, each use, the end-of-call offload), and count what moved.

The planner, the benchmarks, the tracer's replays of stock offload on the CPU and the tests all use it, so that a
prediction and the real ledger come from the same code.
"""

from __future__ import annotations

from typing import Callable, Iterable, List, Mapping, NamedTuple, Optional, Set, Tuple

from ..calls import CallTracker
from ..constants import COPY, DROP, END, KEEP, OFFLOAD, ONLOAD, STREAM
from ..residency.block_sets import kept_bytes, ring_bytes, spec_of, streamed_bytes
from .base import Decision, Facts


class ReplayedMove(NamedTuple):
    """One move of a replay, like a ledger record: `call` is `None` for moves made when offload was armed."""

    direction: str
    component: str
    nbytes: int
    kind: str
    call: Optional[int]


class Replay(NamedTuple):
    """Result of `replay_trace`.

    Args:
        moves (`List[ReplayedMove]`): Every move, in order.
        setup (`int`): Bytes that crossed the bus when offload was armed, before the first call.
        per_call (`List[int]`): Bytes that crossed the bus in each call (onloads, and offloads that copied).
        peak (`int`): Most bytes of weights on the device at once.
    """

    moves: List[ReplayedMove]
    setup: int
    per_call: List[int]
    peak: int

    @property
    def copied(self) -> int:
        """Bytes that crossed the bus in all (streamed blocks included)."""
        return sum(m.nbytes for m in self.moves if m.kind in (COPY, STREAM))

    @property
    def onloaded(self) -> int:
        """Host-to-device bytes in all."""
        return sum(m.nbytes for m in self.moves if m.direction == ONLOAD)

    def triples(self) -> List[Tuple[str, str, int]]:
        """`(direction, component, nbytes)` of every move."""
        return [(m.direction, m.component, m.nbytes) for m in self.moves]


def replay_trace(
    policy,
    trace: Iterable[str],
    sizes: Mapping[str, int],
    *,
    zero_copy: bool = False,
    resident: Optional[Iterable[str]] = None,
    check: Optional[Callable[[Optional[str], Set[str], Decision], None]] = None,
    stream_rooms: Optional[Mapping[str, int]] = None,
    blocks: Optional[Mapping[str, tuple]] = None,
    runs: Optional[Mapping[str, Iterable[str]]] = None,
) -> Replay:
    """Replay `trace` (component names, `END` after each call) through `policy`.

    Args:
        policy (`Policy`): The policy; if it reads a `CallTracker` (`policy.calls`), the replay drives that one.
        trace (`Iterable[str]`): Hooked components in the order they ran; `END` marks the end of each call.
        sizes (`Mapping[str, int]`): Bytes of each component.
        zero_copy (`bool`, defaults to `False`): Evictions only drop the device copy (the weights never change in a
            replay), as the runtime does with zero-copy eviction.
        resident (`Iterable[str]`, *optional*): Components on the device before the trace. When not given, the trace
            starts with offload being armed on an all-on-host pipeline, and that arm's moves are counted.
        stream_rooms (`Mapping[str, int]`, *optional*): The fewest bytes each component can stream its blocks in
            (`Facts.stream_rooms`; the runtime measures them with `blocks.streams.stream_room`). A `STREAM` move is
            modelled as an onload of the whole component, exact for a component that runs once while it streams.
        blocks (`Mapping[str, tuple]`, *optional*): The blocks of each component that can stream (`Facts.blocks`):
            a residency policy then decides block by block (`KEEP` moves), booked as the runtime moves them: each
            newly kept block copied once, each dropped one released, and at every use of a component that keeps
            only some of its blocks, the blocks it runs and does not keep (a move of kind `STREAM`).
        runs (`Mapping[str, Iterable[str]]`, *optional*): The blocks a use of a component runs, where not all do (a
            VAE that only decodes runs no encoder block). As the runtime learns it, the policy is told so (those
            blocks' `Item.uses` 0) from the end of the first call in which the component ran keeping its blocks.
        check (`Callable`, *optional*): Called after every event with the event (`None` for arming, a component name
            or `END`), the resident set after it, and the decision (tests check invariants with it).

    Returns:
        `Replay`: the moves, bytes per call, and the peak (a component keeping some blocks counted at them and its
        ring while held).
    """
    calls = policy.calls if policy.calls is not None else CallTracker()
    book = _Book(sizes, blocks, zero_copy, calls, runs)
    on_device, moves, per_call = book.on_device, book.moves, book.per_call
    on_device.update(resident or ())
    peak = [book.held()]

    def facts() -> Facts:
        return Facts(
            sizes, stream_rooms=stream_rooms, streaming=book.streaming(), blocks=book.facts(), kept=book.kept_facts()
        )

    def run(decision, event) -> None:
        for direction, name in decision.moves:
            book.move(direction, name, (decision.kept or {}).get(name))
        if event is not None and event != END:
            book.passed(event)
        peak[0] = max(peak[0], book.held())
        if check is not None:
            check(event, set(on_device), decision)

    if resident is None:
        run(policy.on_enable(set(on_device), facts()), None)
    setup = sum(m.nbytes for m in moves if m.kind == COPY)
    for event in trace:
        if not calls.in_call:
            calls.begin()
            per_call.append(0)
            run(policy.on_call_start(calls), None)
        if event == END:
            calls.end_trace()
            book.learn()
            run(policy.on_call_end(set(on_device), facts()), END)
            calls.end()
        else:
            calls.use(event)
            run(policy.on_use(event, set(on_device), facts()), event)
    return Replay(moves, setup, per_call, peak[0])


class _Book:
    """What a replay holds on the device (whole components, and the kept blocks and ring of the others) and books."""

    def __init__(self, sizes, blocks, zero_copy: bool, calls, runs=None) -> None:
        self.sizes, self.blocks, self.zero_copy, self.calls = sizes, blocks, zero_copy, calls
        self.runs = {name: frozenset(keys) for name, keys in (runs or {}).items()}
        self.learned: Set[str] = set()  # components whose blocks that do not run the policy is told of
        self.streamed: Set[str] = set()  # those that ran keeping their blocks in the call in progress
        self.on_device: Set[str] = set()
        self.kept: dict = {}  # name -> (kept blocks, ring bytes) of a component keeping some of its blocks
        self.moves: List[ReplayedMove] = []
        self.per_call: List[int] = []

    def facts(self):
        """`Facts.blocks`: the blocks, those that do not run marked where that is learned."""
        if self.blocks is None or not self.learned:
            return self.blocks
        return {
            name: (
                tuple(item._replace(uses=int(item.key in self.runs[name])) for item in items)
                if name in self.learned and name in self.runs
                else items
            )
            for name, items in self.blocks.items()
        }

    def learn(self) -> None:
        """A call ended: what the components that ran keeping their blocks ran is known from now on."""
        self.learned |= self.streamed
        self.streamed = set()

    def _spec(self, name: str):
        runs = self.runs.get(name) if name in self.learned else None
        blocks = (self.blocks or {}).get(name)
        if runs is not None and blocks:
            blocks = tuple(item._replace(uses=int(item.key in runs)) for item in blocks)
        return spec_of(name, blocks, self.sizes[name])

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
            if held is not None:
                self.book(OFFLOAD, name, kept_bytes(self._spec(name), held[0]), drop)
            else:
                self.book(OFFLOAD, name, self.sizes[name], drop)
            self.on_device.discard(name)
        else:  # an onload (a stream modelled as one)
            self.kept.pop(name, None)
            self.book(ONLOAD, name, self.sizes[name], COPY)
            self.on_device.add(name)

    def passed(self, name: str) -> None:
        """`name` ran: where it keeps only some blocks, those it runs and does not keep crossed."""
        if name in self.kept:
            self.streamed.add(name)
            runs = self.runs.get(name)  # what it really runs, whatever the policy knows
            spec = spec_of(name, (self.blocks or {}).get(name), self.sizes[name])
            if runs is not None:
                spec = spec._replace(items=tuple(item._replace(uses=int(item.key in runs)) for item in spec.items))
            streamed = streamed_bytes(spec, self.kept[name][0])
            if streamed:
                self.book(ONLOAD, name, streamed, STREAM)

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


def replay(policy, trace: Iterable[str], sizes: Mapping[str, int], resident=None) -> List[Tuple[str, str, int]]:
    """The moves `policy` makes on `trace`: `(direction, component, nbytes)` in order (see `replay_trace`)."""
    return replay_trace(policy, trace, sizes, resident=resident).triples()
