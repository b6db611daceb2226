"""Re-mapping a component's anonymous host weights onto its safetensors files: each one whose stored counterpart
(`files.py`: same name, dtype and shape) holds the very same bytes is replaced by a view of a private, copy-on-write
mapping of the file, and its anonymous memory goes back to the kernel.

The mapping is made by `torch.UntypedStorage.from_file(path, shared=False)` (as safetensors' own loader maps a file):
the file is opened read-only and never written; reading a weight reads the page cache (`RssFile`), which the kernel
may drop and read again. A write to such a weight (`p.data += delta`, a LoRA fused in place) copies the written pages
into anonymous memory, as any private mapping does: the edit stays this process's, the file is untouched. Nothing is
re-mapped on trust: a tensor without a stored counterpart, with other bytes, that is not a plain contiguous CPU tensor
owning its whole storage (a view of a larger storage stays: its neighbours share it), stays as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Dict, NamedTuple

import torch
from diffusers.utils import logging

from ..storages import tensor_parts
from .files import Stored, candidates
from .regions import Regions

logger = logging.get_logger(f"diffusers.{__name__}")


class Prepared(NamedTuple):
    """A re-mapping checked and ready (`prepare`), nothing changed yet: each `(slots, tensor, view)` to assign, the
    bytes that become file-backed (`mapped`), and the bytes that stay anonymous by reason (`reasons`)."""

    assignments: list
    mapped: int
    reasons: Dict[str, int]

    @property
    def kept(self) -> int:
        return sum(self.reasons.values())


def mapping(path: str) -> torch.UntypedStorage:
    """A private (copy-on-write) mapping of the whole file at `path`, opened read-only."""
    return torch.UntypedStorage.from_file(path, shared=False, nbytes=os.path.getsize(path))


def view_of(storage: torch.UntypedStorage, stored: Stored) -> torch.Tensor:
    """The tensor `stored` describes, as a view of `storage` (the mapping of its file): no copy."""
    data = torch.asarray(storage[stored.start : stored.end], dtype=torch.uint8)
    return data.view(stored.dtype).reshape(stored.shape)


def unfit(tensor: torch.Tensor) -> str:
    """Why `tensor` cannot be replaced by a view of its file (empty: it can)."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.layout != torch.strided:
        return "not a plain tensor"
    if tensor.device.type != "cpu":
        return "not on the host"
    if not tensor.is_contiguous() or tensor.storage_offset() != 0:
        return "a view of a larger storage"
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        return "a view of a larger storage"
    return ""


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` hold the same bytes (NaN payloads and signed zeros included)."""
    return a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).view(torch.uint8)


def prepare(module: torch.nn.Module, folder: str, regions: Regions) -> Prepared:
    """Find, for each anonymous host weight of `module`, a view of the very same bytes in `folder`'s safetensors
    files (reading both: nothing is taken on trust); changes nothing. Weights already file-backed are left alone."""
    files: Dict[str, torch.UntypedStorage] = {}
    assignments, mapped, reasons = [], 0, {}
    for slots, tensor, stored in candidates(module, folder).values():
        if tensor.device.type != "cpu" or regions.file_of(tensor.data_ptr()) is not None:
            continue
        nbytes = sum(p.numel() * p.element_size() for p in tensor_parts(tensor))
        alike = [item for item in stored if item.dtype == tensor.dtype and item.shape == tuple(tensor.shape)]
        reason = unfit(tensor) or _unmatched(stored, alike)
        view = None
        for item in [] if reason else alike:
            if item.path not in files:
                files[item.path] = mapping(item.path)
            candidate = view_of(files[item.path], item)
            if same_bytes(tensor, candidate):
                view = candidate
                break
        if view is None:
            reason = reason or "other bytes than the checkpoint's (changed, or converted on loading)"
            reasons[reason] = reasons.get(reason, 0) + nbytes
            continue
        assignments.append((slots, tensor, view))
        mapped += nbytes
    return Prepared(assignments, mapped, reasons)


def _unmatched(stored, alike) -> str:
    """Why no stored tensor of the same name can stand for `tensor` before its bytes are read (empty: some may)."""
    if not stored:
        return "not in the checkpoint's files"
    if not alike:
        return "in the checkpoint's files with another dtype or shape (converted on loading)"
    return ""


def apply(prepared: Prepared) -> int:
    """Assign what `prepare` found (the weights become views of their files) and give the freed anonymous memory
    back to the kernel; returns the bytes re-mapped. `prepared` is spent."""
    for item in prepared.assignments:
        _assign(*item)
    item = None  # noqa: F841 - nor the loop's
    prepared.assignments.clear()  # the last references to the anonymous tensors go
    if prepared.mapped:
        give_back_freed()
    return prepared.mapped


def remap(module: torch.nn.Module, folder: str, regions: Regions) -> Prepared:
    """`prepare` then `apply`: `module`'s anonymous host weights that are in `folder`'s files become views of them."""
    prepared = prepare(module, folder, regions)
    apply(prepared)
    return prepared


def _assign(slots, tensor: torch.Tensor, view: torch.Tensor) -> None:
    """Every slot holding `tensor` holds `view` instead (a parameter keeps its object: its `.data` changes)."""
    if isinstance(tensor, torch.nn.Parameter):
        tensor.data = view
        return
    for sub, is_param, key in slots:
        (sub._parameters if is_param else sub._buffers)[key] = view


_LIBC = []


def give_back_freed() -> bool:
    """Ask the C allocator to return freed memory to the kernel (`malloc_trim(0)`, glibc): freed weights smaller than
    its mapping threshold stay in its heap otherwise, counted as the process's anonymous memory. Whether it could."""
    if not _LIBC:
        name = ctypes.util.find_library("c")
        try:
            _LIBC.append(getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None)
        except OSError:
            _LIBC.append(None)
    trim = _LIBC[0]
    if trim is None:
        return False
    trim(0)
    return True
