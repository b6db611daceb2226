"""How the transfer lives with `torch.inference_mode()`: the tensors it makes are ordinary tensors where it can make
them so, and version counters are read only where a tensor has one."""

from __future__ import annotations

import functools
from typing import Optional

import torch


def has_inference_parameters(module: Optional[torch.nn.Module]) -> bool:
    """Whether a parameter of `module` was made under inference mode (a pipeline loaded inside it)."""
    return module is not None and any(p.is_inference() for p in module.parameters())


def ordinary_tensors(inference_parameters: bool):
    """The mode a move runs in: inference mode off, so that the device tensors it makes are ordinary tensors whose
    version counters the change checks read, even when the pipeline is called under `torch.inference_mode()` (as
    servers call it); those tensors still serve forwards made in inference mode.

    Except for a module with `inference_parameters`: replacing such a parameter's `.data` outside inference mode
    leaves it unusable (PyTorch then raises "Inference tensors do not track version counter" in the next forward, as
    it does after a plain `module.to(dtype)`), so its moves run in inference mode, whatever the caller's."""
    return torch.inference_mode(bool(inference_parameters))


def streams_ordinary_tensors(method):
    """Runs a `BlockStreamer` method in `ordinary_tensors`' mode for its component (its `inference_parameters`)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with ordinary_tensors(self.inference_parameters):
            return method(self, *args, **kwargs)

    return run


def version_of(tensor: torch.Tensor) -> Optional[int]:
    """The tensor's version counter (bumped by every in-place operation on it), or `None` for an inference tensor
    (made under `torch.inference_mode()`: it has no counter, and in-place edits of it leave no trace but its
    content)."""
    return None if tensor.is_inference() else tensor._version
