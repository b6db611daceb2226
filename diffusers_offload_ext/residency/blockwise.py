"""Residency block by block: when the offloaded components do not all fit the budget and their blocks are known
(`Facts.blocks`), the residency policy decides, at each use, which blocks every component keeps on the device.

Each component is a set of blocks (`block_sets.py`; one block where it cannot stream). The device holds the blocks
the predicted future needs soonest: exactly for the prediction up to `block_tables.MAX_BLOCKS` blocks in all, by
Belady's rule with roll-outs above (`belady.py`). Room is made by evicting the least valuable blocks, not whole
components: a kept block becomes streamed, a resident component that is not running may lose some of its blocks and
stream them at its next use, and a component that fits streams nothing. The decision is `KEEP` moves, each with the
blocks a component keeps (`Keep`), evictions first, so that the budget holds after every move.

A component that fits its room whole is loaded whole (one move, as component by component); loaded whole, it may later
keep only some of its blocks (the others leave, nothing is copied in again: `blocks/adopt.py`). Where
stock's chain fits the budget, a choice that could cost more than stock (dropping bytes stock holds, streaming a
component stock would hold whole) is made only while the bytes saved against stock cover it; otherwise the running
component is kept whole and what stock holds goes last.
"""

from __future__ import annotations

from typing import AbstractSet, Dict, FrozenSet, List, Mapping, Optional, Tuple

from ..constants import END, KEEP, OFFLOAD, ONLOAD, STREAM
from ..policies.base import Decision, Facts, Keep, Overflow
from ..units import format_size
from .belady import Chooser, next_use_words
from .prediction import chain_after
from .block_sets import MAX_BLOCKS, Spec, at_use, footprint, kept_bytes, ring_bytes, spec_of, use_cost

Kept = Dict[str, FrozenSet[str]]


def block_mode(policy, facts: Facts) -> bool:
    """Whether `policy` decides block by block now: blocks are known and its offloaded components do not all fit."""
    if policy.avail is None or not facts.blocks:  # without a budget first: a hot path (every hooked forward)
        return False
    return sum(policy.sizes[n] for n in policy.offloaded) > policy.avail


def specs_of(policy, facts: Facts, resident: AbstractSet[str]) -> Dict[str, Spec]:
    """Every offloaded component's blocks (one block for a component that cannot stream)."""
    return {name: spec_of(name, facts.blocks.get(name), policy.sizes[name]) for name in policy.offloaded}


def kept_now(policy, facts: Facts, resident: AbstractSet[str], specs: Mapping[str, Spec]) -> Kept:
    """The blocks each resident offloaded component keeps now (all of one loaded whole)."""
    streaming = facts.kept or {}
    kept = {}
    for name in policy.offloaded:
        if name in resident:
            kept[name] = frozenset(streaming[name][0]) if name in streaming else specs[name].keys
    return {name: blocks for name, blocks in kept.items() if blocks}


def use_in_blocks(policy, name: str, resident: AbstractSet[str], facts: Facts) -> Decision:
    """The residency policy's decision when `name` is about to run, block by block."""
    specs = specs_of(policy, facts, resident)
    kept = kept_now(policy, facts, resident, specs)
    room = policy._limit(resident, facts, name)
    upcoming = policy.forecaster.upcoming(policy.calls.current, policy.model, policy.chain, bool(policy.calls.history))
    new = _choose(policy, name, kept, specs, room, facts, upcoming)
    if new is None or _risk(policy, name, kept, new, specs) > 0:
        # Stock's way: `name` as whole as it can be, what stock holds kept before the rest.
        order = (name,) + tuple(n for n in policy.offloaded if n in policy.shadow.holds and n != name)
        safe = _chooser(policy, specs, facts).allocate(name, kept, {n: i for i, n in enumerate(order)}, room=room)
        if new is None or (
            safe is not None and _risk(policy, name, kept, safe, specs) < _risk(policy, name, kept, new, specs)
        ):
            new = safe
    if new is None:  # it cannot run in its room even alone: everything else goes, and it runs alone (with a warning)
        return _alone(policy, name, kept, specs, room, facts)
    _count(policy, name, kept, new, at_use(specs[name], _runs(facts).get(name, {}).get(_index(policy, name))), specs)
    return _decision(policy, name, kept, new, specs, facts, room, upcoming)


