"""`PinnedStore`: page-locks the host storage of offloaded components in place, within a host-memory budget, so that
onloads copy from page-locked memory.

`Tensor.pin_memory()` would copy each tensor into a new allocation rounded up to a power of two (1.7-1.9x host memory
in reports); this store instead registers each existing storage with the device driver where it lies (safetensors'
mapped weights included: measured fastest on an H200, `docs/benchmarks-gpu.md`), through a `Locker` that leaves no
error behind (`locking.py`) and one process-wide, page-granular record of what is registered (`page_ranges.py`):
nothing is registered twice (a storage two components share, two storages sharing a page), memory page-locked by
someone else is used as it is, and nothing is unregistered before the copies that read it are done (`fence`). It lets
go of a component's storages when they stop being its weights (a copy-back into new host memory, a structure
change), when the component is garbage collected, and on `release`.

The host budget is spent first on what moves most often: each component's onloads are counted, and a component
that does not fit takes the place of components onloaded less often. Over budget, or when the driver refuses, the
component stays in pageable memory, with one log line. Tensor subclasses (quantized, GGUF, ...) and sparse tensors
stay pageable.
"""

from __future__ import annotations

import os
import sys
import weakref
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
from diffusers.utils import logging

from .locking import Locker, cuda_locker
from .page_ranges import PageRanges, pointer_of
from .self_check import Verdict, check

logger = logging.get_logger(f"diffusers.{__name__}")

