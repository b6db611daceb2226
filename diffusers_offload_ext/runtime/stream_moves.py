"""The moves of a session's streaming components: a component keeping some of its blocks (`KEEP`), a stream stopped
by a move or at a call's end, and a stream another pipeline sharing the component keeps. Functions of the session,
which owns the state (`session.py`)."""

from __future__ import annotations

from ..constants import OFFLOAD, ONLOAD
from . import sharing


def keep(session, name: str, wanted) -> None:
    """Component `name` keeps the blocks `wanted` names (a `policies.Keep`): streaming from now on if it was not (one
    loaded whole keeps those blocks where they are, the others leave: `blocks/adopt.py`)."""
    module = session.modules[name]
    whole = name in session.resident and name not in session.streams.active
    if name not in session.streams.active and not whole:
        stop_others_streams(session, name)
    session.streams.keep(name, module, wanted, session.transfer, session.options.drops, whole=whole)
    session.placement.placed(module, True)


def stream(session, name: str, overflow) -> None:
    """Component `name` runs block by block within `overflow.limit` bytes (`STREAM`); where it cannot, it is loaded
    whole, alone (with a warning: `BlockStreams.begin`)."""
    module = session.modules[name]
    if session.streams.begin(name, module, overflow, session.transfer, session.options.drops):
        session.placement.placed(module, True)
    else:
        session.move(name, ONLOAD)


def end_streams(session, failed: bool) -> None:
    """A call ends: streams stop, unless components stay between calls; then their rings are emptied, and those that
    would keep other blocks now (`BlockStreams.replanned`; not after a failed call) stop, to start again."""
    if not session.options.keep_between:
        session.stop_streams()
        return
    session.streams.settle()
    for name in [] if failed else session.streams.replanned():
        session.move(name, OFFLOAD)


def stop_stream(session, name: str, direction: str) -> None:
    """`name` streams for `session`: an onload leaves it so (it runs on the device already, block by block); any other
    move stops the stream (each block's move is in the ledger)."""
    if direction != ONLOAD:
        session.streams.stop(name, session.transfer)
        session.placement.placed(session.modules[name], False)


def stop_others_streams(session, name: str) -> bool:
    """`session` runs or moves its component `name`: where another pipeline sharing it keeps it streaming, that stream
    stops first (into that pipeline's ledger), and `session` places it by its own policy. Whether one stopped."""
    if name in session.streams.active:
        return False
    module, stopped = session.modules[name], False
    for other in sharing.holders(module):
        theirs = other.name_of(module) if other is not session else None
        if theirs is not None and theirs in other.streams.active:
            other.streams.unlearn(theirs)  # not a pass of its own calls: its plan stays
            other.move(theirs, OFFLOAD)
            stopped = True
    return stopped
