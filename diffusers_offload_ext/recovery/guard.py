"""Out-of-memory recovery: a hooked component's forward (and a VAE's `encode`/`decode`) is guarded, so that a
`torch.OutOfMemoryError` raised inside it, or while it is loaded, is caught where the runtime can act. Its session
makes room, one rung of the policy's recovery at a time (the other resident components evicted, then this one
streamed in less and less room), and runs it again after each; at its smallest residency a second error propagates as
`OffloadOutOfMemoryError`, which says what was tried and what to change. The guard is around accelerate's forward,
so a load that runs out of memory (the transfer puts back what it moved) is caught as well.

Inference forwards of diffusers' models are pure, so running one again is safe. Where it may not be
(`retries.py`: a module in training mode with gradients on, an active dropout or a batch norm updating its running
statistics, a stateful diffusers hook, an argument that is not plain data, an input changed in place), the error
propagates as it is.
"""

from __future__ import annotations

import functools
import gc
from typing import List, Optional, Tuple

import torch
from diffusers.utils import logging

from ..constants import OFFLOAD
from ..marks import extension_hook
from ..policies import Decision
from ..units import format_size
from ..runtime import sharing
from .activations import describe
from ..blocks.streams import stream_room
from .measuring import held_bytes, make_room as carry_out_rung, recovered as learn
from .retries import not_retried, versions as _versions

logger = logging.get_logger(f"diffusers.{__name__}")

#: Methods that run a component and call its hook themselves (diffusers' `apply_forward_hook`: a VAE's).
GUARDED = ("encode", "decode")
#: Most rungs one recovery climbs (each ends at a smaller residency; this bounds it whatever happens).
MAX_RUNGS = 8

#: The guarded forwards running now, innermost last: `(session, component, module)`.
running: List[Tuple[object, str, torch.nn.Module]] = []


class OffloadOutOfMemoryError(torch.OutOfMemoryError):
    """The device ran out of memory in a component's forward and the offload could not make enough room: its message
    says what was tried (the components evicted, the room the component streamed in) and what to change."""


def guard(module: torch.nn.Module) -> None:
    """Guard `module`'s forward (accelerate's, which calls the hook's `pre_forward`: a load that runs out of memory is
    caught too; compiled in place, its compiled call instead, so that Dynamo meets no frame of ours inside it) and its
    `encode`/`decode` (which call the hook themselves); a component without a hook (excluded, under the residency
    manager), its own forward. Idempotent. Each guard keeps what code reads from the method it
    wraps (`_wrapped`): its signature, name and docstring. Accelerate's `remove_hook_from_module` puts the forward
    back; `unguard` takes the rest off."""
    compiled = module.__dict__.get("_compiled_call_impl")
    if compiled is not None:  # compiled in place: around the compiled call, where Dynamo never sees the guard's frame
        if not _guarded(compiled):
            module._compiled_call_impl = _wrapped(module, compiled)
        return _guard_methods(module)
    forward = module.__dict__.get("forward") or module.forward  # accelerate's; without a hook, its own
    if not _guarded(forward):
        module.forward = _wrapped(module, forward)
    _guard_methods(module)


def _wrapped(module: torch.nn.Module, call) -> functools.partial:
    """`call` run through the guard, looking like `call` to whoever inspects it: diffusers reads a forward's signature
    (`inspect.signature(vae.forward)`: does it take `num_frames`?), which `__wrapped__` leads to."""
    return functools.update_wrapper(functools.partial(_run, module, call), call)


def _guard_methods(module: torch.nn.Module) -> None:
    for method in GUARDED:
        bound = getattr(module, method, None)
        if callable(bound) and not _guarded(bound) and method not in module.__dict__:
            module.__dict__[method] = _wrapped(module, bound)