HOST = torch.device("cpu")
#: Of the host's memory (the smaller of physical memory and the cgroup limit), the share page-locked memory may take.
HOST_SHARE = 0.25 if sys.platform == "win32" else 0.5


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
        self.ranges = PageRanges(locker)
        self.budget = int(HOST_SHARE * host_memory_bytes()) if budget is None else budget
        #: With a host budget in force (`host/keeper.py`): returns the room it leaves, which replaces `budget`.
        self.limit: Optional[Callable[[], Optional[int]]] = None
        self._pins: Dict[int, Dict[int, int]] = {}  # component id -> storage pointer -> bytes
        self._uses: Dict[int, int] = {}
        self._finalizers: Dict[int, weakref.finalize] = {}
        self._said = set()

    @property
    def pinned_bytes(self) -> int:
        """Bytes this store page-locked (each storage once, however many components share it)."""
        return self.ranges.locked_bytes

    def bytes_of(self, module: torch.nn.Module) -> int:
        """Page-locked bytes of `module`'s storages."""
        return sum(self._pins.get(id(module), {}).values())

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`'s storage is page-locked (a copy from it may be asynchronous)."""
        return self.ranges.holds(pointer_of(tensor))

    def prepare(self, module: torch.nn.Module, name: str = "", device: Optional[torch.device] = None) -> bool:
        """Before an onload from the host to `device`: count it, and make `module`'s host storages page-locked (in
        `device`'s context) if the budget allows (storages that stopped being its weights are let go). Returns whether
        every one of them is."""
        key = id(module)
        self._uses[key] = self._uses.get(key, 0) + 1
        if key not in self._finalizers:
            finalizer = self._finalizers[key] = weakref.finalize(module, self.release_key, key)
            finalizer.atexit = False  # at exit the driver lets every registration go: no call into CUDA then
        wanted = self.forget_stale(module)
        pins = self._pins.setdefault(key, {})
        missing = {p: v for p, v in wanted.items() if p not in pins and p is not None}
        needed = sum(n for p, (_, n) in missing.items() if not self.ranges.holds(p))
        if missing and self._make_room(key, needed, name):
            for pointer, (tensor, nbytes) in missing.items():
                code = self.ranges.lock(tensor, pointer, nbytes, key, device)
                if code != 0:
                    self._say(
                        "refused",
                        f"page-locking `{name}` was refused by the driver (code {code}): it stays in "
                        "pageable memory",
                    )
                    break
                pins[pointer] = nbytes
        return len(pins) == len(wanted)

    def forget_stale(self, module: torch.nn.Module) -> Dict[int, Tuple[torch.Tensor, int]]:
        """Let go of the storages that are no longer `module`'s host weights; returns the ones that are."""
        key = id(module)
        wanted = _host_storages(module.parameters(), module.buffers())
        pins = self._pins.get(key, {})
        for pointer in [p for p in pins if p not in wanted]:
            del pins[pointer]
            self.ranges.unlock(pointer, key)
        return wanted

    def fence(self, tensors: Iterable[torch.Tensor], event, lane: object) -> None:
        """Copies reading `tensors` were queued on stream `lane`: their memory stays registered until `event` is
        done (`None`: the copies are done already)."""
        if event is not None:
            self.ranges.fence([pointer_of(t) for t in tensors], event, lane)

    def fence_module(self, module: torch.nn.Module, event, lane: object) -> None:
        """`fence` for every storage page-locked for `module`."""
        if event is not None:
            self.ranges.fence(list(self._pins.get(id(module), {})), event, lane)

    def release(self, module: torch.nn.Module) -> None:
        """Let go of every storage of `module` (its offload ends, or it is no longer offloaded): once the copies still
        reading released memory are done (waited for here: never on the per-step path), it is unregistered."""
        self.release_key(id(module))
        self.ranges.settle()
        finalizer = self._finalizers.pop(id(module), None)
        if finalizer is not None:
            finalizer.detach()

    def release_key(self, key: int) -> None:
        for pointer in list(self._pins.get(key, {})):
            self.ranges.unlock(pointer, key)
        self._pins.pop(key, None)
        self._uses.pop(key, None)

    def settle(self) -> None:
        """Wait for the copies still reading released memory, and unregister it."""
        self.ranges.settle()

    def cap(self) -> int:
        """Most bytes page-locked at once: the room the host budget leaves where one is in force, else `budget`."""
        room = self.limit() if self.limit is not None else None
        return self.budget if room is None else room

    def _make_room(self, key: int, needed: int, name: str) -> bool:
        cap = self.cap()
        free = cap - self.pinned_bytes
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
            free += sum(self._pins[other].values())
        if free < needed:
            self._say(
                "budget",
                f"the page-locked host memory budget ({cap} bytes) is spent: `{name}` and "
                "components like it stay in pageable memory",
            )
            return False
        for other in victims:
            for pointer in list(self._pins[other]):
                del self._pins[other][pointer]
                self.ranges.unlock(pointer, other)
        return True

    def _say(self, what: str, message: str) -> None:
        if what not in self._said:
            self._said.add(what)
            logger.warning(message)


#: Device type -> makes the `Locker` that page-locks host memory for it (`None` where it cannot). Tests add one for
#: the simulated accelerator.
LOCKERS: Dict[str, Callable[[torch.device], Optional[Locker]]] = {"cuda": cuda_locker}
_STORES: Dict[str, Optional[PinnedStore]] = {}
#: Each device's self-check (`self_check.py`), by `str(device)`: made once, the first time the device asks.
_VERDICTS: Dict[str, Verdict] = {}


def store_of_type(device_type: str) -> Optional[PinnedStore]:
    """The process's page-locked store for a device type (made on first use; one record of what is registered for
    every device of the type: registrations are portable), or `None` where host memory cannot be page-locked."""
    if device_type not in _STORES and device_type in LOCKERS:
        locker = LOCKERS[device_type](torch.device(device_type))
        _STORES[device_type] = PinnedStore(locker) if locker is not None else None  # asked once
    return _STORES.get(device_type)


def store_for(device: torch.device) -> Optional[PinnedStore]:
    """The page-locked store for `device`, or `None` where host memory cannot be page-locked for it or its self-check
    (`self_check.check`, once per device) failed: then copies stay pageable, and one info line said why."""
    store = store_of_type(device.type)
    if store is None:
        return None
    key = str(device)
    if key not in _VERDICTS:
        from ..transfer import synchronous  # the transfer layer imports this module: read late

        _VERDICTS[key] = check(device, store.ranges.locker, device.type in synchronous.STREAM_DEVICES)
        if not _VERDICTS[key].ok:
            logger.info(f"page-locked copies are off on {key}: {_VERDICTS[key].reason}; host copies stay pageable")
    return store if _VERDICTS[key].ok else None


def verdict(device: torch.device) -> Optional[str]:
    """What `device`'s self-check found, in words (`None` before it ran)."""
    found = _VERDICTS.get(str(device))
    return None if found is None else found.reason


def existing_store(device: torch.device) -> Optional[PinnedStore]:
    """The store for `device`'s type if one was made; never makes one."""
    return _STORES.get(device.type)


def unpin(device: Optional[torch.device], modules) -> None:
    """Let the page-locked store of `device` go of `modules`' host memory (they left offload, or page-locking was
    turned off); the memory itself stays, pageable."""
    store = existing_store(device) if device is not None else None
    if store is not None:
        for module in modules:
            store.release(module)


def _host_storages(*groups: Iterable[torch.Tensor]) -> Dict[int, Tuple[torch.Tensor, int]]:
    """`data_ptr -> (tensor, bytes)` of each distinct host storage; a tensor that cannot be page-locked (a subclass,
    a sparse tensor) is entered under the key `None`, so that the component never counts as all page-locked."""
    found: Dict[int, Tuple[torch.Tensor, int]] = {}
    for group in groups:
        for tensor in group:
            if tensor.device != HOST:
                continue
            if not pinnable(tensor):
                found[None] = (tensor, 0)
                continue
            storage = tensor.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in found:
                found[storage.data_ptr()] = (tensor.detach(), storage.nbytes())  # the tensor keeps the storage alive
    return found
