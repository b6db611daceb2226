"""Content fingerprints of device tensors: a vector of 64-bit words that any change of the tensors' bits changes,
whatever their dtype, computed on their own device in one read of their bytes.

The bytes are read as 64-bit words (the last few of a tensor one byte per word) in chunks of `CHUNK` words. Each
chunk is combined once with a pseudo-random word per position, into a scratch buffer small enough to stay in the
processor's cache (the only read of the weights from memory), then mixed in place there (multiply, xor-shift,
multiply, xor-shift: a bijection whose output bits each depend on every input bit) and summed modulo 2**64. The
fingerprint is the vector of those sums, one per chunk, in a fixed order: a chunk's sum changes unless the
pseudo-random differences of its changed words cancel (about 2**-64 for any change: sign flips, single-bit flips at
any position, element swaps), and contents moved between chunks or tensors change the vector's order. (A plain or
linearly weighted sum of the raw bits is not enough: flipping the top bit of every element of a float64 tensor with
an even number of elements wraps both away.)

No tensor is cloned and nothing is read back to the host: `same` compares two fingerprints on the device and returns
a device flag, read once by the eviction that needs it.

One pass per fingerprint: every chunk of every tensor of a component is listed in one work table and folded by one
fused kernel where the device has one (`FUSED`: on CUDA the Triton kernel of `fused_fingerprint.py`, one launch per
fingerprint whatever the bytes; tests register a fake for the simulated accelerator). It is trusted only after it
matched the eager folding here on a probe, on that device (`_engine`); elsewhere, or when it did not, the eager
folding runs, in batches of rows of `CHUNK` words (`ROWS`: 1 on the CPU, whose cache holds one chunk; 16 elsewhere,
sixteen times fewer kernel launches than chunk by chunk: the review measured about 4,900 launches per GB before).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch
from diffusers.utils import logging

logger = logging.get_logger(f"diffusers.{__name__}")

#: Words mixed per step: the scratch buffers (three of this many int64 words) stay in the cache.
CHUNK = 1 << 18
#: Integer dtypes by element size; 16-byte elements (complex128) are read as two int64 words.
_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.int64}
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
#: Tensors below this many bytes are fingerprinted together: a few kernels for all of them.
SMALL = 1 << 20
#: Rows of `CHUNK` words the eager folding mixes per batch, by device type (elsewhere: `ROWS_ELSEWHERE`).
ROWS = {"cpu": 1}
ROWS_ELSEWHERE = 16
#: Device type -> makes the fused folding for a device: `(parts, positions) -> int64 vector of chunk sums`, one per
#: `CHUNK` words of each part in order (as `_fold_eager`), or `None` where it cannot. Tests add a fake for `cpu`.
FUSED: Dict[str, Callable[[torch.device], Optional[Callable]]] = {}
_engines: Dict[str, Optional[Callable]] = {}


def _cuda_fused(device: torch.device) -> Optional[Callable]:
    from .fused_fingerprint import cuda_fused  # imports Triton: only when a CUDA device fingerprints

    return cuda_fused(device, CHUNK, (_C1, _C2), _SHIFTS)


FUSED["cuda"] = _cuda_fused


def _signed(value: int) -> int:
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >> 63 else value


_C1 = _signed(0xBF58476D1CE4E5B9)
_C2 = _signed(0x94D049BB133111EB)
_GOLDEN = _signed(0x9E3779B97F4A7C15)
_SHIFTS = (31, 29)
_LOW = {shift: (1 << (64 - shift)) - 1 for shift in (27, 29, 30, 31)}
_positions: Dict[torch.device, torch.Tensor] = {}


def _xorshift_(x: torch.Tensor, tmp: torch.Tensor, shift: int) -> None:
    """`x ^= x >>> shift` (a logical shift made from an arithmetic one and a mask), through `tmp`."""
    torch.bitwise_right_shift(x, shift, out=tmp)
    tmp.bitwise_and_(_LOW[shift])
    x.bitwise_xor_(tmp)


def _mix_(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 words, in place (small vectors only: it allocates its temporaries)."""
    for shift, factor in ((30, _C1), (27, _C2)):
        x.bitwise_xor_((x >> shift) & _LOW[shift])
        x.mul_(factor)
    x.bitwise_xor_((x >> 31) & _LOW[31])
    return x


def _position_words(device: torch.device) -> torch.Tensor:
    """The pseudo-random word of each position in a chunk, on `device`, made once (read-only, shared)."""
    words = _positions.get(device)
    if words is None or words.device != device:
        words = _positions[device] = _mix_(torch.arange(1, CHUNK + 1, dtype=torch.int64, device=device) * _GOLDEN)
    return words