def held_after(policy, name: str, decision: Decision, after: AbstractSet[str], facts: Facts) -> int:
    """Bytes the offloaded components in `after` hold once `decision` (for the use of `name`) is carried out: the
    blocks each keeps (and the ring of `name` and of the streams that keep theirs), whole components at their size."""
    specs = specs_of(policy, facts, after)
    streaming, kept = facts.kept or {}, decision.kept or {}
    held = 0
    for n in policy.offloaded:
        if n not in after:
            continue
        if n in kept:
            held += kept_bytes(specs[n], kept[n].blocks) + (
                ring_bytes(specs[n], kept[n].blocks) if kept[n].ring else 0
            )
        elif n in streaming:
            held += kept_bytes(specs[n], streaming[n][0]) + streaming[n][1]
        else:
            held += specs[n].total
    return held


def _alone(policy, name: str, kept: Kept, specs: Mapping[str, Spec], room: int, facts: Facts) -> Decision:
    """`name` cannot run in `room` even alone: every other component is evicted and it runs whole, alone, over the
    budget (with a warning: `BlockStreams.begin`). One that keeps some of its blocks keeps them all (only the others
    are copied), one on the device whole stays so; otherwise it is asked to stream in the room, which the runtime
    cannot do, so it loads it whole."""
    moves: List[Tuple[str, str]] = [(OFFLOAD, n) for n in policy.offloaded if n in kept and n != name]
    spec, mine = specs[name], kept.get(name, frozenset())
    policy.shadow.count(onloaded=spec.total - kept_bytes(spec, mine))
    if name in (facts.kept or {}) and mine:
        why = f"all {len(spec.items)} blocks kept: it cannot stream in its room ({format_size(max(room, 0))})"
        return Decision.of(moves + [(KEEP, name)], None, {name: Keep(spec.keys, False, why)})
    if name in kept:  # whole on the device already: it runs so
        return Decision.of(moves)
    return Decision.of(moves + [(STREAM, name)], Overflow(name, spec.total, max(room, 0)))


def _chooser(policy, specs: Mapping[str, Spec], facts: Facts) -> Chooser:
    """The policy's `Chooser` for these blocks and rooms (kept, with what it remembers, while they stay the same)."""
    rooms, runs = _rooms(policy, specs, facts), _runs(facts)
    key = (tuple(specs.items()), tuple(sorted(rooms.items())), policy.keep_between, repr(sorted(runs.items())))
    chooser = policy.__dict__.get("_block_chooser")
    if chooser is None or chooser.key != key:
        chooser = Chooser(specs, rooms.__getitem__, policy.keep_between, runs)
        chooser.key = key
        policy.__dict__["_block_chooser"] = chooser
    return chooser


def _runs(facts: Facts) -> Dict[str, Dict[int, FrozenSet[str]]]:
    """`Facts.runs` as plain dicts (the blocks each use of a component runs, where learnt)."""
    return {
        name: {index: frozenset(blocks) for index, blocks in found.items()}
        for name, found in (facts.runs or {}).items()
    }


def _index(policy, name: str) -> int:
    """Which use of `name` in the call in progress this one is (0 for the first)."""
    return max(list(policy.calls.current).count(name) - 1, 0)


def _rooms(policy, specs: Mapping[str, Spec], facts: Facts) -> Dict[str, int]:
    """The room while each component runs: the budget, or less where its activations need more."""
    return {n: policy.within_own(policy.avail, n, facts) for n in specs}


def _choose(policy, name, kept: Kept, specs, room: int, facts: Facts, upcoming) -> Optional[Kept]:
    """Exact for a few blocks (in the room the tables were made for), Belady's rule with roll-outs otherwise."""
    names = [n for n in policy.offloaded if n in set(policy.model) | {name} | set(kept)]
    if sum(len(specs[n].items) for n in names) <= MAX_BLOCKS and not _guesses(policy, upcoming):
        from .block_tables import BlockUniverse  # numpy, only for the few blocks valued exactly

        chosen = {n: specs[n] for n in names}
        rooms = _rooms(policy, chosen, facts)
        if rooms[name] == room:
            forecaster = policy.block_forecaster
            runs = _runs(facts)
            if forecaster.universe is None or forecaster.universe.sizes != BlockUniverse.signature(
                chosen, rooms, runs
            ):
                forecaster.universe, forecaster.forecast = BlockUniverse(chosen, rooms, policy.avail, runs), None
            learned = bool(policy.calls.history)
            after = forecaster.values(policy.calls.current, policy.model, policy.chain, learned)
            return forecaster.universe.choose(name, kept, after, _index(policy, name))
    chooser = _chooser(policy, specs, facts)
    guesses = _guesses(policy, upcoming)
    return chooser.decide(name, kept, upcoming, room=room, guesses=guesses, done=policy.calls.current)


