"""`Locker`s: page-lock host memory ranges with the CUDA driver so that no refusal is ever left behind as an error.

Measured on an H200 (`docs/benchmarks-gpu.md`): `cudaHostRegister` through `torch.cuda.cudart()` leaves a refusal
(code 1 on memory from `pin_memory()`, 712 on a range registered twice) as the runtime's last error, and the next,
unrelated PyTorch kernel raises it; the driver API (`cuMemHostRegister_v2` / `cuMemHostUnregister` on
`libcuda.so.1`) returns the same codes and poisons nothing, accepts a start and size that are not page-aligned, and
the range then reads `is_pinned()` and copies at 53 GB/s. So `DriverLocker` is used wherever the driver library
loads; else `RuntimeLocker` calls the runtime torch itself loaded and clears its last error after every refusal
(`cudaGetLastError` of that very library: `cuda.bindings`' runtime is another one, whose error state is separate);
where neither can be had, nothing is page-locked.

Registrations are portable (`CU_MEMHOSTREGISTER_PORTABLE`, `cudaHostRegisterPortable`: page-locked for every CUDA
context, not only the one that registered them, so that a pipeline on `cuda:1` and one on `cuda:0` share one record)
and are made in the context of the device that asks (the driver API pushes that device's primary context for each
call; the runtime is put on that device first). PyTorch does the same for its own page-locked allocations: its
caching host allocator allocates under a device that already has a primary context, and its `is_pinned()` asks under
one too (`aten/src/ATen/cuda/CachingHostAllocator.cpp`, `CUDAHooks::isPinnedPtr`), so that no context is created
on a device nobody uses. No call here synchronizes a device: a finaliser that unregisters memory at exit must not
wait for every stream of the device.

The libraries are found through `load_library` and `loaded_path`, which tests replace with a fake driver
(`diffusers_offload_ext/testing/page_locking.py`).
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Dict, Optional

import torch
from diffusers.utils import logging

logger = logging.get_logger(f"diffusers.{__name__}")

#: The driver's library, by platform.
DRIVER = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
#: `CU_MEMHOSTREGISTER_PORTABLE` (driver) and `cudaHostRegisterPortable` (runtime), the same bit: the memory is
#: page-locked for every context. (The H200 probes registered with 0, page-locked for the registering context only.)
PORTABLE = 0x01
FLAGS = PORTABLE


def device_index(device: Optional[torch.device]) -> int:
    """The CUDA ordinal `device` names (0 when it names none)."""
    return 0 if device is None or device.index is None else int(device.index)


class Locker:
    """Registers host memory ranges with a device driver. `register` / `unregister` return the driver's code, 0 for
    success, and leave no error behind either way; `device` is the device that asks (its context registers)."""

    def register(self, pointer: int, nbytes: int, device: Optional[torch.device] = None) -> int:
        raise NotImplementedError

    def unregister(self, pointer: int, device: Optional[torch.device] = None) -> int:
        raise NotImplementedError


def load_library(name: str):
    """The shared library `name` (`ctypes.CDLL`), or `None` where it cannot be loaded."""
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def loaded_path(fragment: str) -> Optional[str]:
    """The path of a shared library already loaded in this process whose file name contains `fragment` (Linux:
    `/proc/self/maps`), or `None`."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            for line in maps:
                path = line.split()[-1]
                if path.startswith("/") and fragment in os.path.basename(path):
                    return path
    except OSError:
        pass
    return None


