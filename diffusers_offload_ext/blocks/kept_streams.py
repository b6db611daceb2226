"""What a component that streams its blocks holds while it stays resident (in a call, and between calls with
`keep_on_device_between_generations`): the bytes the residency policy counts for it (`Facts.streaming`: its kept
blocks and ring, not its size), and whether it stays when another component must be loaded beside it."""

from __future__ import annotations

from typing import AbstractSet, Callable, List, Optional, Set

from ..policies.base import Facts


def held_bytes(policy, name: str, facts: Facts) -> int:
    """Bytes resident component `name` holds on the device: its size, or, while it streams, its kept blocks and
    ring (`Facts.streaming`)."""
    streaming = facts.streaming
    return int(streaming[name]) if streaming is not None and name in streaming else policy.sizes[name]


def around_streams(policy, name: str, others: List[str], limit: Optional[int], facts: Facts):
    """`(evicted, others, limit)` for loading `name` beside the resident components `others`: where some of them
    stream (kept between calls, or beside the others), they stay when `name` fits in the room they leave, and `name`
    is then placed among the whole ones within it (`limit` less their bytes); else they are evicted first and it is
    placed within the whole `limit`."""
    streams = [n for n in others if facts.streaming is not None and n in facts.streaming]
    if limit is None or not streams:
        return [], others, limit
    wholes = [n for n in others if n not in streams]
    held = sum(held_bytes(policy, n, facts) for n in streams)
    if policy.sizes[name] <= limit - held:
        return [], wholes, limit - held
    policy.shadow.count(evicted=held)
    return streams, wholes, limit


def staying(policy, others: List[str], facts: Facts, choose: Callable) -> Set[str]:
    """At a call's end (components kept between calls), which of the resident `others` stay within the budget: all
    where they fit, a stream at the bytes it holds; else the streams go first, and `choose(policy, None, whole ones,
    room)` picks among the others."""
    avail = policy.avail
    if avail is None or sum(held_bytes(policy, n, facts) for n in others) <= avail:
        return set(others)
    wholes = [n for n in others if facts.streaming is None or n not in facts.streaming]
    return set(wholes) if sum(policy.sizes[n] for n in wholes) <= avail else choose(policy, None, wholes, avail)


def carry(policy, name: str, resident: AbstractSet[str]) -> None:
    """`name` runs: where it streamed beside the others in an earlier call and stayed (`policy.carried`), this is its
    one use in this call (`policy.beside`: a second use loads it whole)."""
    if name in policy.carried:
        policy.carried.discard(name)
        if name in resident:
            policy.beside.add(name)
