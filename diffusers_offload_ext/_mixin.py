"""`OffloadMixin`: the new `enable_model_cpu_offload` and the pipeline methods that must know about it."""

from __future__ import annotations

import functools
from typing import Iterable, List, Optional, Union

import torch
from accelerate.hooks import add_hook_to_module
from diffusers import DiffusionPipeline
from diffusers.utils import logging

from . import _memory
from ._hook import DeferredCpuOffload, OffloadHandle
from ._ledger import module_nbytes
from ._options import OffloadOptions, module_components, resolve_budget, resolve_device, resolve_options
from ._policy import ChainPolicy, layout
from ._residency import ResidencyPolicy
from ._state import ensure_state, get_state, placement

logger = logging.get_logger(__name__)

#: Marks a function of ours that replaced a `DiffusionPipeline` method or wraps a `__call__`.
MARK = "__offload_ext_wraps__"

#: Stock's methods, captured before `install()` can replace them.
STOCK = {
    name: getattr(DiffusionPipeline.__dict__[name], MARK, DiffusionPipeline.__dict__[name])
    for name in (
        "enable_model_cpu_offload",
        "remove_all_hooks",
        "to",
    )
}


def _raise_like_stock(pipe) -> None:
    """The checks stock's `enable_model_cpu_offload` makes before changing anything, with stock's errors."""
    if hasattr(pipe, "_maybe_raise_error_if_group_offload_active"):
        pipe._maybe_raise_error_if_group_offload_active(raise_error=True)
    if hasattr(pipe, "_maybe_raise_error_if_tensor_parallel_active"):
        pipe._maybe_raise_error_if_tensor_parallel_active()
    if hasattr(pipe, "_is_pipeline_device_mapped"):
        device_mapped = pipe._is_pipeline_device_mapped()
    else:
        device_mapped = pipe.hf_device_map is not None and len(pipe.hf_device_map) > 1
    if device_mapped:
        raise ValueError(
            "It seems like you have activated a device mapping strategy on the pipeline so calling "
            "`enable_model_cpu_offload() isn't allowed. You can call `reset_device_map()` first and then call "
            "`enable_model_cpu_offload()`."
        )
    if pipe.model_cpu_offload_seq is None:
        raise ValueError(
            "Model CPU offload cannot be enabled because no `model_cpu_offload_seq` class attribute is set."
        )


def _loaded_in_8bit(module: torch.nn.Module) -> bool:
    # bitsandbytes 8-bit models cannot move; stock leaves them out of the chain too.
    return bool(getattr(module, "is_loaded_in_8bit", False))


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
            Components moved to the execution device once and never offloaded (no hook, not moved at the end of a
            call). They are removed from the `model_cpu_offload_seq` chain.
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
        zero_copy_eviction (`bool`, *optional*, defaults to `True`):
            With the residency manager on, keep the host copy of each component's weights while it is on the
            device, so that an eviction only drops the device copy (no device-to-host copy; host memory stays at
            stock's peak, all weights on the host). A change made while on the device (in-place edits, replaced
            tensors, LoRA fusing) is detected and copied back. `False` evicts with a copy, like stock.

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
    state = get_state(self)
    components = self.components
    options = resolve_options(
        state.options if state is not None else OffloadOptions(),
        components,
        exclude_from_offload,
        keep_on_device_during_generation,
        memory_budget=memory_budget,
        memory_reserve=memory_reserve,
        keep_on_device_between_generations=keep_on_device_between_generations,
        zero_copy_eviction=zero_copy_eviction,
    )
    _raise_like_stock(self)
    exec_device, index = resolve_device(
        gpu_id,
        device,
        getattr(self, "_offload_device", None),
        getattr(self, "_offload_gpu_id", None),
    )
    modules = {n: m for n, m in module_components(components).items() if not _loaded_in_8bit(m)}
    pinned = [n for n in options.exclude_from_offload if n in modules]
    class_excluded = _user_exclusion(self, state)
    sequence = [n.strip() for n in self.model_cpu_offload_seq.split("->")]
    chain, hooked, bounce = layout(list(modules), sequence, class_excluded, pinned)
    budget = auto_budget = None
    if options.residency:
        budget, auto_budget = _residency_budget(state, options, modules, pinned + bounce, exec_device)

    # Nothing was changed above this line.
    state = ensure_state(self)
    STOCK["remove_all_hooks"](self)
    _restore_exclusion(self, state)

    if state.device is not None and state.device != exec_device:
        state.carry_out([("offload", n) for n in sorted(state.resident & set(state.modules))])
    state.modules = modules
    state.device = exec_device
    state.sync_with_placement(modules, exec_device)
    self._offload_gpu_id = index
    self._offload_device = exec_device

    if options.residency:
        state.policy = _residency_policy(state, options, modules, chain, hooked, pinned, bounce, budget, auto_budget)
    else:
        state.policy = ChainPolicy(
            order=list(modules),
            chain=chain,
            hooked=hooked,
            pinned=pinned,
            bounce=bounce,
            kept=options.kept(hooked),
        )
    state.zero_copy = options.residency and options.zero_copy
    if not state.zero_copy:
        state.host_copies.clear()
    state.options = options
    state.carry_out(state.policy.on_enable(state.resident))

    if pinned:
        state.saved_exclusion = (
            "_exclude_from_cpu_offload" in self.__dict__,
            self.__dict__.get("_exclude_from_cpu_offload"),
        )
        self.__dict__["_exclude_from_cpu_offload"] = list(dict.fromkeys(class_excluded + pinned))

    handles: List[OffloadHandle] = []
    previous = None
    for name in hooked:
        hook = DeferredCpuOffload(
            state,
            name,
            exec_device,
            prev_module_hook=previous if name in chain else None,
        )
        add_hook_to_module(modules[name], hook, append=True)
        handle = OffloadHandle(modules[name], hook)
        handles.append(handle)
        if name in chain:
            previous = handle
    self._all_hooks = handles
    state.active = True


