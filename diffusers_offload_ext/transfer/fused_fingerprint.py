"""The fused fingerprint for CUDA: one Triton kernel folds every chunk of every tensor of a component in one launch,
reading each weight once from device memory, and gives exactly the sums of `fingerprint._fold_eager` (the same
salt, mix and wrap-around sums, in unsigned 64-bit arithmetic, whose bits are those of the signed one).

A work table lists each chunk as `(address, words)` (built on the host, copied to the device once per
fingerprint); program `i` of the grid folds chunk `i` and writes its sum. Where Triton is not importable the factory
answers `None` and the eager folding runs. `fingerprint._engine` trusts the kernel on a device only after it matched
the eager folding on a probe there. Not run in CI (no GPU): the GPU check runs `tests/test_change_detection.py` on
CUDA, and the tests drive the same wiring with a fake of this kernel (`testing/fused.py`).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch

#: Words each program folds per step of its loop.
BLOCK = 1024


def cuda_fused(
    device: torch.device, chunk: int, factors: Tuple[int, int], shifts: Tuple[int, int]
) -> Optional[Callable]:
    """The fused folding on CUDA device `device` (chunks of `chunk` words; the mix's two `factors` and `shifts`), or
    `None` where Triton cannot be imported."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None
    c1, c2 = (factor & ((1 << 64) - 1) for factor in factors)  # unsigned: Triton types them u64

    @triton.jit
    def fold(table, positions, out, C1, C2, S1: tl.constexpr, S2: tl.constexpr, BLOCK_WORDS: tl.constexpr):
        chunk = tl.program_id(0)
        address = tl.load(table + 2 * chunk)
        count = tl.load(table + 2 * chunk + 1)
        words = address.to(tl.pointer_type(tl.int64))
        total = tl.zeros([BLOCK_WORDS], dtype=tl.uint64)
        for start in range(0, count, BLOCK_WORDS):
            offsets = start + tl.arange(0, BLOCK_WORDS)
            inside = offsets < count
            word = tl.load(words + offsets, mask=inside, other=0).to(tl.uint64, bitcast=True)
            salt = tl.load(positions + offsets, mask=inside, other=0).to(tl.uint64, bitcast=True)
            x = word ^ salt
            x = x * C1
            x = x ^ (x >> S1)
            x = x * C2
            x = x ^ (x >> S2)
            total += tl.where(inside, x, tl.zeros_like(x))
        tl.store(out + chunk, tl.sum(total, axis=0).to(tl.int64, bitcast=True))

    def fused(parts: List[torch.Tensor], positions: torch.Tensor) -> torch.Tensor:
        rows = []
        for words in parts:
            base, count = words.data_ptr(), words.numel()
            rows += [(base + 8 * start, min(chunk, count - start)) for start in range(0, count, chunk)]
        # From page-locked memory and non-blocking: a blocking copy waits for the whole stream (PyTorch's copy kernel,
        # aten/src/ATen/native/cuda/Copy.cu, calls c10/cuda's memcpy_and_sync: cudaMemcpyAsync then
        # cudaStreamSynchronize), where a non-blocking one from its caching host allocator's memory records an event
        # that keeps the host tensor until the copy is done.
        table = torch.tensor(rows, dtype=torch.int64).reshape(-1).pin_memory().to(device, non_blocking=True)
        out = torch.empty(len(rows), dtype=torch.int64, device=device)
        with torch.cuda.device(device):
            fold[(len(rows),)](table, positions, out, c1, c2, shifts[0], shifts[1], BLOCK)
        return out

    return fused
