"""The `DiffusionPipeline` methods the extension replaces or wraps: `enable_model_cpu_offload`, `remove_all_hooks`,
`to`, `maybe_free_model_hooks`, `progress_bar`, `__setattr__`, and the call guard around `__call__`. Each turns a
diffusers event into one event of the pipeline's session; the end of a call is one of them, reached once per call
(no round trip through stock's `maybe_free_model_hooks()` and `enable_model_cpu_offload()`)."""

from __future__ import annotations

import functools
from typing import Optional, Union

import torch
from diffusers.utils import logging

from ..calls import StepBar
from ..layout import modules_of
from ..marks import MARK, STOCK, combined_of, get_session
from ..recovery.activations import call_shape
from .arming import arm, arm_again, before_call, validate
from .hook import detach, ours
from ..recovery.guard import unguard
from . import host
from ..pinning.store import unpin
from .options import docstring, signature, take

logger = logging.get_logger(f"diffusers.{__name__}")


def enable_model_cpu_offload(
    self, gpu_id: Optional[int] = None, device: Union[torch.device, str, None] = None, **options
) -> None:
    r"""
    Offloads all models to the CPU and moves one model at a time to the accelerator when it runs, like diffusers'
    `enable_model_cpu_offload`, with control over what stays on the accelerator.

    Options are sticky like `gpu_id`: `None` keeps the value set before (also when diffusers re-enables offload at
    the end of every call or after loading a LoRA), a value replaces it, `[]` / `False` resets it.

    Args:
        gpu_id (`int`, *optional*):
            The ID of the accelerator that shall be used in inference. Defaults to the ID set before, or 0.
        device (`torch.device` or `str`, *optional*, defaults to `None`):
            The device to run on. Defaults to the device set by the previous call, or the available accelerator.
        {options}

    Raises:
        `TypeError`: an argument of the wrong type.
        `ValueError`: an unknown component name, a component that is not a `torch.nn.Module`, a device-mapped
            pipeline, or active group offloading; a size that does not parse, is negative or a bool; a
            `memory_reserve` larger than the device; excluded components alone larger than `memory_budget`.
            Nothing is changed when an error is raised.

    Example:

    ```py
    >>> import torch
    >>> import diffusers_offload_ext as doe
    >>> from diffusers import FluxPipeline

    >>> doe.install()
    >>> pipe = FluxPipeline.from_pretrained("black-forest-labs/FLUX.1-dev", torch_dtype=torch.bfloat16)
    >>> pipe.enable_model_cpu_offload(exclude_from_offload=["transformer"])
    >>> image = pipe("a photo of an astronaut riding a horse on mars").images[0]

    >>> # A server on a 24 GB card: keep what fits between calls, evict what the next steps need least.
    >>> pipe.enable_model_cpu_offload(memory_budget="20GiB", keep_on_device_between_generations=True)
    >>> images = [pipe(prompt).images[0] for prompt in ["a red cat", "a blue dog"]]
    ```
    """

    arguments = take("enable_model_cpu_offload", options)
    session = get_session(self)
    if session is not None and all(v is None for v in arguments.values()):
        arm_again(self, session, gpu_id, device)
    else:
        session = arm(self, validate(self, session, gpu_id, device, **arguments))
    session.rearm()


enable_model_cpu_offload.__signature__ = signature(enable_model_cpu_offload)
enable_model_cpu_offload.__doc__ = docstring(enable_model_cpu_offload)


def remove_all_hooks(self) -> None:
    r"""
    Removes all hooks added by `enable_sequential_cpu_offload` or `enable_model_cpu_offload` (stock's), and forgets
    this extension's `exclude_from_offload` (the instance-level `_exclude_from_cpu_offload` it set goes; a list of your
    own comes back as it was). Between calls, what the offload kept on the device
    (`keep_on_device_between_generations`) goes back to the host first, as stock's end of call leaves it; excluded
    components stay where they are, as in stock.
    """
    session = get_session(self)
    if session is not None:
        session.stop_moving()  # a component half on the device could not run without its hooks
        if session.active and not session.calls.in_call:
            session.release()  # without its hooks, nothing would bring it home
    STOCK["remove_all_hooks"](self)
    if session is not None:
        session.disarm(forget_exclusion=True)  # as stock drops the instance-level list
        host.disarmed(session)
        for module in session.modules.values():
            unguard(module)  # the guards of components that had no hook
        session.exclusion.restore(self)
        unpin(session.device, session.modules.values())


def to(self, *args, **kwargs):
    r"""
    Stock's `DiffusionPipeline.to`; afterwards the extension's record of what is on the execution device follows the
    explicit move. Explicit moves are the caller's and are not in the transfer ledger.
    """
    session = get_session(self)
    if session is not None and session.transfer is not None:
        session.transfer.flush()  # no move from outside reads weights a prefetch is still writing
    result = STOCK["to"](self, *args, **kwargs)
    if session is not None and session.transfer is not None:
        target = kwargs.get("device")
        for arg in args:
            if isinstance(arg, (str, torch.device)):
                target = arg
        session.moved_outside(None if target is None else torch.device(target))
    return result


def maybe_free_model_hooks(self) -> None:
    r"""
    Stock's `maybe_free_model_hooks`: the end of a call. With the extension, the session's end-of-call event (inside a
    call, once); outside a call, offload is armed again as stock does. When nothing changed, hooks and policy stay
    and only the policy's moves are made.
    """
    session = get_session(self)
    if session is None or not session.active:
        return STOCK["maybe_free_model_hooks"](self)
    if session.calls.in_call and not session.calls.ended:
        return _end_of_call(self, session, failed=False)
    if _free_like_stock(self, session):
        session.rearm()