def _user_exclusion(pipe, state) -> List[str]:
    """`_exclude_from_cpu_offload` as it is without this extension's instance-level additions."""
    if state is not None and state.saved_exclusion is not None:
        had_instance_value, value = state.saved_exclusion
        if not had_instance_value:
            value = getattr(type(pipe), "_exclude_from_cpu_offload", None)
        return list(value or [])
    return list(getattr(pipe, "_exclude_from_cpu_offload", None) or [])


def _residency_budget(state, options, modules, fixed_names, device):
    """The residency manager's budget, validated before anything changes (see `resolve_budget`). `fixed_names`
    are the components that stay on the device whatever the manager does (pinned, and the class's exclusions)."""
    fixed = {n: module_nbytes(modules[n]) for n in fixed_names}
    # What the pipeline holds on the device: free memory does not count it. The parameters tell on an accelerator;
    # the record tells where they cannot (the CPU, where tests mock the memory functions).
    recorded = state.resident if state is not None and state.device == device else set()
    held = sum(module_nbytes(m) for n, m in modules.items() if n in recorded or placement(m) == device)
    return resolve_budget(options, device, fixed, held)


def _residency_policy(state, options, modules, chain, hooked, pinned, bounce, budget, auto_budget):
    """The residency manager's policy; the one in force is kept while its configuration is the same (its plans may
    span calls)."""
    capacity = None
    device = state.device
    if _memory.free_bytes(device) is not None:
        reserve = options.memory_reserve if auto_budget else 0

        def capacity(held: int) -> Optional[int]:
            free = _memory.free_bytes(device)
            return None if free is None else free + held - reserve

    policy = ResidencyPolicy(
        order=list(modules),
        chain=chain,
        hooked=hooked,
        sizes={n: module_nbytes(m) for n, m in modules.items()},
        pinned=pinned,
        bounce=bounce,
        budget=budget,
        keep_between=options.keep_between,
        history=state.traces,
        current=state.trace if state.call_depth else (),
        capacity=capacity,
        cache=state.plan_cache,
        zero_copy=options.zero_copy,
        measure=lambda name: module_nbytes(modules[name]),
    )
    previous = state.policy
    if isinstance(previous, ResidencyPolicy) and previous.config == policy.config:
        previous.capacity = capacity
        previous.measure = policy.measure
        return previous
    return policy


def _restore_exclusion(pipe, state) -> None:
    """Undo our instance-level `_exclude_from_cpu_offload`, leaving what the user had set."""
    if state.saved_exclusion is None:
        return
    had_instance_value, value = state.saved_exclusion
    state.saved_exclusion = None
    if had_instance_value:
        pipe.__dict__["_exclude_from_cpu_offload"] = value
    else:
        pipe.__dict__.pop("_exclude_from_cpu_offload", None)


def remove_all_hooks(self) -> None:
    r"""
    Removes all hooks added by `enable_sequential_cpu_offload` or `enable_model_cpu_offload` (stock's), and forgets
    this extension's instance-level `_exclude_from_cpu_offload`. Components stay where they are.
    """
    STOCK["remove_all_hooks"](self)
    state = get_state(self)
    if state is not None:
        state.active = False
        state.policy = None
        _restore_exclusion(self, state)


def to(self, *args, **kwargs):
    r"""
    Stock's `DiffusionPipeline.to`; afterwards the extension's record of what is on the execution device is
    brought in line with the explicit move. Explicit moves are the caller's and are not in the transfer ledger.
    """
    result = STOCK["to"](self, *args, **kwargs)
    state = get_state(self)
    if state is not None and state.device is not None:
        target = kwargs.get("device")
        for arg in args:
            if isinstance(arg, (str, torch.device)):
                target = arg
        if state.device.type != "cpu":
            state.resident = set()
            state.sync_with_placement(state.modules, state.device)
        elif target is not None:
            moved_to = torch.device(target)
            state.resident = set(state.modules) if moved_to == state.device else set()
        # The host copies of components that left the device are stale: their weights were just copied back.
        state.forget_host_copies()
    return result


def guard_call(call):
    """Wrap a pipeline `__call__` so that a call that raises still ends with the end-of-call offload."""

    @functools.wraps(call)
    def guarded(self, *args, **kwargs):
        state = get_state(self)
        if state is None:
            return call(self, *args, **kwargs)
        state.begin_call()
        failed = True
        try:
            result = call(self, *args, **kwargs)
            failed = False
            return result
        except BaseException:
            if state.call_depth == 1 and state.active:
                try:
                    self.maybe_free_model_hooks()
                except Exception:  # the original error matters more
                    logger.exception("The end-of-call offload after a failed pipeline call failed too.")
            raise
        finally:
            state.end_call(failed)

    setattr(guarded, MARK, call)
    return guarded


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

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if not issubclass(cls, DiffusionPipeline):
            return
        if not getattr(cls.__dict__.get("__call__"), MARK, None):
            cls.__call__ = guard_call(cls.__call__)
