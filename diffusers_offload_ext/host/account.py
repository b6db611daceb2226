"""Host bytes by kind, measured: for each component, the bytes of its host memory that are page-locked (registered by
this package's page-locked store), anonymous (in RAM for good: the kernel cannot drop them without swap) and
file-backed (a mapping of a checkpoint file, unwritten: the kernel may drop those pages and read them again), read
from the tensors, the store's record and the kernel's maps (`regions.py`), never assumed.

The host budget counts page-locked and anonymous bytes. A file-backed weight that was written (a fused LoRA, an edit
through `.data`) has its written pages copied into anonymous memory by the kernel: `/proc/self/smaps` says how many per
mapping, and they count as anonymous, shared among the components holding that mapping by their bytes in it.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Mapping, NamedTuple, Optional, Tuple

import torch

from ..storages import tensor_parts
from .regions import Regions, written_bytes


class HostBytes(NamedTuple):
    """Host bytes by kind (each storage once).

    Args:
        page_locked (`int`): Registered with the device driver by this package (weights and the staging ring).
        anonymous (`int`): Anonymous memory, not page-locked (weights copied, converted, written; host copies).
        file_backed (`int`): Views of a checkpoint file's mapping, unwritten and not page-locked.
    """

    page_locked: int = 0
    anonymous: int = 0
    file_backed: int = 0

    @property
    def counted(self) -> int:
        """What the host budget counts: page-locked and anonymous bytes."""
        return self.page_locked + self.anonymous

    def plus(self, other: "HostBytes") -> "HostBytes":
        return HostBytes(*(a + b for a, b in zip(self, other)))


def host_tensors(module: torch.nn.Module, kept: Iterable[torch.Tensor] = ()) -> List[torch.Tensor]:
    """The plain host tensors behind `module`'s weights (through tensor subclasses and quantization state), and
    `kept` (a host copy's tensors while the component is on the device)."""
    found = []
    for tensor in [*module.parameters(), *module.buffers()]:
        found += [p for p in tensor_parts(tensor) if p.device.type == "cpu"]
    return found + [t for t in kept if t.device.type == "cpu"]


def _storages(tensors: Iterable[torch.Tensor]) -> Dict[int, int]:
    """`data_ptr -> bytes` of each distinct storage behind `tensors`."""
    found = {}
    for tensor in tensors:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            continue
        if storage.data_ptr() and storage.nbytes():
            found[storage.data_ptr()] = storage.nbytes()
    return found


class Measured(NamedTuple):
    """One measurement: each component's `HostBytes`, and the storages each component holds by kind
    (`anonymous`: `data_ptr -> bytes`, for the page-locking cap)."""

    components: Dict[str, HostBytes]
    anonymous: Dict[str, Dict[int, int]]


def measure(
    tensors: Mapping[str, List[torch.Tensor]], holds: Callable[[int], bool], regions: Optional[Regions] = None
) -> Measured:
    """Host bytes by kind of each component (`tensors`: its host tensors, `host_tensors`); `holds(pointer)` tells
    whether this package page-locked the storage at `pointer`."""
    regions = Regions.read() if regions is None else regions
    kinds: Dict[str, List[int]] = {}
    mapped: Dict[int, Dict[str, int]] = {}  # mapping start -> component -> file-backed bytes in it
    anonymous: Dict[str, Dict[int, int]] = {}
    for name, found in tensors.items():
        counts, anonymous[name] = [0, 0, 0], {}
        for pointer, nbytes in _storages(found).items():
            region = None if holds(pointer) else regions.region_of(pointer)
            if holds(pointer):
                counts[0] += nbytes
            elif region is None:
                counts[1] += nbytes
                anonymous[name][pointer] = nbytes
            else:
                counts[2] += nbytes
                share = mapped.setdefault(region.start, {})
                share[name] = share.get(name, 0) + nbytes
        kinds[name] = counts
    for start, written in written_bytes(mapped).items():
        _share_written(kinds, mapped[start], written)
    return Measured({name: HostBytes(*counts) for name, counts in kinds.items()}, anonymous)


def _share_written(kinds: Dict[str, List[int]], holders: Dict[str, int], written: int) -> None:
    """`written` bytes of one mapping are anonymous now: moved from file-backed to anonymous, shared among its
    `holders` by their bytes in it."""
    total = sum(holders.values())
    for name, nbytes in holders.items():
        moved = min(nbytes, written * nbytes // total) if total else 0
        kinds[name][2] -= moved
        kinds[name][1] += moved


def total(measured: Mapping[str, HostBytes]) -> HostBytes:
    """The sum of several components' `HostBytes`."""
    result = HostBytes()
    for item in measured.values():
        result = result.plus(item)
    return result


def pageable_anonymous(measured: Measured, holds: Callable[[int], bool]) -> int:
    """Anonymous bytes of the measured components that are not page-locked now (each storage once)."""
    seen: Dict[int, int] = {}
    for storages in measured.anonymous.values():
        seen.update(storages)
    return sum(n for pointer, n in seen.items() if not holds(pointer))


def changed(before: Mapping[str, HostBytes], now: Mapping[str, HostBytes]) -> List[Tuple[str, int]]:
    """`(component, bytes)` of the components whose file-backed bytes turned anonymous since `before`."""
    found = []
    for name, was in before.items():
        is_now = now.get(name)
        if is_now is not None and is_now.file_backed < was.file_backed and is_now.anonymous > was.anonymous:
            found.append((name, min(was.file_backed - is_now.file_backed, is_now.anonymous - was.anonymous)))
    return found