class DriverLocker(Locker):
    """`cuMemHostRegister_v2` / `cuMemHostUnregister` of the driver API: a refusal is a return code, nothing more.
    Each call runs with the asking device's primary context pushed (`cuDevicePrimaryCtxRetain`, retained once per
    device for the life of the locker, as the runtime keeps it; `cuCtxPushCurrent_v2` / `cuCtxPopCurrent_v2`), and an
    unregistration in the context that registered the range.

    Args:
        library: The driver library (`libcuda.so.1`).
    """

    def __init__(self, library) -> None:
        self.library = library
        self._contexts: Dict[int, ctypes.c_void_p] = {}
        self._owners: Dict[int, int] = {}  # pointer -> the ordinal whose context registered it
        void_p, c_int, c_uint = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint
        signatures = {
            "cuInit": [c_uint],
            "cuDeviceGet": [ctypes.POINTER(c_int), c_int],
            "cuDevicePrimaryCtxRetain": [ctypes.POINTER(void_p), c_int],
            "cuCtxPushCurrent_v2": [void_p],
            "cuCtxPopCurrent_v2": [ctypes.POINTER(void_p)],
            "cuMemHostRegister_v2": [void_p, ctypes.c_size_t, c_uint],
            "cuMemHostUnregister": [void_p],
        }
        for name, arguments in signatures.items():
            function = getattr(library, name)
            function.argtypes, function.restype = arguments, c_int

    def _context(self, ordinal: int) -> Optional[ctypes.c_void_p]:
        context = self._contexts.get(ordinal)
        if context is None:
            handle, context = ctypes.c_int(), ctypes.c_void_p()
            if self.library.cuInit(0) != 0 or self.library.cuDeviceGet(ctypes.byref(handle), ordinal) != 0:
                return None
            if self.library.cuDevicePrimaryCtxRetain(ctypes.byref(context), handle.value) != 0:
                return None
            self._contexts[ordinal] = context
        return context

    def _in_context(self, ordinal: int, call) -> int:
        context = self._context(ordinal)
        if context is None:
            return 201  # CUDA_ERROR_INVALID_CONTEXT: nothing was registered
        pushed = self.library.cuCtxPushCurrent_v2(context)
        if pushed != 0:
            return int(pushed)
        try:
            return int(call())
        finally:
            self.library.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))

    def register(self, pointer: int, nbytes: int, device: Optional[torch.device] = None) -> int:
        ordinal = device_index(device)
        code = self._in_context(ordinal, lambda: self.library.cuMemHostRegister_v2(pointer, nbytes, FLAGS))
        if code == 0:
            self._owners[pointer] = ordinal
        return code

    def unregister(self, pointer: int, device: Optional[torch.device] = None) -> int:
        ordinal = self._owners.pop(pointer, device_index(device))
        return self._in_context(ordinal, lambda: self.library.cuMemHostUnregister(pointer))


class RuntimeLocker(Locker):
    """`cudaHostRegister` / `cudaHostUnregister` through `runtime` (PyTorch's bindings), on the asking device
    (`torch.cuda.device`), the runtime's last error read and cleared after each refusal through `last_error`
    (`cudaGetLastError` of the same library), and checked cleared (`peek`, `cudaPeekAtLastError`)."""

    def __init__(self, runtime, last_error, peek) -> None:
        self.runtime, self.last_error, self.peek = runtime, last_error, peek
        self._owners: Dict[int, Optional[torch.device]] = {}

    def _checked(self, code: int) -> int:
        if code != 0:
            self.last_error()
            left = int(self.peek())
            if left != 0:
                logger.warning(f"the CUDA runtime kept error {left} after a refused page-lock (code {code})")
        return code

    @staticmethod
    def _on(device: Optional[torch.device], call) -> int:
        if device is None or device.type != "cuda":
            return call()
        with torch.cuda.device(device):
            return call()

    def register(self, pointer: int, nbytes: int, device: Optional[torch.device] = None) -> int:
        code = self._checked(_code(self._on(device, lambda: self.runtime.cudaHostRegister(pointer, nbytes, FLAGS))))
        if code == 0:
            self._owners[pointer] = device
        return code

    def unregister(self, pointer: int, device: Optional[torch.device] = None) -> int:
        device = self._owners.pop(pointer, device)
        return self._checked(_code(self._on(device, lambda: self.runtime.cudaHostUnregister(pointer))))


def _code(result) -> int:
    return int(getattr(result, "value", result))


def cuda_locker(device: torch.device) -> Optional[Locker]:
    """The locker for CUDA: the driver API where its library loads, else PyTorch's runtime with its last error
    cleared after refusals, else `None` (host memory stays pageable)."""
    driver = load_library(DRIVER)
    if driver is not None and hasattr(driver, "cuMemHostRegister_v2") and hasattr(driver, "cuCtxPushCurrent_v2"):
        return DriverLocker(driver)
    path = loaded_path("libcudart")
    runtime_library = load_library(path) if path else None
    if runtime_library is not None:
        get, peek = runtime_library.cudaGetLastError, runtime_library.cudaPeekAtLastError
        get.restype = peek.restype = ctypes.c_int
        return RuntimeLocker(torch.cuda.cudart(), get, peek)
    logger.warning(
        "neither the CUDA driver library nor PyTorch's CUDA runtime could be loaded to page-lock host memory "
        "without leaving an error behind: host copies stay in pageable memory"
    )
    return None
