"""The offload hook: an accelerate `CpuOffload` that tells the pipeline's session a component is about to run, and
sends the inputs to the execution device (it decides nothing itself); attaching one per hooked component, and taking
one off."""

from __future__ import annotations

from typing import Dict

import torch
from accelerate.hooks import CpuOffload, UserCpuOffloadHook, add_hook_to_module, remove_hook_from_module
from accelerate.utils import send_to_device

from ..marks import HOOK_MARK, extension_hook
from ..recovery import guard as recovery
from . import inputs, sharing
from .compiler import outside_graphs


class DeferredCpuOffload(CpuOffload):
    """A `CpuOffload` hook whose moves are decided by the pipeline's session.

    It stays an instance of accelerate's `CpuOffload`, so diffusers' LoRA and adapter loading still detects model
    offload and re-enables it. Its pre-forward does constant work when nothing has to move: the session compares the
    component's first tensor with its record, and the policy answers from sets.

    Args:
        session (`Session`): The session of the pipeline that armed it.
        component (`str`): The component's name in that pipeline.
        execution_device (`torch.device`): Where the component runs.
        prev_module_hook (`UserCpuOffloadHook`, *optional*): The handle of the chain predecessor (kept for code
            that inspects it; evictions are the policy's).
    """

    def __init__(self, session, component: str, execution_device, prev_module_hook=None) -> None:
        super().__init__(execution_device=execution_device, prev_module_hook=prev_module_hook)
        self.session = session
        self.component = component
        self._use = session.use

    def init_hook(self, module):
        # Attaching the hook moves nothing: the session already placed the module.
        return module

    def detach_hook(self, module):
        recovery.unguard(module)  # the out-of-memory guard of `attach` leaves with the hook
        return module

    @outside_graphs
    def pre_forward(self, module, *args, **kwargs):
        running = sharing.running
        holder = None
        if running and running[-1] is not self.session:
            # A module shared with another pipeline: the pipeline whose call is running moves and records it.
            holder = sharing.running_holder(module)
        if holder is None or holder is self.session:
            self._use(self.component)
        else:
            holder.use(holder.name_of(module))
        # diffusers' `apply_forward_hook` (VAE encode/decode) calls `pre_forward(module)` with no inputs.
        if not args and not kwargs:
            return args, kwargs
        # Its out-of-memory guard keeps the input tensors' version counters (`recovery.reading`, inlined: a hot path).
        slot = recovery.running[-1] if recovery.running else None
        if slot is not None and (slot[0] is not module or slot[1] is not None):
            slot = None
        placed, versions = inputs.read(args, kwargs, self.execution_device, self.session.readable, slot is not None)
        if slot is not None:
            slot[1] = versions
        if placed:
            return args, kwargs  # what `send_to_device` would return, without walking the inputs again
        return send_to_device(args, self.execution_device), send_to_device(kwargs, self.execution_device)

    @outside_graphs
    def post_forward(self, module, output):
        # A prefetch started while this forward ran is waited on as it ends (the compute stream waits on its event; no
        # host wait): code that runs between forwards (a step callback editing the weights) finds them complete.
        transfer = self.session.transfer
        if transfer is not None and transfer.pending:
            transfer.flush()
        return output


# How code that must not import the runtime (the trace) recognises it: `marks.extension_hook`.
setattr(DeferredCpuOffload, HOOK_MARK, True)


class OffloadHandle(UserCpuOffloadHook):
    """The handle stored in `pipe._all_hooks`, like accelerate's: `offload()` and `remove()`."""

    def offload(self) -> None:
        """Move the component back to the host now, unless the options keep it on the device."""
        self.hook.session.request_offload(self.hook.component)

    def remove(self) -> None:
        remove_hook_from_module(self.model)


def ours(module: torch.nn.Module):
    """The `DeferredCpuOffload` attached to `module` (alone or in accelerate's `SequentialHook`), or `None`."""
    return extension_hook(getattr(module, "_hf_hook", None))


def attach(pipe, session) -> Dict[str, DeferredCpuOffload]:
    """One hook on every component `session` hooks, the chain's handles linked in chain order, and on the components
    its policy watches (excluded ones: their use is reported, nothing offloads them; no handle); `pipe._all_hooks`
    holds the handles, as stock's does. Every one is guarded (`recovery/guard.py`), and so are the components that
    stay on the device without a hook. Returns the hooks by component."""
    handles, hooks, previous = [], {}, None
    chain = session.arrangement.chain
    watched = session.policy.watched  # the policy hears when these run (an excluded one evicts); none offloads them
    for module in session.modules.values():
        recovery.unguard(module)  # an earlier arming's guard (accelerate would take it for the forward it hooks)
    for name in session.arrangement.hooked + tuple(n for n in session.layout.order if n in watched):
        module = session.modules[name]
        hook = DeferredCpuOffload(session, name, session.device, prev_module_hook=previous if name in chain else None)
        add_hook_to_module(module, hook, append=True)
        recovery.guard(module)  # an out-of-memory error in its forward: room made, run again (`recovery/guard.py`)
        hooks[name] = hook
        if name in watched:
            continue
        handle = OffloadHandle(module, hook)
        handles.append(handle)
        if name in chain:
            previous = handle
    for name in [n for n in session.layout.order if n in session.policy.stays and n not in hooks]:
        recovery.guard(session.modules[name])  # no hook, but an out-of-memory error in it can make room too
    pipe._all_hooks = handles
    return hooks


def detach(module: torch.nn.Module, session) -> None:
    """Take `session`'s hook off `module` (a component that left its pipeline)."""
    hook = getattr(module, "_hf_hook", None)
    if isinstance(hook, DeferredCpuOffload) and hook.session is session:
        remove_hook_from_module(module)
    elif hook is None:
        recovery.unguard(module)  # the guard of a component that had no hook
