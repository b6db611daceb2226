"""Bytes of a component for any weights dtype or quantized format, from its element counts (floating tensors, which
take the weights' dtype, and the others, which keep their own; for a format, the `Linear` weights it quantizes, in its
own layout), without torch."""

from __future__ import annotations

import difflib
from typing import Dict, Mapping, NamedTuple, Optional

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


class Format(NamedTuple):
    """A quantized layout of `Linear` weights: `block_bytes` per `block` elements (rows split into whole blocks), plus
    `row_bytes` per output row and `matrix_bytes` per weight; the component's other tensors keep its dtype."""

    block: int
    block_bytes: int
    row_bytes: int = 0
    matrix_bytes: int = 0
    what: str = ""


#: The quantized formats weights may be planned in, by their own layouts.
FORMATS = {
    # bitsandbytes 4-bit: two values a byte, a float32 absmax per 64 values, a 16-entry float32 code per weight.
    "nf4": Format(64, 36, 0, 64, "bitsandbytes NF4"),
    "fp4": Format(64, 36, 0, 64, "bitsandbytes FP4"),
    # bitsandbytes LLM.int8: one byte a value and a float32 scale per row (SCB).
    "int8": Format(1, 1, 4, 0, "bitsandbytes 8-bit (LLM.int8)"),
    # GGUF (ggml block layouts).
    "q8_0": Format(32, 34, 0, 0, "GGUF Q8_0"),
    "q5_1": Format(32, 24, 0, 0, "GGUF Q5_1"),
    "q5_0": Format(32, 22, 0, 0, "GGUF Q5_0"),
    "q4_1": Format(32, 20, 0, 0, "GGUF Q4_1"),
    "q4_0": Format(32, 18, 0, 0, "GGUF Q4_0"),
    "q6_k": Format(256, 210, 0, 0, "GGUF Q6_K"),
    "q5_k": Format(256, 176, 0, 0, "GGUF Q5_K"),
    "q4_k": Format(256, 144, 0, 0, "GGUF Q4_K"),
    "q3_k": Format(256, 110, 0, 0, "GGUF Q3_K"),
    "q2_k": Format(256, 84, 0, 0, "GGUF Q2_K"),
}
#: Formats whose components cannot move (`layout.cannot_move`): bitsandbytes 8-bit leaves its row scales and matmul
#: state where it was loaded, so the runtime never moves it; the planner holds it there.
CANNOT_MOVE = ("int8",)
#: `--dtype denoiser=...` names every denoiser of the model.
DENOISER = "denoiser"


def parse_dtype(text: str, *, argument: str = "--dtype", formats: bool = True) -> str:
    """The canonical name of weights dtype `text` (`"bf16"` -> `"bfloat16"`, `"fp8"` -> `"float8_e4m3fn"`), or of a
    quantized format (`"nf4"`, `"int8"`, `"q8_0"`, `"Q4_K"`) when `formats`."""
    key = str(text).strip().lower()
    name = WEIGHT_DTYPES.get(key) or (key if formats and key in FORMATS else None)
    if name is None:
        choices = [*WEIGHT_DTYPES, *(FORMATS if formats else ())]
        raise PlanError(
            f"{argument}: unknown dtype {str(text)[:40]!r}{nearest(key, choices)}; known: {', '.join(choices)}.",
            argument,
        )
    return name


def nearest(text: str, choices) -> str:
    """`" (did you mean 'nf4'?)"` for the choice nearest `text`, else `""`."""
    near = difflib.get_close_matches(str(text)[:40], list(choices), n=1, cutoff=0.6)
    return f" (did you mean {near[0]!r}?)" if near else ""


def parse_dtype_overrides(values, components, denoisers) -> Dict[str, str]:
    """`{component: dtype}` from `COMPONENT=DTYPE` texts (`denoiser=fp8` names every denoiser)."""
    overrides: Dict[str, str] = {}
    pairs = [part for value in values or () for part in str(value).split(",")]  # `a=nf4,b=int8` or repeated
    for value in pairs:
        if "=" not in str(value):
            raise PlanError(
                f"--dtype takes COMPONENT=DTYPE[,COMPONENT=DTYPE...] (e.g. transformer=nf4,text_encoder_2=int8 or "
                f"denoiser=fp8), got {value[:60]!r}.",
                "--dtype",
            )
        name, dtype = (part.strip() for part in str(value).split("=", 1))
        names = list(denoisers) if name == DENOISER else [name]
        if name != DENOISER and name not in components:
            choices = [*components, DENOISER]
            raise PlanError(
                f"--dtype names unknown component {name[:40]!r}{nearest(name, choices)}; known: {', '.join(choices)}.",
                "--dtype",
            )
        for target in names:
            overrides[target] = parse_dtype(dtype)
    return overrides


def format_bytes(linear, fmt: Format) -> int:
    """Bytes of `Linear` weights `(elements, rows, matrices)` in format `fmt` (rows split into whole blocks)."""
    elements, rows, matrices = (int(n) for n in linear)
    return -(-elements // fmt.block) * fmt.block_bytes + rows * fmt.row_bytes + matrices * fmt.matrix_bytes


def component_bytes(counts: Mapping, dtype: str, rest: str = "float32") -> int:
    """Bytes of a component whose floating tensors are in `dtype`, or whose `Linear` weights are in the quantized
    format `dtype` and its other floating tensors in `rest`.

    Args:
        counts (`Mapping`): `{"floating": elements of floating tensors, "other": {dtype: elements}, "linear":
            [elements, rows, matrices] of the Linear weights a format stores (not those the class keeps
            unquantized)}` (the recorded counts of the shipped model data, or of a build on the meta device).
        dtype (`str`): A canonical dtype name or format (see `parse_dtype`).
        rest (`str`, *optional*): The dtype of the floating tensors a format leaves alone (the component's own).
    """
    floating = int(counts["floating"])
    if dtype in FORMATS:
        linear = counts.get("linear")
        if linear is None:
            raise PlanError(f"the planner has no Linear weight counts for {counts.get('class')}: cannot size {dtype}.")
        kept = int(linear[3]) if len(linear) > 3 else 0  # the class keeps them in float32 when quantized
        nbytes = (
            format_bytes(linear[:3], FORMATS[dtype]) + kept * 4 + (floating - int(linear[0]) - kept) * ITEMSIZE[rest]
        )
    else:
        nbytes = floating * ITEMSIZE[dtype]
    for other, elements in counts.get("other", {}).items():
        nbytes += int(elements) * ITEMSIZE[other]
    return nbytes


def describe(counts: Mapping, dtype: str, class_name: Optional[str] = None, rest: str = "float32") -> dict:
    """The JSON-ready description of one component: class, dtype (a format: with `rest`, the dtype of what it leaves
    alone), parameters, elements and bytes."""
    described = {
        "class": class_name or counts.get("class"),
        "dtype": dtype,
        "parameters": int(counts["parameters"]),
        "elements": int(counts["floating"]) + sum(int(n) for n in counts.get("other", {}).values()),
        "nbytes": component_bytes(counts, dtype, rest),
    }
    if dtype in FORMATS:
        described["format"] = FORMATS[dtype].what
        described["rest_dtype"] = rest
    return described
