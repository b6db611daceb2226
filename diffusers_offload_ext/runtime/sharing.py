"""Which sessions hold a module, and which pipeline calls are running, so that a module shared by several pipelines
is moved for the pipeline whose call uses it and recorded in that pipeline's ledger only."""

from __future__ import annotations

import weakref
from typing import List, Optional

import torch

_holders: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.WeakSet]" = weakref.WeakKeyDictionary()
#: Sessions with a pipeline call in progress, innermost last (one process-wide stack: calls nest, threads are not
#: supported).
running: List = []
#: Bumped whenever a session joins or leaves a module: what was derived from who holds what stays true until then.
changes = 0


def join(session, module: torch.nn.Module) -> None:
    """`session` holds `module` as one of its components."""
    global changes
    holders = _holders.get(module)
    if holders is None:
        holders = _holders[module] = weakref.WeakSet()
    holders.add(session)
    changes += 1


def leave(session, module: torch.nn.Module) -> None:
    global changes
    holders = _holders.get(module)
    if holders is not None:
        holders.discard(session)
    changes += 1


def shared(module: torch.nn.Module) -> bool:
    """Whether more than one session holds `module` (armed or not)."""
    holders = _holders.get(module)
    return holders is not None and len(holders) > 1


def holders(module: torch.nn.Module) -> List:
    """The active sessions that hold `module`."""
    found = _holders.get(module)
    return [s for s in found if s.active] if found is not None else []


def running_holder(module: torch.nn.Module) -> Optional[object]:
    """The innermost session with a call in progress that holds `module`, or `None`."""
    for session in reversed(running):
        if session.active and session.name_of(module) is not None:
            return session
    return None