def fingerprintable(tensor: torch.Tensor) -> bool:
    """Whether `fingerprints` can read `tensor`'s bits: a plain dense tensor of a supported element size."""
    return (
        type(tensor) in _PLAIN_TYPES
        and tensor.layout == torch.strided
        and not tensor.is_quantized
        and tensor.device.type != "meta"
        and tensor.element_size() in _INTS
    )


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a 1-D uint8 tensor, without a copy where it is contiguous."""
    return tensor.detach().reshape(-1).contiguous().view(torch.uint8)


def _words(raw: torch.Tensor) -> List[torch.Tensor]:
    """`raw` (uint8) as int64 words: a view of its 8-byte words where its start is 8-aligned, and its remaining bytes
    one per word (a small copy)."""
    main = raw.numel() // 8 * 8 if raw.data_ptr() % 8 == 0 else 0
    parts = [raw[:main].view(torch.int64)] if main else []
    if main < raw.numel():
        parts.append(raw[main:].to(torch.int64))
    return parts


def _fold_eager(parts: List[torch.Tensor], positions: torch.Tensor) -> torch.Tensor:
    """The mixed, position-salted sum of each chunk of `CHUNK` words of each part, in order (the parts are only read;
    the work is done in two scratch buffers of at most `ROWS` chunks)."""
    device = positions.device
    rows = ROWS.get(device.type, ROWS_ELSEWHERE)
    size = min(CHUNK * rows, max(p.numel() for p in parts))
    # Made per call, not cached: two threads fingerprinting on one device never share them.
    scratch = (
        torch.empty(size, dtype=torch.int64, device=device),
        torch.empty(size, dtype=torch.int64, device=device),
    )
    sums: List[torch.Tensor] = []
    for words in parts:
        full = words.numel() // CHUNK * CHUNK
        for start in range(0, full, CHUNK * rows):
            count = min(CHUNK * rows, full - start) // CHUNK
            batch = words[start : start + count * CHUNK].view(count, CHUNK)
            sums.append(_mix_rows(batch, positions[None, :], scratch, count, CHUNK))
        if full < words.numel():
            tail = words[full:]
            sums.append(_mix_rows(tail[None, :], positions[None, : tail.numel()], scratch, 1, tail.numel()))
    return torch.cat(sums)


def _mix_rows(batch, positions, scratch, count: int, width: int) -> torch.Tensor:
    """Each row of `batch` (`count` x `width` words) salted with `positions`, mixed, summed: `count` sums."""
    x, t = scratch[0][: count * width].view(count, width), scratch[1][: count * width].view(count, width)
    torch.bitwise_xor(batch, positions, out=x)  # the one read of the weights
    x.mul_(_C1)
    _xorshift_(x, t, _SHIFTS[0])
    x.mul_(_C2)
    _xorshift_(x, t, _SHIFTS[1])
    return x.sum(dim=1)


def _engine(device: torch.device) -> Optional[Callable]:
    """The fused folding for `device`, made once and trusted only after it matched `_fold_eager` on a probe there
    (three chunks and a tail, random words); `None`: the eager folding runs (said once, in one info line)."""
    key = str(device)
    if key not in _engines:
        factory = FUSED.get(device.type)
        fused = factory(device) if factory is not None else None
        if fused is not None:
            generator = torch.Generator().manual_seed(31)
            probe = torch.randint(-(2**62), 2**62, (3 * CHUNK + 1001,), dtype=torch.int64, generator=generator)
            parts = [probe.to(device), probe[:77].to(device)]
            positions = _position_words(device)
            try:
                ok = torch.equal(fused(parts, positions).cpu(), _fold_eager(parts, positions).cpu())
                reason = "it did not match the eager folding on a probe"
            except Exception as error:  # a kernel that cannot compile or run here: the eager folding is the fallback
                ok, reason = False, f"it raised {type(error).__name__}: {str(error).splitlines()[0][:160]}"
            if not ok:
                logger.info(f"change detection's fused fingerprint is off on {key}: {reason}; eager chunks instead")
                fused = None
        _engines[key] = fused
    return _engines[key]


def fingerprints(tensors: List[torch.Tensor]) -> Optional[torch.Tensor]:
    """One int64 vector for `tensors` (all fingerprintable, on one device, in a fixed order) that changes whenever
    any bit of any of them changes: one word per chunk of each large tensor, then of the small ones packed together.
    `None` if one of them cannot be read."""
    if not all(fingerprintable(t) for t in tensors):
        return None
    parts: List[torch.Tensor] = []
    small = []
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes >= SMALL:
            parts += _words(_byte_view(tensor))
        elif nbytes:
            small.append(_byte_view(tensor))
    if small:
        parts += _words(torch.cat(small))  # read once into one buffer (a new, 8-aligned allocation)
    if not parts:
        return torch.zeros(0, dtype=torch.int64, device=tensors[0].device if tensors else None)
    positions = _position_words(parts[0].device)
    fused = _engine(parts[0].device)
    return fused(parts, positions) if fused is not None else _fold_eager(parts, positions)


def fingerprint(tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """`fingerprints([tensor])`: an int64 vector on `tensor`'s device, `None` if it cannot be read."""
    return fingerprints([tensor])


def same(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> torch.Tensor:
    """Whether fingerprints `a` and `b` are equal, as a 0-dim bool tensor on their device: no host synchronisation
    until it is read."""
    if a is None or b is None or a.shape != b.shape or a.device != b.device:
        return torch.tensor(False)
    return torch.eq(a, b).all()
