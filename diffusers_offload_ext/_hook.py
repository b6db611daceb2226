"""The offload hook: an accelerate `CpuOffload` whose moves are decided by the pipeline's offload state."""

from __future__ import annotations

from accelerate.hooks import CpuOffload, UserCpuOffloadHook, remove_hook_from_module
from accelerate.utils import send_to_device


class DeferredCpuOffload(CpuOffload):
    """A `CpuOffload` hook that asks the pipeline's offload state what to move instead of moving on its own.

    It stays an instance of accelerate's `CpuOffload`, so diffusers' LoRA and adapter loading still detects model
    offload and re-enables it. Pre-forward does constant work when the component is already on the device: a few
    set look-ups, no walk over the parameters.

    Args:
        state (`OffloadState`): The pipeline's offload state.
        component (`str`): The component's name in the pipeline.
        execution_device (`torch.device`): Where the component runs.
        prev_module_hook (`UserCpuOffloadHook`, *optional*): The handle of the chain predecessor (kept for code
            that inspects it; eviction decisions are the state's).
    """

    def __init__(self, state, component: str, execution_device, prev_module_hook=None) -> None:
        super().__init__(execution_device=execution_device, prev_module_hook=prev_module_hook)
        self.state = state
        self.component = component

    def init_hook(self, module):
        # Attaching the hook moves nothing: the state already placed the module.
        return module

    def pre_forward(self, module, *args, **kwargs):
        # diffusers' `apply_forward_hook` (VAE encode/decode) calls `pre_forward(module)` with no inputs.
        self.state.on_use(self.component)
        if not args and not kwargs:
            return args, kwargs
        return send_to_device(args, self.execution_device), send_to_device(kwargs, self.execution_device)


class OffloadHandle(UserCpuOffloadHook):
    """The handle stored in `pipe._all_hooks`, like accelerate's: `offload()` and `remove()`."""

    def offload(self) -> None:
        """Move the component back to the host now, unless the options keep it on the device."""
        self.hook.state.request_offload(self.hook.component)

    def remove(self) -> None:
        remove_hook_from_module(self.model)
