"""What a session's calls need beyond the weights, as the runtime sees it: the next call's shape and its measuring,
the bytes of weights a session holds on the device, a rung of an out-of-memory recovery carried out (its moves
marked in the ledger) and what a recovery taught (`activations.py` keeps it, the policy's component limits follow)."""

from __future__ import annotations

import contextlib

import torch
from diffusers.utils import logging

from ..constants import OUT_OF_MEMORY
from ..policies import Decision
from ..transfer import memory
from ..runtime import sharing

logger = logging.get_logger(f"diffusers.{__name__}")


def expect(session, shape) -> None:
    """The next pipeline call of `session` has `shape` (`activations.call_shape`): its budget is chosen for it, and
    what it needs beyond the weights is measured from now on where the device tells."""
    if not session.calls.in_call:
        session.activations.expect(shape)
        if session.active:
            session.activations.begin(session.device, held_bytes(session))


def held_bytes(session) -> int:
    """Bytes of `session`'s weights on the device (of a streaming component, its kept blocks and ring)."""
    choices, sizes = session.streams.choices, session.facts.sizes
    return sum(choices[n].device_bytes if n in choices else sizes[n] for n in session.resident)


def make_room(session, decision: Decision) -> None:
    """Carry out a rung of an out-of-memory recovery (`recovery.py`), each move recorded with cause
    `"out-of-memory"` (a move that runs out of memory itself ends the rung), then give what it freed back."""
    session.activations.close(session.device)
    with contextlib.ExitStack() as causes:
        # The ledger that books a move of a shared component may be another running call's (`session._booker`).
        for recorder in {id(s.recorder): s.recorder for s in [session] + sharing.running}.values():
            causes.enter_context(recorder.caused(OUT_OF_MEMORY))
        session.streams.settle()
        try:
            session.carry_out(decision)
        except torch.OutOfMemoryError:
            logger.debug("A rung of an out-of-memory recovery ran out of device memory itself.")
    memory.release_cached(session.device)
    session.activations.open(session.device, held_bytes(session))


def recovered(session, name: str, failed_held: int) -> None:
    """Component `name` ran again after an out-of-memory error (with `failed_held` bytes of weights on the device
    when it failed) and completed: what the device holds now fitted beside its activations. The call shape learns it,
    and the residency manager allows no more while `name` runs, from now on (the explicit `memory_budget` stays the
    cap)."""
    held = held_bytes(session)
    allowed = getattr(session.policy, "allowed", lambda _: None)(name)
    session.activations.recovered(name, held, within=allowed is None or failed_held <= allowed)
    if hasattr(session.policy, "limit_while"):
        session.policy.limit_while(name, held)