def unguard(module: torch.nn.Module) -> None:
    """Take the guard off `module`'s `encode`/`decode`, its compiled call and its own forward (its hook leaves, or
    offload is armed again)."""
    compiled = module.__dict__.get("_compiled_call_impl")
    if _guarded(compiled):
        module._compiled_call_impl = compiled.args[1]
    forward = module.__dict__.get("forward")
    if (
        _guarded(forward) and getattr(forward.args[1], "__self__", None) is module
    ):  # not accelerate's: it puts that back
        del module.__dict__["forward"]
    for method in GUARDED:
        if _guarded(module.__dict__.get(method)):
            del module.__dict__[method]


def _guarded(call) -> bool:
    return isinstance(call, functools.partial) and call.func is _run


def _holder(module: torch.nn.Module):
    """`(session, component)` that runs `module` now, or `(None, None)` where offload is not armed."""
    hook = extension_hook(getattr(module, "_hf_hook", None))
    session = getattr(hook, "session", None) if hook is not None else next(iter(sharing.holders(module)), None)
    if session is None or not session.active:
        return None, None
    if sharing.running and sharing.running[-1] is not session:
        session = sharing.running_holder(module) or session
    name = session.name_of(module)
    return (session, name) if name is not None else (None, None)


_disable = getattr(getattr(torch, "compiler", None), "disable", None)


def _skip_frame(fn):
    """Dynamo does not trace `fn`'s own frame (a compiled component's graph ends at its call) but compiles what it
    calls: the guarded forward."""
    try:
        return _disable(fn, recursive=False) if _disable is not None else fn
    except TypeError:  # a torch without `recursive`
        return fn


def _opaque(fn):
    """Dynamo never traces `fn` nor what it calls (the recovery's bookkeeping)."""
    return _disable(fn) if _disable is not None else fn


@_skip_frame
def _run(module: torch.nn.Module, call, *args, **kwargs):
    """Run `call` (a guarded forward of `module`); on an out-of-memory error make room and run it again."""
    attempt = _Attempt.enter(module, args, kwargs)
    if attempt is None:
        return call(*args, **kwargs)
    try:
        while True:
            try:
                result = call(*args, **kwargs)
            except torch.OutOfMemoryError as error:
                if not attempt.failed(error, args, kwargs):
                    raise
            else:
                attempt.completed()
                return result
            attempt.make_room()  # out of the `except`: the failed forward's frames, and their activations, are gone
    finally:
        attempt.leave()


class _Attempt:
    """One guarded call of a component: what was tried so far to make it fit (`_run` drives it)."""

    def __init__(self, session, name: str, module, versions) -> None:
        self.session, self.name, self.module, self.versions = session, name, module, versions
        self.tried: List[str] = []
        self.smallest: Optional[int] = None
        self.failed_held = 0
        self.decision: Optional[Decision] = None
        self.at_smallest = False

    @staticmethod
    @_opaque
    def enter(module, args, kwargs) -> Optional["_Attempt"]:
        """The attempt, or `None` where nothing is to be guarded: offload is not armed, or the call is nested in the
        module's own (a VAE's forward calls `decode`)."""
        if any(entry[2] is module for entry in running):
            return None
        session, name = _holder(module)
        if session is None:
            return None
        running.append((session, name, module))
        return _Attempt(session, name, module, _versions(args, kwargs))

    @_opaque
    def leave(self) -> None:
        running.pop()

    @_opaque
    def failed(self, error, args, kwargs) -> bool:
        """The call raised `error`: whether it may run again once room is made (the next rung is then chosen).
        Raises `OffloadOutOfMemoryError` when no rung is left."""
        nested = isinstance(error, OffloadOutOfMemoryError)  # a nested component already gave up
        why = "" if nested else not_retried(self.module, args, kwargs, self.versions)
        if why is not None:
            if why:
                logger.warning(f"`{self.name}` ran out of device memory and is not run again: {why}.")
            return False
        self.failed_held = self.failed_held or held_bytes(self.session)
        self.decision = rung(self.session, self.name, self.smallest) if len(self.tried) < MAX_RUNGS else None
        if self.decision is None or not self.decision.moves:
            if self.at_smallest or self.decision is None:  # a second error at the smallest residency
                raise OffloadOutOfMemoryError(final_message(self.session, self.name, self.tried, error)) from error
            self.at_smallest = True  # once more as it is, the memory freed given back to the device first
        return True

    @_opaque
    def make_room(self) -> None:
        gc.collect()
        step, self.smallest = make_room(self.session, self.name, self.decision, self.smallest)
        self.tried.append(step)

    @_opaque
    def completed(self) -> None:
        if self.tried:
            recovered(self.session, self.name, self.tried, self.failed_held)


