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
from ..runtime.compiler import eager, frame_callback, own_frame_skipped
from ..runtime.inputs import snapshot
from .activations import describe
from ..blocks.streams import RECOVERY_DEPTHS, stream_room
from .retries import not_retried

logger = logging.get_logger(f"diffusers.{__name__}")

#: Methods that run a component and call its hook themselves (diffusers' `apply_forward_hook`: a VAE's).
GUARDED = ("encode", "decode")
#: Most rungs one recovery climbs (each ends at a smaller residency; this bounds it whatever happens).
MAX_RUNGS = 8

#: The guarded calls running now, innermost last: `[module, inputs]`, `inputs` being its input tensors' version
#: counters (`runtime/inputs.py`), read by the module's hook as it reads the inputs (by the guard itself for
#: `encode`/`decode`, whose hook sees none), or `None` before that (a load that failed: the forward never ran).
running: List[list] = []


class OffloadOutOfMemoryError(torch.OutOfMemoryError):
    """The device ran out of memory in a component's forward and the offload could not make enough room: its message
    says what was tried (the components evicted, the room the component streamed in) and what to change."""


def guard(module: torch.nn.Module) -> None:
    """Guard `module`'s forward (accelerate's, which calls the hook's `pre_forward`: a load that runs out of memory is
    caught too; compiled in place, its compiled call instead, so that Dynamo meets no frame of ours inside it) and its
    `encode`/`decode` (which call the hook themselves); a component without a hook (excluded, under the residency
    manager), its own forward. Idempotent. Each guard keeps what code reads from the method it wraps (`_guarding`):
    its signature, name and docstring. Accelerate's `remove_hook_from_module` puts the forward back; `unguard` takes
    the rest off."""
    compiled = module.__dict__.get("_compiled_call_impl")
    if compiled is not None:  # compiled in place: around the compiled call, where Dynamo never sees the guard's frame
        if not _guarded(compiled):
            module._compiled_call_impl = functools.partial(_run, module, compiled, False)
        return _guard_methods(module)
    hooked = module.__dict__.get("forward")  # accelerate's, whose hook reads the inputs; without a hook, its own
    forward = hooked or module.forward
    if not _guarded(forward):
        # Accelerate's hooked forward is run by the guard itself, as accelerate runs it (`_run`): one layer
        # on every forward, not two.
        through_hook = hooked is not None and _accelerates(hooked, module)
        module.forward = _guarding(module, forward, None if through_hook else hooked is None)
    _guard_methods(module)


def _accelerates(forward, module: torch.nn.Module) -> bool:
    """Whether `forward` is the forward accelerate's `add_hook_to_module` gave `module`: its `new_forward` bound to
    `module`, which calls `module._hf_hook` around `module._old_forward`."""
    func = getattr(forward, "func", None)
    return (
        isinstance(forward, functools.partial)
        and len(forward.args) == 1
        and forward.args[0] is module
        and not forward.keywords
        and getattr(func, "__name__", None) == "new_forward"
        and str(getattr(func, "__module__", "")).startswith("accelerate.")
        and "_old_forward" in module.__dict__
    )


def _guard_methods(module: torch.nn.Module) -> None:
    for method in GUARDED:
        bound = getattr(module, method, None)
        if callable(bound) and not _guarded(bound) and method not in module.__dict__:
            module.__dict__[method] = _guarding(module, bound, True)


def _guarding(module: torch.nn.Module, call, reads: Optional[bool]):
    """`call` (a method of `module`) guarded (`reads`: the guard reads its inputs, which its hook does not see; `None`:
    `call` is accelerate's hooked forward, which the guard runs itself, `_run`): what
    `inspect.signature` reads of it is `call`'s own signature (diffusers asks whether `vae.forward` takes
    `num_frames`), and it has `call`'s name and docstring."""
    return functools.update_wrapper(functools.partial(_run, module, call, reads), call)


def unguard(module: torch.nn.Module) -> None:
    """Take the guard off `module`'s `encode`/`decode`, its compiled call and its own forward (its hook leaves, or
    offload is armed again)."""
    compiled = module.__dict__.get("_compiled_call_impl")
    if _guarded(compiled):
        module._compiled_call_impl = compiled.args[1]
    forward = module.__dict__.get("forward")
    if _guarded(forward) and getattr(forward.args[1], "__self__", None) is module:  # accelerate puts back its own
        del module.__dict__["forward"]
    elif _guarded(forward) and forward.args[2] is None:
        module.forward = forward.args[1]  # accelerate's hooked forward, as it gave it
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


def _opaque(fn):
    """Dynamo never traces `fn` nor what it calls (the recovery's bookkeeping, off the hot path)."""
    return _disable(fn) if _disable is not None else fn


_disable = getattr(getattr(torch, "compiler", None), "disable", None)


