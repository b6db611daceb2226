"""`PinnedStore`: page-locks the host storage of offloaded components in place, within a host-memory budget, so that
onloads copy from page-locked memory.

`Tensor.pin_memory()` would copy each tensor into a new allocation rounded up to a power of two (1.7-1.9x host memory
in reports); this store instead registers each existing storage at its exact size with the device driver, one
storage at a time, every return code checked. It holds a reference to every storage it registered, so that no
registered memory is ever freed before it is unregistered; it lets go of a component's storages when they stop
being its weights (a copy-back into new host memory, a structure change), when the component is garbage collected,
and on `release`.

The host budget is spent first on what moves most often: each component's onloads are counted, and a component
that does not fit takes the place of components onloaded less often. Over budget, or when the driver refuses, the
component stays in pageable memory, with one log line. Tensor subclasses (quantized, GGUF, ...) and sparse tensors
stay pageable.

The driver calls sit behind `Locker` (`CudaLocker` on CUDA); tests give the store a fake one.
"""

from __future__ import annotations

import os
import sys
import weakref
from typing import Dict, Iterable, List, Optional, Tuple

import torch
from diffusers.utils import logging

logger = logging.get_logger(f"diffusers.{__name__}")

HOST = torch.device("cpu")
#: Of the host's memory (the smaller of physical memory and the cgroup limit), the share page-locked memory may take.
HOST_SHARE = 0.25 if sys.platform == "win32" else 0.5


class Locker:
    """Registers host memory ranges with a device driver. `register`/`unregister` return the driver's code, 0 for
    success."""

    def register(self, pointer: int, nbytes: int) -> int:
        raise NotImplementedError

    def unregister(self, pointer: int) -> int:
        raise NotImplementedError


class CudaLocker(Locker):
    """`cudaHostRegister` / `cudaHostUnregister` through PyTorch's CUDA runtime bindings. Not run in CI (no GPU)."""

    def __init__(self) -> None:
        self.runtime = torch.cuda.cudart()

    def register(self, pointer: int, nbytes: int) -> int:
        return _code(self.runtime.cudaHostRegister(pointer, nbytes, 0))

    def unregister(self, pointer: int) -> int:
        return _code(self.runtime.cudaHostUnregister(pointer))


def _code(result) -> int:
    return int(getattr(result, "value", result))


