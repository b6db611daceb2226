"""What the tracer sees of a pipeline: its module components (chain first), which component each sub-module belongs
to, which offload drives it (this extension, stock's model, sequential or group offload, or none) on which execution
device, and what a reader of the trace must know about that."""

from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Tuple

import torch

from ...layout import PipelineLayout
from ...layout import modules_of
from ...marks import extension_hook
from .devices import device_name
from .hooks import hook_chain, registry_hooks

EXTENSION_MODE = "extension"
MODEL_OFFLOAD = "model-offload"
SEQUENTIAL_OFFLOAD = "sequential-offload"
GROUP_OFFLOAD = "group-offload"
NO_OFFLOAD = "none"

REPLAY_NOTE = (
    "REPLAYED, not measured: on {device} stock's {what} moves nothing that can be seen (the execution device is the "
    "host), so its moves here are replayed from {policy} over the recorded component-call trace."
)
EXTENSION_CPU_NOTE = (
    "The execution device is the CPU: the extension's moves are its `.to()` calls as its ledger records them; no "
    "bytes crossed a bus."
)


class PipelineView(NamedTuple):
    """One reading of a pipeline.

    Args:
        layout (`PipelineLayout`): The pipeline as model offload sees it.
        modules (`Dict[str, torch.nn.Module]`): The module components, those of the offload sequence first.
        owner (`Dict[int, str]`): `id(sub-module)` -> its component (sub-modules shared by components left out:
            running one says nothing about which component runs).
        device (`torch.device` or `None`): The execution device.
        mode (`str`): The offload that drives the pipeline.
    """

    layout: PipelineLayout
    modules: Dict[str, torch.nn.Module]
    owner: Dict[int, str]
    device: Optional[torch.device]
    mode: str

    @property
    def device_name(self) -> Optional[str]:
        return device_name(self.device)

    @property
    def replays_model_offload(self) -> bool:
        """Stock's model offload on the CPU: its moves are invisible and get replayed."""
        return self.mode == MODEL_OFFLOAD and self.device_name == "cpu"

    @property
    def replays_group_offload(self) -> bool:
        """Stock's group offload on the CPU: its moves are invisible and get replayed."""
        return self.mode == GROUP_OFFLOAD and self.device_name == "cpu"

    @property
    def counts_moves(self) -> bool:
        """Placement on the CPU says nothing about residency here: moves are counted instead."""
        return self.device_name == "cpu" and self.mode in (EXTENSION_MODE, MODEL_OFFLOAD, GROUP_OFFLOAD)

    def note(self) -> Optional[str]:
        """What a reader must know about this mode, or `None`."""
        if self.replays_model_offload:
            policy = "stock's chain policy (`ChainPolicy`)"
            return REPLAY_NOTE.format(device="cpu", what="model offload", policy=policy)
        if self.replays_group_offload:
            policy = "its groups (each group onloaded before its forward, offloaded after)"
            return REPLAY_NOTE.format(device="cpu", what="group offload", policy=policy)
        if self.mode == EXTENSION_MODE and self.device_name == "cpu":
            return EXTENSION_CPU_NOTE
        return None


def read_pipeline(pipe, session) -> PipelineView:
    """Read `pipe` now; `session` is its extension session or `None`."""
    layout = PipelineLayout.from_pipeline(pipe)
    modules = modules_of(pipe.components, movable=False)
    first = [n for n in dict.fromkeys(layout.sequence) if n in modules]
    modules = {n: modules[n] for n in first + [n for n in modules if n not in first]}
    device, mode = detect(pipe, modules, session)
    return PipelineView(layout, modules, owners(modules), device, mode)


def owners(modules: Dict[str, torch.nn.Module]) -> Dict[int, str]:
    owner: Dict[int, str] = {}
    shared = set()
    for name, module in modules.items():
        for sub in module.modules():
            if owner.setdefault(id(sub), name) != name:
                # Old diffusers reuse one activation module everywhere.
                shared.add(id(sub))
    for key in shared:
        del owner[key]
    return owner


def detect(pipe, modules: Dict[str, torch.nn.Module], session) -> Tuple[Optional[torch.device], str]:
    """The execution device and the offload mode, read from the session and the hooks."""
    if session is not None and session.active and session.device is not None:
        return session.device, EXTENSION_MODE
    for module in modules.values():
        hook = getattr(module, "_hf_hook", None)
        if hook is not None and extension_hook(hook) is None and _is_cpu_offload(hook):
            device = next((h.execution_device for h in hook_chain(hook) if hasattr(h, "execution_device")), None)
            return torch.device(device_name(device) or "cpu"), MODEL_OFFLOAD
    found = _submodule_mode(modules)
    if found is not None:
        return found
    device = getattr(pipe, "_offload_device", None)
    if device is None:
        try:
            device = pipe._execution_device
        except Exception:
            device = None
    return (torch.device(device) if device is not None else None), NO_OFFLOAD


def _submodule_mode(modules: Dict[str, torch.nn.Module]) -> Optional[Tuple[torch.device, str]]:
    """Group offload (a registry hook with an onload device) or sequential offload (an accelerate hook with an
    execution device on a sub-module), or `None`."""
    for module in modules.values():
        for sub in module.modules():
            for hook in registry_hooks(sub):
                group = getattr(hook, "group", None)
                if group is not None and getattr(group, "onload_device", None) is not None:
                    return torch.device(group.onload_device), GROUP_OFFLOAD
            hook = getattr(sub, "_hf_hook", None)
            if hook is not None and sub is not module:
                chain = hook_chain(hook)
                device = next((h.execution_device for h in chain if getattr(h, "execution_device", None)), None)
                if device is not None:
                    return torch.device(device_name(device)), SEQUENTIAL_OFFLOAD
    return None


def _is_cpu_offload(hook) -> bool:
    from accelerate.hooks import CpuOffload

    return any(isinstance(h, CpuOffload) for h in hook_chain(hook))