def rung(session, name: str, smallest: Optional[int]) -> Decision:
    """The policy's next rung for component `name`, which ran out of device memory: what it holds on the device (no
    more than the `smallest` room it was already streamed in), the least room it can stream in, and the components
    whose forward is running (never evicted)."""
    choice = session.streams.choices.get(name)
    held = choice.device_bytes if choice is not None else session.facts.sizes[name]
    held = held if smallest is None else min(held, smallest)
    least = session.placement.stream_rooms.get(name) or stream_room(session.modules[name])
    return session.policy.on_out_of_memory(name, session.resident, session.facts, running_names(session), held, least)


def make_room(session, name: str, decision: Decision, smallest: Optional[int]) -> Tuple[str, Optional[int]]:
    """Carry out `decision` (`measuring.make_room`); returns what it did, in words, and the least room `name` was
    streamed in so far."""
    before = held_bytes(session)
    carry_out_rung(session, decision)
    if not decision.moves:
        return "gave the cached memory back to the device (nothing more could leave it)", smallest
    evicted = [n for direction, n in decision.moves if direction == OFFLOAD and n != name]
    if evicted:
        freed = format_size(max(before - held_bytes(session), 0))
        return f"evicted {', '.join(f'`{n}`' for n in evicted)} ({freed})", smallest
    room = decision.overflow.limit
    choice = session.streams.choices.get(name)
    if choice is None:
        return f"could not stream `{name}` in {format_size(room)}", room
    blocks = f"{len(choice.kept)} of {len(choice.kept) + len(choice.streamed)} blocks kept"
    return f"streamed `{name}` in {format_size(room)} ({blocks})", room


def recovered(session, name: str, tried: List[str], failed_held: int) -> None:
    """One log line per recovery, and the session learns from it."""
    learn(session, name, failed_held)
    limit = (
        f" From now on, calls of this shape keep at most {format_size(held_bytes(session))} of weights on the device "
        f"while `{name}` runs (`doe.offload_status(pipe).learnt`)."
        if hasattr(session.policy, "limit_while")
        else ""
    )
    logger.warning(
        f"`{name}` ran out of device memory on {session.device} ({describe(session.activations.shape)}); the offload "
        f"{'; then '.join(tried)}, and `{name}` ran again: it completed.{limit}"
    )


def running_names(session) -> Tuple[str, ...]:
    """The components of `session` whose guarded forward is running now (they must not be evicted)."""
    return tuple(name for holder, name, _ in running if holder is session)


def final_message(session, name: str, tried: List[str], error) -> str:
    """What was tried, and what to change, when no rung is left."""
    done = "; then ".join(tried) if tried else "found nothing it could do"
    stays = sorted(session.arrangement.excluded) if session.arrangement is not None else []
    kept = (
        f", leave {', '.join(f'`{n}`' for n in stays)} out of `exclude_from_offload` (they never leave the device)"
        if stays
        else ""
    )
    shape = describe(session.activations.shape)
    return (
        f"`{name}` ran out of device memory on {session.device} in a call of {shape}, and the offload could not "
        f"make enough room: it {done}; at its smallest residency it ran out again ({error}). The "
        f"activations of this call need more than the device has beside the weights it must hold. Make the call "
        f"smaller (height, width, frames, batch), let the VAE decode in tiles or slices (`pipe.vae.enable_tiling()`, "
        f"`pipe.vae.enable_slicing()`){kept}, or free device memory held elsewhere. A lower `memory_budget` does not "
        f"help: it caps weights only."
    )