def _free_like_stock(pipe, session) -> bool:
    """What stock's `maybe_free_model_hooks()` does before it arms offload again: its stateful hooks reset; then,
    where offload hooks are in place (stock stops there otherwise), the pipeline armed again if it changed. Returns
    whether offload is armed again (its moves are the caller's)."""
    _reset_stateful_hooks(pipe)
    if not getattr(pipe, "_all_hooks", None):
        return False
    arm_again(pipe, session, device=getattr(pipe, "_offload_device", None))
    return True


def _end_of_call(pipe, session, failed: bool) -> None:
    """The end of the call in progress: what stock's `maybe_free_model_hooks()` does first, then the session's end of
    call, told whether the call failed."""
    try:
        _free_like_stock(pipe, session)
        session.end_of_call(failed)
        host.after_call(session)
    except Exception:
        if not failed:
            raise
        logger.exception("The end-of-call offload after a failed pipeline call failed too.")


def _reset_stateful_hooks(pipe) -> None:
    """Diffusers' stateful hooks (caches kept across the steps of one call) start afresh, as stock's
    `maybe_free_model_hooks()` has them at every call's end."""
    for component in pipe.components.values():
        reset = getattr(component, "_reset_stateful_cache", None)
        if reset is not None:
            reset()


def progress_bar(self, iterable=None, total=None):
    """Stock's progress bar; the denoising loop it counts tells the call tracker the step (for the ledger)."""
    bar = STOCK["progress_bar"](self, iterable=iterable, total=total)
    session = get_session(self)
    if session is None or not session.calls.in_call:
        return bar
    if total is None and iterable is not None and hasattr(iterable, "__len__"):
        total = len(iterable)
    return StepBar(bar, session.calls, total)


def __setattr__(self, name, value):
    session = self.__dict__.get("_offload_ext_session")
    old = self.__dict__.get(name) if session is not None else None
    STOCK["__setattr__"](self, name, value)
    if old is not None and old is not value and isinstance(old, torch.nn.Module) and session.name_of(old) == name:
        # The component was replaced or unregistered: its hook goes, and it leaves the device unless another armed
        # pipeline holds it. The pipeline is armed again at its next call.
        detach(old, session)
        session.component_left(name, old)


def guard_call(call):
    """Wrap a pipeline `__call__`: the call is tracked, a pipeline whose components changed is armed again first, and
    a call that returns or raises without its end-of-call offload gets it, told whether it failed."""

    @functools.wraps(call)
    def guarded(self, *args, **kwargs):
        pipe, session = _armed_for(self)
        if session is None:
            return call(self, *args, **kwargs)
        if session.active and not session.calls.in_call and pipe is self and _components_changed(pipe, session):
            pipe.enable_model_cpu_offload()
        before_call(session, call_shape(args, kwargs))
        failed = True
        try:
            # its moves may run out of device memory: the call then ends as a failed one
            session.begin_call(callbacks=_has_callback(kwargs))
            result = call(self, *args, **kwargs)
            failed = False
            return result
        finally:
            try:
                if session.active and session.calls.depth == 1 and not session.calls.ended:
                    # A pipeline that raised, or ended without `maybe_free_model_hooks()` (a combined pipeline armed
                    # whole: its sub-pipelines' own end-of-call offload has no hooks to re-arm).
                    _end_of_call(pipe, session, failed)
            finally:
                session.leave_call(failed)

    setattr(guarded, MARK, call)
    return guarded


def _has_callback(kwargs) -> bool:
    """Whether a pipeline call's arguments carry a step callback (user code between the denoiser's forwards)."""
    return any(kwargs.get(name) is not None for name in ("callback_on_step_end", "callback"))


def _armed_for(pipe):
    """`(pipeline, session)` that a call of `pipe` belongs to: its own, or, for a sub-pipeline of a combined pipeline
    armed whole (called on its own, or from the combined pipeline's call), the combined pipeline's, so that its call
    ends as stock's sub-pipeline call does (its own end of call) or nests in the combined call; for a pipeline not
    armed whose components carry one armed pipeline's hooks (made by `from_pipe`), that one's (`_hooks_session`)."""
    session = get_session(pipe)
    if session is None or not session.active:
        whole = combined_of(pipe)
        whole_session = get_session(whole) if whole is not None else None
        if whole_session is not None and whole_session.active:
            return whole, whole_session
        borrowed = _hooks_session(pipe)
        if borrowed is not None:
            return pipe, borrowed
    return pipe, session


def _hooks_session(pipe):
    """The one armed session whose hooks `pipe`'s components carry, or `None`: a call of `pipe` runs through those
    hooks, so it is a call of that session, which it ends (else what the options keep stays until that session's
    next call ends)."""
    found = {id(hook.session): hook.session for hook in map(ours, modules_of(pipe.components).values()) if hook}
    sessions = [s for s in found.values() if s.active]
    return sessions[0] if len(sessions) == 1 else None


def _components_changed(pipe, session) -> bool:
    modules = modules_of(pipe.components)
    return list(modules) != list(session.modules) or any(modules[n] is not m for n, m in session.modules.items())


#: The methods `install()` puts on `DiffusionPipeline` and `OffloadMixin` carries.
METHODS = {
    "enable_model_cpu_offload": enable_model_cpu_offload,
    "remove_all_hooks": remove_all_hooks,
    "to": to,
    "maybe_free_model_hooks": maybe_free_model_hooks,
    "progress_bar": progress_bar,
    "__setattr__": __setattr__,
}
