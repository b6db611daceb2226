"""Whether a guarded forward that ran out of device memory may run again (`guard.py` asks): running it again must
change nothing the failed forward may have changed. Inference forwards of diffusers' models are pure; not so a module
in training mode with gradients on, or with an active dropout or a batch norm updating its running statistics, a
stateful diffusers hook (a cache), an argument that is not plain data, an input changed in place."""

from __future__ import annotations

from typing import Optional

import torch

from ..transfer.inference import version_of

_PLAIN = (int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size)
_MAX_ITEMS = 64


def not_retried(module, args, kwargs, versions) -> Optional[str]:
    """Why `module`'s forward, called with `args` and `kwargs` (whose input tensors had `versions` before it ran: `runtime/inputs.py`), must not run again after it failed, or `None` when it may."""
    if module.training:
        why = _unsafe_in_training(module)
        if why is not None:
            return why
    for sub in module.modules():
        registry = getattr(sub, "_diffusers_hook", None)
        hooks = getattr(registry, "hooks", None)
        for hook in hooks.values() if isinstance(hooks, dict) else ():
            if getattr(hook, "_is_stateful", False):
                name = type(hook).__name__
                return f"a stateful diffusers hook (`{name}`) keeps a cache the failed forward may have changed"
    for label, value in list(enumerate(args)) + list(kwargs.items()):
        odd = _odd(value, 0)
        if odd is not None:
            return f"its argument `{label}` holds a `{type(odd).__name__}`, which the failed forward may have changed"
    for label, tensor, version in versions:
        if version_of(tensor) != version:
            return f"the failed forward changed its input `{label}` in place"
    return None


def _unsafe_in_training(module: torch.nn.Module) -> Optional[str]:
    """Why `module`, in training mode, may not run again (`None`: it may). It may where that changes nothing:
    gradients off (or none required), and no sub-module in training mode that draws random numbers (a dropout with a
    rate above 0, a module or a float attribute named `*dropout*` as transformers keeps one) or updates running
    statistics (a batch norm tracking them). A pipeline built from configs, as diffusers' own tests build it, is in
    training mode without any of them."""
    if torch.is_grad_enabled() and any(p.requires_grad for p in module.parameters()):
        return "it is in training mode with gradients on (autograd records the graph)"
    for name, sub in module.named_modules():
        if not sub.training:
            continue
        if isinstance(sub, torch.nn.modules.batchnorm._NormBase) and sub.track_running_stats:
            return f"`{name or type(sub).__name__}` is in training mode: it updates its running statistics"
        rates = [sub.p] if isinstance(sub, torch.nn.modules.dropout._DropoutNd) else []
        rates += [v for k, v in vars(sub).items() if "dropout" in k and isinstance(v, float)]
        if any(rate > 0 for rate in rates):
            return f"`{name or type(sub).__name__}` is in training mode with dropout: it draws random numbers"
    return None


def _odd(value, depth: int):
    """The first object in `value` that is not plain data (tensors, numbers, strings, containers of them)."""
    if isinstance(value, (torch.Tensor,) + _PLAIN):
        return None
    if isinstance(value, (list, tuple, dict)) and depth < 3:
        items = list(value.values() if isinstance(value, dict) else value)[:_MAX_ITEMS]
        return next((odd for odd in (_odd(item, depth + 1) for item in items) if odd is not None), None)
    return value
