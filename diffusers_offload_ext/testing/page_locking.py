"""`fake_page_locking`: a stand-in for the CUDA driver and runtime's page-locking of host memory, so that the
page-locked store runs, through its real `Locker`s, on machines without CUDA (for the simulated accelerator, `cpu:0`).

It models what the first GPU run measured (`docs/benchmarks-gpu.md`) and what the CUDA documentation says:

- pages, not bytes, are locked: a registration whose pages overlap a registered range is refused with 712 ("already
  mapped"), one over memory from `pin_memory()` with 1 (invalid value), one over `limit` bytes with 2 (out of
  memory); unregistering a pointer that does not start a registration is refused with 713;
- through the runtime (`torch.cuda.cudart()`), a refusal stays the runtime's last error until `cudaGetLastError` of
  that library reads it, and every kernel launch raises it (modelled by a forward pre-hook on every module: the next
  layer that runs raises `RuntimeError("CUDA error: ...")`); the driver API (`libcuda.so.1`) returns the same codes and
  leaves nothing behind;
- `Tensor.is_pinned()` is true where the tensor's first byte lies in a locked page;
- a copy still reading memory that gets unregistered is recorded (`torn`): the streams fake
  (`testing/copy_stream.py`) makes such a copy deliver NaN;
- the driver's contexts: `cuDevicePrimaryCtxRetain` gives device `d` the context `CONTEXT + d`, pushed and popped
  around calls; each registration records its flags and the context current when it was made (`registrations`);
- `corrupt=True`: a driver whose page-locked copies deliver wrong bytes (every copy to the device from page-locked
  memory arrives changed), for the self-check (`pinning/self_check.py`).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
from typing import Dict, Iterator, List, Optional, Set, Tuple

import torch
from torch.overrides import TorchFunctionMode

from ..pinning import locking, store as pinned

PAGE = 4096
#: The fake context of device `d` is `CONTEXT + d`.
CONTEXT = 1000
#: CUDA's codes (the driver's and the runtime's agree on these).
INVALID_VALUE, OUT_OF_MEMORY, ALREADY_REGISTERED, NOT_REGISTERED = 1, 2, 712, 713
MESSAGES = {
    INVALID_VALUE: "invalid argument",
    OUT_OF_MEMORY: "out of memory",
    ALREADY_REGISTERED: "part or all of the requested memory range is already mapped",
    NOT_REGISTERED: "pointer does not correspond to a registered memory region",
}
RUNTIME_PATH = "/fake/libcudart.so.13"


class FakeHostMemory:
    """The page-locking state of the process, and the driver and runtime entry points over it.

    Attributes:
        registered (`Dict[int, int]`): Start -> bytes of every registered range.
        calls (`List[Tuple[str, str, int]]`): `(api, "register" | "unregister", pointer)`, in order.
        last_error (`int`): The runtime's sticky last error (0: none).
        poisoned (`List[str]`): The errors kernels raised.
    """

    def __init__(self, refuse: Optional[int] = None, limit: Optional[int] = None, corrupt: bool = False) -> None:
        self.refuse, self.limit, self.corrupt = refuse, limit, corrupt
        #: `(pointer, nbytes, flags, context)` of every registration the driver accepted, in order.
        self.registrations: List[Tuple[int, int, int, Optional[int]]] = []
        self.contexts: List[int] = []  # the driver's stack of current contexts
        self.registered: Dict[int, int] = {}
        self._pages: Dict[int, int] = {}  # page -> start of the registration holding it
        self._allocated: Set[int] = set()  # pages of memory from `pin_memory()`
        self.calls: List[Tuple[str, str, int]] = []
        self.refusals: List[int] = []  # the code of every refused registration
        self.last_error = 0
        self.poisoned: List[str] = []
        self.readers: List[object] = []  # objects with `torn(pages)`: copies in flight (the streams fake)
        self.driver = _Library(
            cuMemHostRegister_v2=lambda p, n, flags: self._register("driver", p, n, flags),
            cuMemHostUnregister=lambda p: self._unregister("driver", p),
            cuInit=lambda flags: 0,
            cuDeviceGet=lambda handle, ordinal: _set(handle, ordinal),
            cuDevicePrimaryCtxRetain=lambda context, handle: _set(context, CONTEXT + handle),
            cuCtxPushCurrent_v2=lambda context: self.contexts.append(context) or 0,
            cuCtxPopCurrent_v2=lambda context: _set(context, self.contexts.pop() if self.contexts else 0),
        )
        self.runtime = _Runtime(self)
        self.runtime_library = _Library(cudaGetLastError=self._get_last_error, cudaPeekAtLastError=self._peek)

    # -- the model ----------------------------------------------------------------------------------------------
    @staticmethod
    def pages(pointer: int, nbytes: int) -> range:
        return range(pointer // PAGE, -(-(pointer + max(nbytes, 1)) // PAGE))

    def _register(self, api: str, pointer: int, nbytes: int, flags: int = 0) -> int:
        self.calls.append((api, "register", pointer))
        code = self._refusal(self.pages(pointer, nbytes))
        if code:
            self.refusals.append(code)
            return code
        pages = self.pages(pointer, nbytes)
        self.registered[pointer] = nbytes
        context = self.contexts[-1] if api == "driver" and self.contexts else None
        self.registrations.append((pointer, nbytes, flags, context))
        for page in pages:
            self._pages[page] = pointer
        return 0

    def _refusal(self, pages: range) -> int:
        if self.refuse is not None:
            return self.refuse
        if any(p in self._allocated for p in pages):
            return INVALID_VALUE
        if any(p in self._pages for p in pages):
            return ALREADY_REGISTERED
        if self.limit is not None and (len(self._pages) + len(pages)) * PAGE > self.limit:
            return OUT_OF_MEMORY
        return 0

    def _unregister(self, api: str, pointer: int) -> int:
        self.calls.append((api, "unregister", pointer))
        nbytes = self.registered.pop(pointer, None)
        if nbytes is None:
            return NOT_REGISTERED
        pages = set(self.pages(pointer, nbytes))
        for page in pages:
            del self._pages[page]
        for reader in self.readers:
            reader.torn(pages)
        return 0

    def _get_last_error(self) -> int:
        error, self.last_error = self.last_error, 0
        return error

    def _peek(self) -> int:
        return self.last_error

    def kernel(self) -> None:
        """A kernel launch: it raises the runtime's last error, which reading clears (as PyTorch's check does)."""
        if self.last_error:
            error = self._get_last_error()
            self.poisoned.append(MESSAGES.get(error, str(error)))
            raise RuntimeError(f"CUDA error: {MESSAGES.get(error, error)}")

    def is_pinned(self, tensor: torch.Tensor, device=None) -> bool:
        if tensor.device.type != "cpu" or not tensor.numel():
            return False
        page = tensor.data_ptr() // PAGE
        return page in self._pages or page in self._allocated

    def locked(self, pointer: int, nbytes: int) -> bool:
        """Whether every page of `[pointer, pointer + nbytes)` is page-locked."""
        return all(p in self._pages or p in self._allocated for p in self.pages(pointer, nbytes))

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor.pin_memory()`: a copy in page-locked memory the driver mapped for it (whole pages of its own)."""
        nbytes = tensor.numel() * tensor.element_size()
        mapping = mmap.mmap(-1, -(-max(nbytes, 1) // PAGE) * PAGE)
        buffer = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive
        copy = buffer[:nbytes].view(tensor.dtype).view(tensor.shape)
        copy.copy_(tensor)
        self._allocated.update(self.pages(buffer.data_ptr(), buffer.numel()))
        return copy


class _Library:
    """A shared library: its functions are attributes (ctypes sets `argtypes` / `restype` on them)."""

    def __init__(self, **functions) -> None:
        for name, function in functions.items():
            setattr(self, name, _Function(function))


class _Function:
    def __init__(self, function) -> None:
        self.function = function

    def __call__(self, *args):
        return self.function(*[getattr(a, "value", a) if isinstance(a, ctypes.c_void_p) else a for a in args])


def _set(reference, value: int) -> int:
    """Write `value` through a `ctypes.byref` argument, as the driver writes its out-parameters; returns 0."""
    reference._obj.value = value
    return 0


class _Corrupting(TorchFunctionMode):
    """Every copy to the device from page-locked host memory arrives changed (`FakeHostMemory(corrupt=True)`)."""

    def __init__(self, memory: FakeHostMemory) -> None:
        super().__init__()
        self.memory = memory

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func is torch.Tensor.copy_ and len(args) > 1 and isinstance(args[1], torch.Tensor):
            dst, src = args[0], args[1]
            nbytes = src.numel() * src.element_size()
            if src.device.type == "cpu" and nbytes and self.memory.locked(src.data_ptr(), nbytes):
                with torch._C.DisableTorchFunction():
                    if dst.dtype != torch.bool:
                        dst.add_(1)
        return result


class _Runtime:
    """What `torch.cuda.cudart()` returns: a refusal stays the last error."""

    def __init__(self, memory: FakeHostMemory) -> None:
        self.memory = memory

    def _sticky(self, code: int) -> int:
        if code != 0:
            self.memory.last_error = code
        return code

    def cudaHostRegister(self, pointer: int, nbytes: int, flags: int) -> int:
        return self._sticky(self.memory._register("runtime", pointer, nbytes, flags))

    def cudaHostUnregister(self, pointer: int) -> int:
        return self._sticky(self.memory._unregister("runtime", pointer))


_ACTIVE: List[FakeHostMemory] = []


def active() -> Optional[FakeHostMemory]:
    """The fake in force, if any (the streams fake asks it which host memory is page-locked)."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def fake_page_locking(
    budget: Optional[int] = None,
    refuse: Optional[int] = None,
    api: str = "driver",
    limit: Optional[int] = None,
    corrupt: bool = False,
) -> Iterator[Tuple[FakeHostMemory, "pinned.PinnedStore"]]:
    """Within the block, host memory can be "page-locked" for devices of type `cpu` (the simulated accelerator)
    through the same lockers as for CUDA, over a `FakeHostMemory`: `api="driver"` offers the driver library,
    `api="runtime"` only PyTorch's runtime (and its loaded library). Yields the fake and the store, whose budget is
    `budget` if given; every registration is refused with code `refuse` if given; with `corrupt`, page-locked copies
    to the device deliver wrong bytes. Each device's self-check runs afresh inside the block."""
    memory = FakeHostMemory(refuse, limit, corrupt)
    saved = (dict(pinned.LOCKERS), dict(pinned._STORES), locking.load_library, locking.loaded_path)
    saved_verdicts = dict(pinned._VERDICTS)
    pinned._VERDICTS.clear()
    saved_cudart, saved_is_pinned = torch.cuda.cudart, torch.Tensor.__dict__.get("is_pinned")
    libraries = {RUNTIME_PATH: memory.runtime_library}
    if api == "driver":
        libraries[locking.DRIVER] = memory.driver
    locking.load_library = libraries.get
    locking.loaded_path = lambda fragment: RUNTIME_PATH if fragment == "libcudart" else None
    torch.cuda.cudart = lambda: memory.runtime
    torch.Tensor.is_pinned = lambda tensor, device=None: memory.is_pinned(tensor)
    cuda = saved[0]["cuda"]
    pinned.LOCKERS["cpu"] = lambda *device: cuda(*device)
    pinned._STORES.pop("cpu", None)
    kernels = torch.nn.modules.module.register_module_forward_pre_hook(lambda module, args: memory.kernel())
    _ACTIVE.append(memory)
    corrupting = _Corrupting(memory) if corrupt else None
    try:
        if corrupting is not None:
            corrupting.__enter__()
        store = pinned.store_of_type("cpu")
        if budget is not None:
            store.budget = budget
        yield memory, store
    finally:
        if corrupting is not None:
            corrupting.__exit__(None, None, None)
        pinned._VERDICTS.clear()
        pinned._VERDICTS.update(saved_verdicts)
        _ACTIVE.remove(memory)
        kernels.remove()
        pinned.LOCKERS.clear()
        pinned.LOCKERS.update(saved[0])
        pinned._STORES.clear()
        pinned._STORES.update(saved[1])
        locking.load_library, locking.loaded_path = saved[2], saved[3]
        torch.cuda.cudart = saved_cudart
        if saved_is_pinned is None:
            del torch.Tensor.is_pinned
        else:
            torch.Tensor.is_pinned = saved_is_pinned
