"""Content fingerprints of device tensors: a 64-bit value that any change of a tensor's bits changes, whatever its
dtype, computed on the tensor's own device.

Each element's bits, read as an integer of the element's width, are mixed with a pseudo-random word derived from the
element's position (and the chunk it falls in) and passed through the splitmix64 finaliser, a bijection with full
avalanche; the fingerprint is the sum of the mixed words modulo 2**64. A change of any set of elements changes the sum
unless the pseudo-random differences cancel, which happens with probability about 2**-64 whatever the change: sign
flips, single-bit flips at any position, element swaps. (A plain or linearly weighted sum of the raw bits is not
enough: flipping the top bit of every element of a float64 tensor with an even number of elements wraps both away.)
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

#: Elements fingerprinted per step (bounds the temporary memory: a few int64 buffers of this length).
CHUNK = 1 << 22
#: Integer dtypes by element size; 16-byte elements (complex128) are read as two int64 words.
_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.int64}
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _signed(value: int) -> int:
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >> 63 else value


_C1 = _signed(0xBF58476D1CE4E5B9)
_C2 = _signed(0x94D049BB133111EB)
_GOLDEN = _signed(0x9E3779B97F4A7C15)
_LOW = {shift: (1 << (64 - shift)) - 1 for shift in (27, 30, 31)}
_positions: Dict[Tuple[torch.device, int], torch.Tensor] = {}


def _mix_(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 words, in place (logical shifts made from arithmetic ones and a mask)."""
    x.bitwise_xor_((x >> 30) & _LOW[30])
    x.mul_(_C1)
    x.bitwise_xor_((x >> 27) & _LOW[27])
    x.mul_(_C2)
    x.bitwise_xor_((x >> 31) & _LOW[31])
    return x


def _mix_int(value: int) -> int:
    """The same finaliser on one Python int (chunk salts)."""
    mask = (1 << 64) - 1
    value &= mask
    value ^= value >> 30
    value = (value * (_C1 & mask)) & mask
    value ^= value >> 27
    value = (value * (_C2 & mask)) & mask
    value ^= value >> 31
    return _signed(value)


def _position_words(device: torch.device, n: int) -> torch.Tensor:
    """Pseudo-random words for positions `0..n-1` within a chunk, cached per device."""
    words = _positions.get((device, CHUNK))
    if words is None or words.numel() < n or words.device != device:
        size = min(max(n, 1 << 16), CHUNK)
        words = _mix_(torch.arange(1, size + 1, dtype=torch.int64, device=device) * _GOLDEN)
        _positions[(device, CHUNK)] = words
    return words[:n]


def fingerprintable(tensor: torch.Tensor) -> bool:
    """Whether `fingerprint` can read `tensor`'s bits: a plain dense tensor of a supported element size."""
    return (
        type(tensor) in _PLAIN_TYPES
        and tensor.layout == torch.strided
        and not tensor.is_quantized
        and tensor.device.type != "meta"
        and tensor.element_size() in _INTS
    )


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s bits as a fresh 1-D int64 tensor: eight bytes per word where the bytes are 8-aligned (a bfloat16
    tensor gives a quarter of its element count), then the remaining bytes one per word."""
    raw = tensor.detach().reshape(-1).contiguous()
    raw = raw.view(torch.uint8)
    main = raw.numel() // 8 * 8 if raw.storage_offset() % 8 == 0 else 0
    parts = [raw[:main].view(torch.int64).clone()] if main else []
    if main < raw.numel():
        parts.append(raw[main:].to(torch.int64))
    if not parts:
        return torch.zeros(0, dtype=torch.int64, device=raw.device)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _fold(words: torch.Tensor) -> torch.Tensor:
    """The position-salted, mixed sum of `words` (mixed in place: they must be a copy), as a 0-dim int64 tensor."""
    total = torch.zeros((), dtype=torch.int64, device=words.device)
    for index, start in enumerate(range(0, words.numel(), CHUNK)):
        chunk = words[start : start + CHUNK]
        chunk.bitwise_xor_(_position_words(chunk.device, chunk.numel()))
        chunk.bitwise_xor_(_mix_int(index + 1))
        total += _mix_(chunk).sum()
    return total


def fingerprint(tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """A 0-dim int64 tensor on `tensor`'s device that changes whenever any bit of `tensor` changes; `None` when the
    tensor cannot be read that way (see `fingerprintable`)."""
    if not fingerprintable(tensor):
        return None
    return _fold(_words(tensor))


#: Tensors below this many bytes are fingerprinted together (`fingerprints`): a few kernels for all of them.
SMALL = 1 << 20


def fingerprints(tensors: List[torch.Tensor]) -> Optional[torch.Tensor]:
    """One int64 vector for `tensors` (all fingerprintable, on one device, in a fixed order) that changes whenever
    any bit of any of them changes: each large tensor folded alone, the small ones concatenated and folded together.
    `None` if one of them cannot be read."""
    if not all(fingerprintable(t) for t in tensors):
        return None
    large = [t for t in tensors if t.numel() * t.element_size() >= SMALL]
    small = [t for t in tensors if t.numel() * t.element_size() < SMALL]
    folded = [_fold(_words(t)) for t in large]
    if small:
        folded.append(_fold(torch.cat([_words(t) for t in small])))
    if not folded:
        return torch.zeros(0, dtype=torch.int64)
    return torch.stack(folded)
