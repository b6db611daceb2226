"""The `DiffusionPipeline` methods the extension replaces or wraps: `enable_model_cpu_offload`, `remove_all_hooks`,
`to`, `maybe_free_model_hooks`, `progress_bar`, `__setattr__`, the call guard around `__call__`, and `OffloadMixin`,
which puts them on one pipeline class without `install()`."""

from __future__ import annotations

import functools
from typing import Iterable, Optional, Union

import torch
from diffusers import DiffusionPipeline
from diffusers.utils import logging

from ..calls import StepBar
from ..layout import modules_of
from .overrides import NEW_OPTIONS, adapt, own_override
from .arming import (
    MARK,
    STOCK,
    arm,
    component_left,
    get_session,
    refresh_budget,
    restore_exclusion,
    unchanged,
    validate,
)

logger = logging.get_logger(__name__)


def enable_model_cpu_offload(
    self,
    gpu_id: Optional[int] = None,
    device: Union[torch.device, str, None] = None,
    *,
    exclude_from_offload: Union[str, Iterable[str], None] = None,
    keep_on_device_during_generation: Union[bool, str, Iterable[str], None] = None,
    memory_budget: Union[int, str, None] = None,
    memory_reserve: Union[int, str, None] = None,
    keep_on_device_between_generations: Optional[bool] = None,
    zero_copy_eviction: Optional[bool] = None,
    pin_memory: Union[bool, str, None] = None,
    prefetch: Optional[bool] = None,
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
        exclude_from_offload (`str` or `List[str]`, *optional*, defaults to `None`):
            Components moved to the execution device once and never offloaded (not moved at the end of a call).
            One of the `model_cpu_offload_seq` chain still evicts its predecessor when it runs.
        keep_on_device_during_generation (`bool`, `str` or `List[str]`, *optional*, defaults to `None`):
            Components (`True`: all of them) that, once on the device, stay there until the pipeline call ends,
            instead of being evicted when the next model of the chain runs (for example when a step callback
            decodes a preview with the VAE). At the end of the call everything goes back to the CPU, as in stock.
        memory_budget (`int` or `str`, *optional*, defaults to `None`):
            Turns on the residency manager with an upper bound on the bytes of component weights (parameters and
            buffers) kept on the execution device at any time, excluded components included: bytes (`int`) or a
            size with a unit (`"20GiB"`, `"12GB"`, `"512MiB"`, `"1.5 GiB"`; `GB` = 10**9 bytes, `GiB` = 2**30).
            Components move to the device when they run; when one does not fit, the resident components that are
            not running and that the access trace of the previous call needs least are evicted. A component larger
            than the whole budget runs alone (one warning). `"auto"` clears a budget set before: the manager then
            uses the automatic budget (with `keep_on_device_between_generations=True`) or is off.
        memory_reserve (`int` or `str`, *optional*, defaults to `"3GiB"`):
            Only for the automatic budget on CUDA (no `memory_budget`, `keep_on_device_between_generations=True`):
            the budget is the free device memory at enable time plus the weights the pipeline already holds there,
            minus this reserve for activations. On other devices the automatic budget is unlimited.
        keep_on_device_between_generations (`bool`, *optional*, defaults to `False`):
            Turns on the residency manager and keeps components on the device at the end of a call (within the
            budget), so that the next call does not upload them again. `diffusers_offload_ext.release(pipe)`
            evicts them explicitly.
        zero_copy_eviction (`bool`, *optional*):
            Keep the host copy of each component's weights while it is on the device, so that an eviction only drops
            the device copy (no device-to-host copy; host memory stays at stock's peak, all weights on the host). A
            change made while on the device (in-place edits, replaced tensors, LoRA fusing) is detected and copied
            back. Not set: on with the residency manager, off otherwise. `True`: in every mode, the defaults and
            `exclude_from_offload`/`keep_on_device_during_generation` included (which component moves when does not
            change; opt-in until measured on a GPU). `False`: every eviction copies, like stock.
        pin_memory (`bool` or `"auto"`, *optional*, defaults to `False`):
            Page-lock the host copies of offloaded components in place (no second copy, exact size, within a host
            budget of half the host's memory, a quarter on Windows; spent first on the components that move most),
            so that onloads copy at page-locked speed. `"auto"`: where the device supports it (CUDA); `True`: raise
            where it does not. The host copies are kept while components are on the device, and an eviction that
            must copy writes into them. Opt-in until measured on a GPU.
        prefetch (`bool`, *optional*, defaults to `False`):
            With the residency manager: while a component runs, start the onload of the one the previous call ran
            next, on a CUDA copy stream, when the budget has room for both (counted from that moment); the compute
            stream waits for it before that component runs. Elsewhere onloads stay as they are. Opt-in until
            measured on a GPU.

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
    session = get_session(self)
    arguments = {name: value for name, value in locals().items() if name in NEW_OPTIONS}
    if session is not None and all(v is None for v in arguments.values()) and unchanged(self, session, gpu_id, device):
        refresh_budget(session)
        session.end_of_call()
        return
    arm(self, validate(self, session, gpu_id, device, **arguments))


def remove_all_hooks(self) -> None:
    r"""
    Removes all hooks added by `enable_sequential_cpu_offload` or `enable_model_cpu_offload` (stock's), and forgets
    this extension's instance-level `_exclude_from_cpu_offload`. Components stay where they are.
    """
    session = get_session(self)
    if session is not None and session.transfer is not None:
        session.transfer.flush()
        session.stop_streams()  # a component half on the device could not run without its hooks
    STOCK["remove_all_hooks"](self)
    if session is not None:
        session.active = False
        restore_exclusion(self, session)
        session.unpin(session.modules.values())


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
    Stock's `maybe_free_model_hooks`: offload is armed again at the end of a call. With the extension, this is the
    end-of-call event: when nothing changed, hooks and policy stay and only the policy's moves are made.
    """
    session = get_session(self)
    if session is None:
        return STOCK["maybe_free_model_hooks"](self)
    session.ending += 1
    try:
        return STOCK["maybe_free_model_hooks"](self)
    finally:
        session.ending -= 1


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
        component_left(self, session, name, old)


def guard_call(call):
    """Wrap a pipeline `__call__`: the call is tracked, a pipeline whose components changed is armed again first, and
    a call that raises still ends with the end-of-call offload."""

    @functools.wraps(call)
    def guarded(self, *args, **kwargs):
        session = get_session(self)
        if session is None:
            return call(self, *args, **kwargs)
        if session.active and not session.calls.in_call and _components_changed(self, session):
            self.enable_model_cpu_offload()
        session.begin_call()
        failed = True
        try:
            result = call(self, *args, **kwargs)
            if session.active and session.calls.depth == 1 and not session.calls.ended:
                # A pipeline that ends without `maybe_free_model_hooks()` (a combined pipeline armed whole: its
                # sub-pipelines' own end-of-call offload has no hooks to re-arm) gets the end-of-call offload.
                self.maybe_free_model_hooks()
            failed = False
            return result
        except BaseException:
            if session.calls.depth == 1 and session.active:
                session.failing = True
                try:
                    self.maybe_free_model_hooks()
                except Exception:  # the original error matters more
                    logger.exception("The end-of-call offload after a failed pipeline call failed too.")
                finally:
                    session.failing = False
            raise
        finally:
            session.end_call(failed)

    setattr(guarded, MARK, call)
    return guarded


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


class OffloadMixin:
    """Put before a `DiffusionPipeline` class to get the new offload options without `install()`.

    Example:

    ```py
    >>> import diffusers_offload_ext as doe
    >>> from diffusers import FluxPipeline


    >>> class MyFlux(doe.OffloadMixin, FluxPipeline):
    ...     pass


    >>> pipe = MyFlux.from_pretrained("black-forest-labs/FLUX.1-dev", torch_dtype=torch.bfloat16)
    >>> pipe.enable_model_cpu_offload(keep_on_device_during_generation=True)
    ```
    """

    enable_model_cpu_offload = enable_model_cpu_offload
    remove_all_hooks = remove_all_hooks
    to = to
    maybe_free_model_hooks = maybe_free_model_hooks
    progress_bar = progress_bar
    __setattr__ = __setattr__

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if not issubclass(cls, DiffusionPipeline):
            return
        if not getattr(cls.__dict__.get("__call__"), MARK, None):
            cls.__call__ = guard_call(cls.__call__)
        override = own_override(cls)
        if override is not None and "enable_model_cpu_offload" not in cls.__dict__:
            cls.enable_model_cpu_offload = adapt(override)
