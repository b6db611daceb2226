"""The one replay: drive a policy over a recorded trace exactly as the runtime drives it over real calls (offload
armed, then per call: call start, each use, the end-of-call offload), and count what moved.

The planner, the benchmarks, the tracer's replays of stock offload on the CPU and the tests all use it, so that a
prediction and the real ledger come from the same code.
"""

from __future__ import annotations

from typing import Callable, Iterable, List, Mapping, NamedTuple, Optional, Set, Tuple

from ..calls import CallTracker
from ..constants import COPY, END, ONLOAD, STREAM
from .base import Decision, Facts
from .replay_book import ReplayBook, ReplayedMove


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
            modelled as an onload of the whole component, exact for a component that runs once while it streams (a text
            encoder); a denoiser streamed at every step moves more.
        blocks (`Mapping[str, tuple]`, *optional*): The blocks of each component that can stream (`Facts.blocks`):
            a residency policy then decides block by block (`KEEP` moves), booked as the runtime moves them: each
            newly kept block copied once, each dropped one released, and at every use of a component that keeps
            only some of its blocks, the blocks it runs and does not keep (a move of kind `STREAM`).
        runs (`Mapping`, *optional*): The blocks a use of a component runs, where not all do: for each component,
            the blocks every use runs (a VAE that only decodes runs no encoder block), or a mapping from the index of
            the use in its call to the blocks it runs (an image-to-image VAE encodes, then decodes). As the runtime
            learns it, the policy is told so (`Item.uses`, `Facts.runs`) from the end of the first call in which the
            component ran keeping its blocks.
        check (`Callable`, *optional*): Called after every event with the event (`None` for arming, a component name
            or `END`), the resident set after it, and the decision (tests check invariants with it).

    Returns:
        `Replay`: the moves, bytes per call, and the peak (a component keeping some blocks counted at them and its
        ring while held).
    """
    calls = policy.calls if policy.calls is not None else CallTracker()
    book = ReplayBook(sizes, blocks, zero_copy, calls, runs)
    on_device, moves, per_call = book.on_device, book.moves, book.per_call
    on_device.update(resident or ())
    peak = [book.held()]

    def facts() -> Facts:
        blocks_known, runs_known = book.facts()
        return Facts(
            sizes,
            stream_rooms=stream_rooms,
            streaming=book.streaming(),
            blocks=blocks_known,
            kept=book.kept_facts(),
            runs=runs_known,
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


def replay(policy, trace: Iterable[str], sizes: Mapping[str, int], resident=None) -> List[Tuple[str, str, int]]:
    """The moves `policy` makes on `trace`: `(direction, component, nbytes)` in order (see `replay_trace`)."""
    return replay_trace(policy, trace, sizes, resident=resident).triples()