def host_memory_bytes() -> int:
    """Physical memory, or the cgroup's memory limit when it is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path, encoding="ascii") as f:
                limit = f.read().strip()
        except OSError:
            continue
        if limit.isdigit() and 0 < int(limit) < total:
            total = int(limit)
    return total


def pinnable(tensor: torch.Tensor) -> bool:
    """Plain dense CPU tensors only: a subclass may hold its bytes elsewhere than its storage."""
    return type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.layout == torch.strided


class PinnedStore:
    """Page-locked host storages, per component, within `budget` bytes.

    Args:
        locker (`Locker`): The driver calls.
        budget (`int`, *optional*): Most bytes page-locked at once; defaults to `HOST_SHARE` of `host_memory_bytes()`.
    """

    def __init__(self, locker: Locker, budget: Optional[int] = None) -> None:
        self.locker = locker
        self.budget = int(HOST_SHARE * host_memory_bytes()) if budget is None else budget
        self._pins: Dict[int, Dict[int, Tuple[torch.Tensor, int]]] = {}  # component id -> data_ptr -> (tensor, bytes)
        self._uses: Dict[int, int] = {}
        self._finalizers: Dict[int, weakref.finalize] = {}
        self._said = set()

    @property
    def pinned_bytes(self) -> int:
        return sum(n for pins in self._pins.values() for _, n in pins.values())

    def bytes_of(self, module: torch.nn.Module) -> int:
        """Page-locked bytes of `module`'s storages."""
        return sum(n for _, n in self._pins.get(id(module), {}).values())

    def prepare(self, module: torch.nn.Module, name: str = "") -> int:
        """Before an onload from the host: count it, and make `module`'s host storages page-locked if the budget
        allows (storages that stopped being its weights are let go). Returns its page-locked bytes."""
        key = id(module)
        self._uses[key] = self._uses.get(key, 0) + 1
        if key not in self._finalizers:
            self._finalizers[key] = weakref.finalize(module, self.release_key, key)
        wanted = self.forget_stale(module)
        pins = self._pins.setdefault(key, {})
        missing = {p: v for p, v in wanted.items() if p not in pins}
        if missing and self._make_room(key, sum(n for _, n in missing.values()), name):
            for pointer, (tensor, nbytes) in missing.items():
                code = self.locker.register(pointer, nbytes)
                if code != 0:
                    self._say(
                        "refused",
                        f"page-locking `{name}` was refused by the driver (code {code}): it stays in "
                        "pageable memory",
                    )
                    break
                pins[pointer] = (tensor, nbytes)
        return self.bytes_of(module)

    def forget_stale(self, module: torch.nn.Module) -> Dict[int, Tuple[torch.Tensor, int]]:
        """Let go of the storages that are no longer `module`'s host weights; returns the ones that are."""
        key = id(module)
        wanted = _host_storages(module.parameters(), module.buffers())
        for pointer in [p for p in self._pins.get(key, {}) if p not in wanted]:
            self._unregister(key, pointer)
        return wanted

    def release(self, module: torch.nn.Module) -> None:
        """Unregister every storage of `module` (its offload ends, or it is no longer offloaded)."""
        self.release_key(id(module))
        finalizer = self._finalizers.pop(id(module), None)
        if finalizer is not None:
            finalizer.detach()

    def release_key(self, key: int) -> None:
        for pointer in list(self._pins.get(key, {})):
            self._unregister(key, pointer)
        self._pins.pop(key, None)
        self._uses.pop(key, None)

    def _make_room(self, key: int, needed: int, name: str) -> bool:
        free = self.budget - self.pinned_bytes
        if needed <= free:
            return True
        mine = self._uses[key]
        # The least used first; only components used less often than this one give way.
        others = sorted((self._uses.get(k, 0), k) for k in self._pins if k != key and self._pins[k])
        victims: List[int] = []
        for uses, other in others:
            if free >= needed or uses >= mine:
                break
            victims.append(other)
            free += sum(n for _, n in self._pins[other].values())
        if free < needed:
            self._say(
                "budget",
                f"the page-locked host memory budget ({self.budget} bytes) is spent: `{name}` and "
                "components like it stay in pageable memory",
            )
            return False
        for other in victims:
            for pointer in list(self._pins[other]):
                self._unregister(other, pointer)
        return True

    def _unregister(self, key: int, pointer: int) -> None:
        self._pins[key].pop(pointer)
        code = self.locker.unregister(pointer)
        if code != 0:
            logger.warning(f"unregistering page-locked host memory at {pointer:#x} failed (code {code})")

    def _say(self, what: str, message: str) -> None:
        if what not in self._said:
            self._said.add(what)
            logger.warning(message)


#: Device type -> the `Locker` that page-locks host memory for it. Tests add one for the simulated accelerator.
LOCKERS = {"cuda": CudaLocker}
_STORES: Dict[str, PinnedStore] = {}


def store_for(device: torch.device) -> Optional[PinnedStore]:
    """The process's page-locked store for `device`'s type (made on first use), or `None` where host memory cannot be
    page-locked for it."""
    store = _STORES.get(device.type)
    if store is None and device.type in LOCKERS:
        store = _STORES[device.type] = PinnedStore(LOCKERS[device.type]())
    return store


def existing_store(device: torch.device) -> Optional[PinnedStore]:
    """The store for `device`'s type if one was made; never makes one."""
    return _STORES.get(device.type)


def _host_storages(*groups: Iterable[torch.Tensor]) -> Dict[int, Tuple[torch.Tensor, int]]:
    """`data_ptr -> (tensor, bytes)` of each distinct pinnable host storage."""
    found: Dict[int, Tuple[torch.Tensor, int]] = {}
    for group in groups:
        for tensor in group:
            if tensor.device != HOST or not pinnable(tensor):
                continue
            storage = tensor.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in found:
                found[storage.data_ptr()] = (tensor.detach(), storage.nbytes())
    return found
