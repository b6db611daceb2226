"""A session's `KEEP` move: a component keeping some of its blocks on the device (a stream started, its kept set grown
or shrunk in place, or one loaded whole that comes to keep only some). A function of the session, which owns the state
(`session.py`)."""

from __future__ import annotations


def keep(session, name: str, wanted) -> None:
    """Component `name` keeps the blocks `wanted` names (a `policies.Keep`): streaming from now on if it was not (one
    loaded whole keeps those blocks where they are, the others leave: `blocks/adopt.py`)."""
    module = session.modules[name]
    whole = name in session.resident and name not in session.streams.active
    if name not in session.streams.active and not whole:
        session._stop_others_streams(name)
    session.streams.keep(name, module, wanted, session.transfer, session.arming.fast.drops, whole=whole)
    session.placement.placed(module, True)
