"""Where a component's weights lie in its safetensors checkpoint: the folder it was loaded from (diffusers and
transformers record it as the config's `_name_or_path`; else the pipeline's `name_or_path` and the component's name),
the files' headers (read and checked, never trusted), and each weight matched by name, dtype, shape and size to a byte
range of one file.

`from_pretrained` keeps no record of which file a tensor came from, so a match is only a candidate: `remap.py`
compares the bytes before it uses one. The format (safetensors): 8 bytes, the little-endian length `n` of a JSON
header, the header (`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`), then the data,
offsets relative to byte `8 + n`.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from typing import Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch

#: Longest header read (safetensors' own limit), files per folder looked at.
MAX_HEADER, MAX_FILES = 100_000_000, 512
_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "U16": "uint16", "U32": "uint32", "U64": "uint64",
}  # fmt: skip
DTYPES = {name: getattr(torch, dtype) for name, dtype in _DTYPES.items() if hasattr(torch, dtype)}

Slot = Tuple[torch.nn.Module, bool, str]


class Stored(NamedTuple):
    """One tensor of a safetensors file: the file, its dtype and shape, and its bytes `[start, end)` in the file."""

    path: str
    dtype: torch.dtype
    shape: Tuple[int, ...]
    start: int
    end: int


def read_header(path: str) -> Dict[str, Stored]:
    """The tensors of the safetensors file at `path`, checked against the file's size (a tensor of an unknown dtype,
    or whose range does not hold exactly its elements, is left out). Empty where the file is not a safetensors file."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > min(MAX_HEADER, size - 8):
                return {}
            header = json.loads(f.read(length))
    except (OSError, struct.error, ValueError, UnicodeDecodeError):
        return {}
    if not isinstance(header, dict):
        return {}
    base, found = 8 + length, {}
    for name, info in header.items():
        stored = _stored(path, info, base, size) if name != "__metadata__" else None
        if stored is not None:
            found[name] = stored
    return found


def _stored(path: str, info: object, base: int, size: int) -> Optional[Stored]:
    try:
        dtype = DTYPES.get(info["dtype"])
        shape = tuple(int(d) for d in info["shape"])
        begin, end = (int(x) for x in info["data_offsets"])
    except (KeyError, TypeError, ValueError):
        return None
    if dtype is None or any(d < 0 for d in shape) or not 0 <= begin <= end or base + end > size:
        return None
    numel = 1
    for d in shape:
        numel *= d
    if end - begin != numel * torch.empty(0, dtype=dtype).element_size():
        return None
    return Stored(path, dtype, shape, base + begin, base + end)


def folder_of(module: torch.nn.Module, pipeline_path: Optional[str] = None, name: str = "") -> Optional[str]:
    """The local folder holding `module`'s safetensors files: the config's `_name_or_path` (diffusers and transformers
    record the folder `from_pretrained` read), else `pipeline_path`'s sub-folder `name`; `None` when none exists."""
    config = getattr(module, "config", None)
    recorded = config.get("_name_or_path") if isinstance(config, dict) else getattr(config, "_name_or_path", None)
    candidates = [recorded, getattr(module, "name_or_path", None)]
    if pipeline_path:
        candidates.append(os.path.join(str(pipeline_path), name))
    for candidate in candidates:
        if isinstance(candidate, (str, os.PathLike)) and candidate and os.path.isdir(candidate):
            if glob.glob(os.path.join(glob.escape(str(candidate)), "*.safetensors")):
                return str(candidate)
    return None


def stored_tensors(folder: str) -> Dict[str, List[Stored]]:
    """Every tensor of every `*.safetensors` file in `folder` (variants included: one name may be in several)."""
    found: Dict[str, List[Stored]] = {}
    for path in sorted(glob.glob(os.path.join(glob.escape(folder), "*.safetensors")))[:MAX_FILES]:
        for name, stored in read_header(path).items():
            found.setdefault(name, []).append(stored)
    return found


def named_slots(module: torch.nn.Module) -> Iterator[Tuple[str, Slot, torch.Tensor]]:
    """`(state-dict name, slot, tensor)` of every parameter and persistent buffer of `module` (a tied weight under
    each of its names)."""
    for prefix, sub in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for key, tensor in sub._parameters.items():
            if tensor is not None:
                yield dot + key, (sub, True, key), tensor
        transient = getattr(sub, "_non_persistent_buffers_set", ())
        for key, tensor in sub._buffers.items():
            if tensor is not None and key not in transient:
                yield dot + key, (sub, False, key), tensor


def candidates(module: torch.nn.Module, folder: str) -> Dict[int, Tuple[List[Slot], torch.Tensor, List[Stored]]]:
    """Per tensor object of `module` (by `id`): its slots, the tensor, and the stored tensors of the same name in
    `folder`'s files (what `remap.py` may use where dtype, shape and bytes agree)."""
    stored = stored_tensors(folder)
    found: Dict[int, Tuple[List[Slot], torch.Tensor, List[Stored]]] = {}
    for name, slot, tensor in named_slots(module):
        entry = found.setdefault(id(tensor), ([], tensor, []))
        if slot not in entry[0]:
            entry[0].append(slot)
        entry[2].extend(item for item in stored.get(name, ()) if item not in entry[2])
    return found
