"""`Locker`s: page-lock host memory ranges with the CUDA driver so that no refusal is ever left behind as an error.

Measured on an H200 (`docs/benchmarks-gpu.md`): `cudaHostRegister` through `torch.cuda.cudart()` leaves a refusal
(code 1 on memory from `pin_memory()`, 712 on a range registered twice) as the runtime's last error, and the next,
unrelated PyTorch kernel raises it; the driver API (`cuMemHostRegister_v2` / `cuMemHostUnregister` on
`libcuda.so.1`) returns the same codes and poisons nothing, accepts a start and size that are not page-aligned, and
the range then reads `is_pinned()` and copies at 53 GB/s. So `DriverLocker` is used wherever the driver library
loads; else `RuntimeLocker` calls the runtime torch itself loaded and clears its last error after every refusal
(`cudaGetLastError` of that very library: `cuda.bindings`' runtime is another one, whose error state is separate);
where neither can be had, nothing is page-locked.

The libraries are found through `load_library` and `loaded_path`, which tests replace with a fake driver
(`diffusers_offload_ext/testing/page_locking.py`).
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Callable, Optional

import torch
from diffusers.utils import logging

logger = logging.get_logger(f"diffusers.{__name__}")

#: The driver's library, by platform.
DRIVER = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
#: `cudaHostRegisterDefault` / no `CU_MEMHOSTREGISTER_*` flag: what the H200 probes measured.
FLAGS = 0


class Locker:
    """Registers host memory ranges with a device driver. `register` / `unregister` return the driver's code, 0 for
    success, and leave no error behind either way."""

    def register(self, pointer: int, nbytes: int) -> int:
        raise NotImplementedError

    def unregister(self, pointer: int) -> int:
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

    Args:
        library: The driver library (`libcuda.so.1`).
        activate (`Callable`): Makes a CUDA context current on the calling thread (the driver API needs one; PyTorch's
            runtime makes the primary context current on a thread once CUDA is used there).
    """

    def __init__(self, library, activate: Callable[[], None]) -> None:
        self.library = library
        self.activate = activate
        library.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        library.cuMemHostRegister_v2.restype = ctypes.c_int
        library.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
        library.cuMemHostUnregister.restype = ctypes.c_int
        library.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        library.cuCtxGetCurrent.restype = ctypes.c_int

    def _current(self) -> None:
        context = ctypes.c_void_p()
        if self.library.cuCtxGetCurrent(ctypes.byref(context)) != 0 or not context.value:
            self.activate()

    def register(self, pointer: int, nbytes: int) -> int:
        self._current()
        return int(self.library.cuMemHostRegister_v2(pointer, nbytes, FLAGS))

    def unregister(self, pointer: int) -> int:
        self._current()
        return int(self.library.cuMemHostUnregister(pointer))


class RuntimeLocker(Locker):
    """`cudaHostRegister` / `cudaHostUnregister` through `runtime` (PyTorch's bindings), the runtime's last error
    read and cleared after each refusal through `last_error` (`cudaGetLastError` of the same library), and checked
    cleared (`peek`, `cudaPeekAtLastError`)."""

    def __init__(self, runtime, last_error: Callable[[], int], peek: Callable[[], int]) -> None:
        self.runtime, self.last_error, self.peek = runtime, last_error, peek

    def _checked(self, code: int) -> int:
        if code != 0:
            self.last_error()
            left = int(self.peek())
            if left != 0:
                logger.warning(f"the CUDA runtime kept error {left} after a refused page-lock (code {code})")
        return code

    def register(self, pointer: int, nbytes: int) -> int:
        return self._checked(_code(self.runtime.cudaHostRegister(pointer, nbytes, FLAGS)))

    def unregister(self, pointer: int) -> int:
        return self._checked(_code(self.runtime.cudaHostUnregister(pointer)))


def _code(result) -> int:
    return int(getattr(result, "value", result))


def _activate(device: torch.device) -> Callable[[], None]:
    def activate() -> None:
        torch.cuda.init()
        torch.cuda.synchronize(device)  # under a device guard: the device's primary context becomes current

    return activate


def cuda_locker(device: torch.device) -> Optional[Locker]:
    """The locker for CUDA: the driver API where its library loads, else PyTorch's runtime with its last error
    cleared after refusals, else `None` (host memory stays pageable)."""
    driver = load_library(DRIVER)
    if driver is not None and hasattr(driver, "cuMemHostRegister_v2"):
        return DriverLocker(driver, _activate(device))
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
