"""A forward's inputs, read once per forward by its hook: whether they are on the execution device already (else the
hook sends them there), and their tensors' version counters, which an out-of-memory recovery compares afterwards to
tell whether the failed forward changed one in place (`recovery/guard.py`)."""

from __future__ import annotations

import itertools
from typing import Optional, Tuple

import torch

from ..transfer.inference import version_of

#: Inputs that are in place wherever the device is: plain scalars.
_SCALARS = (int, float, bool, str, type(None))
#: Their exact types, looked up first (the common inputs of a forward besides tensors).
_SCALAR_TYPES = frozenset(_SCALARS)
_TENSOR = torch.Tensor
#: Items of a list, tuple or dict input whose version counters are read.
MAX_ITEMS = 64


def read(
    args: tuple, kwargs: dict, device: torch.device, readable: bool, versions: bool
) -> Tuple[bool, Optional[list]]:
    """`(in place, versions)`: whether every input is a tensor already on `device`, or a plain scalar (sending them
    would change nothing; where the tensors cannot tell, on the plain CPU, a CPU tensor is in place), and, if asked
    for, the input tensors' version counters (`snapshot`'s), in one pass."""
    host = not readable and device.type == "cpu"  # read without making a device object per tensor
    placed, found = True, [] if versions else None
    for label, value in itertools.chain(enumerate(args), kwargs.items()) if args else kwargs.items():
        kind = type(value)
        if kind is _TENSOR:
            if placed:
                placed = (
                    value.is_cpu
                    if host
                    else value.device == device or (not readable and value.device.type == device.type)
                )
            if found is not None:
                try:
                    found.append((label, value, value._version))
                except RuntimeError:  # an inference tensor has no version counter (`version_of`)
                    found.append((label, value, None))
        elif kind in _SCALAR_TYPES:
            continue
        else:
            placed = placed and isinstance(value, _SCALARS)
            if found is not None:
                found += _versions(label, value)
    return placed, found


def snapshot(args: tuple, kwargs: dict) -> list:
    """`(label, tensor, version)` of the input tensors (at the first level, and the first `MAX_ITEMS` items of a list,
    tuple or dict), to see an input changed in place by a forward that then failed. Inference tensors have no counter:
    such a change is not seen."""
    found = []
    for label, value in itertools.chain(enumerate(args), kwargs.items()):
        found += _versions(label, value)
    return found


def _versions(label, value) -> list:
    if isinstance(value, torch.Tensor):
        return [(label, value, version_of(value))]
    if isinstance(value, (list, tuple, dict)) and value:
        items = value.values() if isinstance(value, dict) else value
        return [(label, t, version_of(t)) for t in itertools.islice(items, MAX_ITEMS) if isinstance(t, torch.Tensor)]
    return []