@own_frame_skipped  # a compiled component's graph ends at the guard; what it calls is compiled
def _run(module: torch.nn.Module, call, reads: Optional[bool], *args, **kwargs):
    """Run `call` (a guarded forward of `module`; `reads`: one whose hook does not see its inputs; `None`: accelerate's
    hooked forward, run here as accelerate's `new_forward` runs it: the hook's `pre_forward`, which may load
    the module and sends the inputs, the module's own forward, the hook's `post_forward`, the hook read at each call);
    on an out-of-memory error make room and run it again.

    Before the call only what an error cannot tell afterwards is read: the input tensors' version counters, by the
    module's hook as it reads the inputs anyway (or here, for `encode`/`decode`). Everything else (which session runs
    it, training mode, stateful hooks, odd arguments) is read when an error happens (`_Attempt`)."""
    if running and any(slot[0] is module for slot in running):
        return call(*args, **kwargs)  # nested in the module's own guarded call (a VAE's forward calls `decode`)
    slot = [module, _read(args, kwargs) if reads else None]
    running.append(slot)
    attempt = None
    try:
        while True:
            try:
                if reads is not None:
                    result = call(*args, **kwargs)
                else:  # accelerate's hooked forward, run here as its `new_forward` runs it: one layer, not two
                    hook = module._hf_hook
                    # In eager code, our hook's methods without their compiler wrappers (`runtime/compiler.py`).
                    eager_code = frame_callback is not None and frame_callback() is None
                    pre, post = (_unwrapped.get(type(hook)) or _eager_methods(type(hook))) if eager_code else _NEITHER
                    if pre is not None:
                        inputs, named = pre(hook, module, *args, **kwargs)
                    else:
                        inputs, named = hook.pre_forward(module, *args, **kwargs)
                    if hook.no_grad:
                        with torch.no_grad():
                            output = module._old_forward(*inputs, **named)
                    else:
                        output = module._old_forward(*inputs, **named)
                    result = post(hook, module, output) if post is not None else hook.post_forward(module, output)
            except torch.OutOfMemoryError as error:
                attempt = attempt if attempt is not None else _Attempt.of(slot)
                if not attempt.failed(error, args, kwargs):
                    raise
            else:
                if attempt is not None:
                    attempt.completed()
                return result
            attempt.make_room()  # out of the `except`: the failed forward's frames, and their activations, are gone
    finally:
        running.pop()


_NEITHER = (None, None)
#: Per hook class, its `pre_forward` and `post_forward` without their compiler wrappers (`None` where one has none).
_unwrapped: dict = {}


def _eager_methods(kind: type) -> tuple:
    methods = _unwrapped.get(kind)
    if methods is None:
        methods = _unwrapped[kind] = tuple(
            getattr(getattr(kind, m), "eager", None) for m in ("pre_forward", "post_forward")
        )
    return methods


def _read(args: tuple, kwargs: dict) -> list:
    """The input tensors' version counters, read by the guard (plainly in eager code, hidden from Dynamo where it
    runs)."""
    if eager():
        return snapshot(args, kwargs)
    return _opaque(snapshot)(args, kwargs)


def reading(module: torch.nn.Module) -> Optional[list]:
    """The slot of `module`'s guarded call when its hook is to read the input tensors' version counters into it (at
    `[1]`), else `None` (not guarded, read already, or read by the guard)."""
    slot = running[-1] if running else None
    return slot if slot is not None and slot[0] is module and slot[1] is None else None


class _Attempt:
    """One guarded call of a component that ran out of device memory: what was tried so far to make it fit (`_run`
    drives it)."""

    def __init__(self, session, name: str, slot: list) -> None:
        self.session, self.name, self.module, self.slot = session, name, slot[0], slot
        self.tried: List[str] = []
        self.smallest: Optional[int] = None
        self.failed_held = 0
        self.decision: Optional[Decision] = None
        self.at_smallest = False

    @staticmethod
    @_opaque
    def of(slot: list) -> "_Attempt":
        session, name = _holder(slot[0])
        return _Attempt(session, name, slot)

    @_opaque
    def failed(self, error, args, kwargs) -> bool:
        """The call raised `error`: whether it may run again once room is made (the next rung is then chosen).
        Raises `OffloadOutOfMemoryError` when no rung is left; `False` where offload is not armed."""
        if self.session is None:
            return False
        nested = isinstance(error, OffloadOutOfMemoryError)  # a nested component already gave up
        why = "" if nested else not_retried(self.module, args, kwargs, self.slot[1] or ())
        if why is not None:
            if why:
                logger.warning(f"`{self.name}` ran out of device memory and is not run again: {why}.")
            return False
        self.failed_held = self.failed_held or self.session.held_bytes()
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
    module = session.modules[name]
    least = session.placement.stream_rooms.get(name) or stream_room(module)
    if least is not None:  # then with smaller rings (`blocks.streams.RECOVERY_DEPTHS`)
        least = (least,) + tuple(stream_room(module, depth) for depth in RECOVERY_DEPTHS[1:])
    return session.policy.on_out_of_memory(name, session.resident, session.facts, running_names(session), held, least)


def make_room(session, name: str, decision: Decision, smallest: Optional[int]) -> Tuple[str, Optional[int]]:
    """Carry out `decision` (`Session.carry_out_rung`); returns what it did, in words, and the least room `name` was
    streamed in so far."""
    before = session.held_bytes()
    session.carry_out_rung(decision)
    if not decision.moves:
        return "gave the cached memory back to the device (nothing more could leave it)", smallest
    evicted = [n for direction, n in decision.moves if direction == OFFLOAD and n != name]
    if evicted:
        freed = format_size(max(before - session.held_bytes(), 0))
        return f"evicted {', '.join(f'`{n}`' for n in evicted)} ({freed})", smallest
    room = decision.overflow.limit
    choice = session.streams.choices.get(name)
    if choice is None:
        return f"could not stream `{name}` in {format_size(room)}", room
    blocks = f"{len(choice.kept)} of {len(choice.kept) + len(choice.streamed)} blocks kept"
    if choice.streamed and choice.slots < RECOVERY_DEPTHS[0] + 1:
        blocks += f", a ring of {choice.slots} buffer{'s' if choice.slots > 1 else ''}"
    return f"streamed `{name}` in {format_size(room)} ({blocks})", room


def recovered(session, name: str, tried: List[str], failed_held: int) -> None:
    """One log line per recovery, and the session learns from it."""
    session.recovered(name, failed_held)
    limit = (
        f" From now on, calls of this shape keep at most {format_size(session.held_bytes())} of weights on the device "
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
    held = [_holder(slot[0]) for slot in running]
    return tuple(name for holder, name in held if holder is session)


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
