"""Bytes of a component for any weights dtype, from its element counts (floating tensors, which take the weights'
dtype, and the others, which keep their own), without torch."""

from __future__ import annotations

from typing import Dict, Mapping, Optional

from .errors import PlanError

#: Bytes per element of every dtype a component's tensors may have.
ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "complex128": 16,
    "complex64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
#: The dtypes weights may be planned in, with their short names.
WEIGHT_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "float16": "float16",
    "fp16": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float8_e4m3fn": "float8_e4m3fn",
    "fp8": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2",
}
#: `--dtype denoiser=...` names every denoiser of the model.
DENOISER = "denoiser"


def parse_dtype(text: str, *, argument: str = "--dtype") -> str:
    """The canonical name of weights dtype `text` (`"bf16"` -> `"bfloat16"`, `"fp8"` -> `"float8_e4m3fn"`)."""
    name = WEIGHT_DTYPES.get(str(text).strip().lower())
    if name is None:
        known = ", ".join(WEIGHT_DTYPES)
        raise PlanError(f"{argument}: unknown dtype {str(text)[:40]!r}; known: {known}.", argument)
    return name


def parse_dtype_overrides(values, components, denoisers) -> Dict[str, str]:
    """`{component: dtype}` from `COMPONENT=DTYPE` texts (`denoiser=fp8` names every denoiser)."""
    overrides: Dict[str, str] = {}
    for value in values or ():
        if "=" not in str(value):
            raise PlanError(f"--dtype takes COMPONENT=DTYPE (e.g. transformer=fp8 or denoiser=fp8), got {value!r}.")
        name, dtype = (part.strip() for part in str(value).split("=", 1))
        names = list(denoisers) if name == DENOISER else [name]
        if name != DENOISER and name not in components:
            known = ", ".join([*components, DENOISER])
            raise PlanError(f"--dtype names unknown component {name[:40]!r}; known: {known}.", "--dtype")
        for target in names:
            overrides[target] = parse_dtype(dtype)
    return overrides


def component_bytes(counts: Mapping, dtype: str) -> int:
    """Bytes of a component whose floating tensors are in `dtype`.

    Args:
        counts (`Mapping`): `{"floating": elements of floating tensors, "other": {dtype: elements}}` (the recorded
            counts of the shipped model data, or of a build on the meta device).
        dtype (`str`): A canonical dtype name (see `parse_dtype`).
    """
    nbytes = int(counts["floating"]) * ITEMSIZE[dtype]
    for other, elements in counts.get("other", {}).items():
        nbytes += int(elements) * ITEMSIZE[other]
    return nbytes


def describe(counts: Mapping, dtype: str, class_name: Optional[str] = None) -> dict:
    """The JSON-ready description of one component: class, dtype, parameters, elements and bytes."""
    return {
        "class": class_name or counts.get("class"),
        "dtype": dtype,
        "parameters": int(counts["parameters"]),
        "elements": int(counts["floating"]) + sum(int(n) for n in counts.get("other", {}).values()),
        "nbytes": component_bytes(counts, dtype),
    }
