"""Device memory of the simulated accelerator (`simulated_accelerator.py`), counted per storage: a storage counts once
however many device tensors view it, from the first device tensor that holds it to the last one's death or departure;
a new storage past the capacity raises `torch.OutOfMemoryError`, as CUDA's allocator does."""

from __future__ import annotations

from typing import Optional

import torch

try:
    from . import simulated_tensors as walk
except ImportError:  # loaded by path, outside the package (`tests/simulated_accelerator.py` loads its parts first)
    import _simulated_tensors as walk


class StorageCounts:
    """The counting half of `SimulatedAccelerator`: `capacity` (`None`: unlimited, nothing counted), the bytes held
    now (`allocated_bytes`), the most held since `reset_peak()` (`peak_bytes`) and the out-of-memory errors raised."""

    def _start_counts(self, capacity: Optional[int]) -> None:
        self.capacity = capacity
        self._storages: dict[int, list] = {}  # storage address -> [bytes, device tensors holding it]
        #: Bytes of device memory held now, the most held since `reset_peak()`, and the out-of-memory errors raised.
        self.allocated_bytes = 0
        self.peak_bytes = 0
        self.out_of_memory_errors = 0

    def reset_peak(self) -> None:
        """`peak_bytes` starts again from what is held now (`torch.cuda.reset_peak_memory_stats`)."""
        self.peak_bytes = self.allocated_bytes

    def _hold(self, tensor: torch.Tensor, held: Optional[int]) -> Optional[int]:
        """Count the storage behind `tensor` (once per storage, however many tensors view it), given the one its tag
        counted so far; returns the storage's address. Raises `torch.OutOfMemoryError` past the capacity."""
        if walk.is_wrapper(tensor):
            return None  # a wrapper subclass holds no storage of its own: its inner tensors are counted
        try:
            with torch._C.DisableTorchFunction():
                storage = tensor.untyped_storage()
                address, nbytes = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # no storage to count (sparse, ...)
            return None
        if address == held:
            return held
        entry = self._storages.get(address)
        if entry is None:
            if self.allocated_bytes + nbytes > self.capacity:
                self.out_of_memory_errors += 1
                raise torch.OutOfMemoryError(
                    f"Simulated accelerator out of memory. Tried to allocate {nbytes} bytes; {self.allocated_bytes} "
                    f"of its {self.capacity} bytes are allocated."
                )
            entry = self._storages[address] = [nbytes, 0]
            self.allocated_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
        entry[1] += 1
        self._drop_hold(held)
        return address

    def _drop_hold(self, address: Optional[int]) -> None:
        entry = self._storages.get(address) if address is not None else None
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del self._storages[address]
            self.allocated_bytes -= entry[0]