def _guesses(policy, upcoming) -> tuple:
    """On a first call (nothing learned yet), at a component not seen before in it: other guesses about the rest of
    the call, so that a wrong prediction costs little either way: a loop with the component before it
    (`Forecaster.first_call_events`: a preview decode between steps), and the component running again at once (a
    denoiser's steps)."""
    current = policy.calls.current
    if policy.calls.history or not current or current[-1] in current[:-1]:
        return ()
    name, tail = current[-1], [END] + (list(policy.chain) if policy.keep_between else [])
    guesses = list(policy.forecaster.first_call_events(current, policy.model, policy.chain) or ())
    guesses.append([name] * 8 + chain_after((name,), policy.chain))
    found = []
    for guess in guesses:
        events = list(guess) + tail
        if events != list(upcoming) and events not in found:
            found.append(events)
    return tuple(found)


def _risk(policy, name: str, kept: Kept, new: Kept, specs: Mapping[str, Spec]) -> int:
    """By how much keeping `new` may cost more than stock's chain, where stock fits the budget (0 or less: never):
    this use's copies, a reload of every byte stock holds that `new` does not (`name`'s streamed blocks too), and
    without zero-copy the copies of what is dropped now and of what is held beyond stock (stock paid for evicting
    those), less what was saved against stock so far (`StockShadow.credit`; `StockShadow.allows`, by blocks)."""
    shadow = policy.shadow
    if not shadow.fits:
        return 0
    holds = set(shadow.holds)
    risk = sum(specs[n].total - kept_bytes(specs[n], new.get(n, ())) for n in holds if n in specs)
    if not policy.zero_copy:
        risk += sum(kept_bytes(specs[n], blocks - new.get(n, frozenset())) for n, blocks in kept.items())
        risk += sum(kept_bytes(specs[n], blocks) for n, blocks in new.items() if n not in holds)
    # This use's copies are not counted in the credit yet.
    return risk + use_cost(specs[name], kept.get(name, ()), new[name]) - shadow.credit


def _count(policy, name: str, kept: Kept, new: Kept, spec: Spec, specs: Mapping[str, Spec]) -> None:
    """Tell the shadow of stock's chain what this use (`spec`: what it runs) copies and evicts."""
    dropped = sum(kept_bytes(specs[n], blocks - new.get(n, frozenset())) for n, blocks in kept.items() if n != name)
    policy.shadow.count(onloaded=use_cost(spec, kept.get(name, ()), new[name]), evicted=dropped)


def _decision(policy, name, kept: Kept, new: Kept, specs, facts: Facts, room: int, upcoming) -> Decision:
    """The moves from `kept` to `new` for the use of `name`: the others' evictions first (a stream's ring let go
    where the room is needed), then `name`'s own."""
    moves: List[Tuple[str, str]] = []
    keeps: Dict[str, Keep] = {}
    rings = {n: ring for n, (_, ring) in (facts.kept or {}).items() if ring and n != name}
    held = sum(kept_bytes(specs[n], blocks) for n, blocks in new.items() if n != name) + sum(rings.values())
    release = held + footprint(specs[name], new[name]) > room
    for other in policy.offloaded:
        if other == name or other not in kept:
            continue
        blocks = new.get(other, frozenset())
        if not blocks or not specs[other].streams:
            if blocks != kept[other]:
                moves.append((OFFLOAD, other))
            continue
        if blocks != kept[other] or (release and other in rings):
            moves.append((KEEP, other))
            keeps[other] = Keep(blocks, False, _why_evicted(specs[other], blocks, name, upcoming))
    spec, blocks = specs[name], new[name]
    streaming = (facts.kept or {}).get(name)
    if not spec.streams or (blocks == spec.keys and streaming is None):  # whole: loaded so (as without blocks)
        if name not in kept:
            moves.append((ONLOAD, name))
    else:
        ring = blocks != spec.keys
        if streaming is None or frozenset(streaming[0]) != blocks or bool(streaming[1]) != ring:
            moves.append((KEEP, name))
            keeps[name] = Keep(blocks, ring, _why_running(spec, blocks, room, new, name))
    return Decision.of(moves, None, keeps)


def _why_running(spec: Spec, blocks: FrozenSet[str], room: int, new: Kept, name: str) -> str:
    n, k = len(spec.items), len(blocks)
    if k == n:
        return f"all {n} blocks kept: it fits"
    beside = [other for other in new if other != name]
    where = f"beside {', '.join(f'`{o}`' for o in sorted(beside))}" if beside else "alone"
    return (
        f"{k} of {n} blocks kept ({format_size(kept_bytes(spec, blocks))}), {n - k} streamed: the most its room "
        f"{where} holds ({format_size(room)} with its ring)"
    )


def _why_evicted(spec: Spec, blocks: FrozenSet[str], name: str, upcoming) -> str:
    n, k = len(spec.items), len(blocks)
    return f"{k} of {n} blocks kept: {n - k} evicted to make room for `{name}` ({next_use_words(spec.name, upcoming)})"
