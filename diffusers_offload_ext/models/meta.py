"""Element counts of a model class built from its config on the `meta` device (no weights allocated or read): what
the recorder ships, and what a spec or `--component` with a config that was not recorded needs. The only module of
the planner that imports diffusers or transformers (and, with `block_model`'s block split, torch), always lazily."""

from __future__ import annotations

import functools
import importlib.util
import json
from typing import Mapping, Optional, Tuple

from .errors import MissingPackage, PlanError
from .sizes import ITEMSIZE

LIBRARIES = ("diffusers", "transformers")


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def model_class(class_name: str, library: Optional[str] = None) -> Tuple[type, str]:
    """The class `class_name` from `library` (or from diffusers, then transformers) and the library it came from.

    Raises:
        `MissingPackage`: the library that has (or may have) it is not installed.
        `PlanError`: no installed library has it.
    """
    libraries = [library] if library else list(LIBRARIES)
    for lib in libraries:
        if lib not in LIBRARIES:
            raise PlanError(f"Class {class_name!r}: unknown library {lib!r}; known: {', '.join(LIBRARIES)}.")
        if not _installed(lib):
            continue
        module = importlib.import_module(lib)
        if hasattr(module, class_name):
            return getattr(module, class_name), lib
    missing = [lib for lib in libraries if not _installed(lib)]
    if missing:
        raise MissingPackage(missing[0], f"building {class_name} on the meta device to count its parameters")
    versions = ", ".join(f"{lib} {importlib.import_module(lib).__version__}" for lib in libraries)
    hint = " (Wan models need diffusers>=0.33)" if class_name.startswith(("Wan", "AutoencoderKLWan")) else ""
    raise PlanError(f"Class {class_name!r} is not in the installed {versions}{hint}.")


def count_elements(class_name: str, library: Optional[str], config: Mapping) -> dict:
    """`{"class", "library", "parameters", "floating", "other": {dtype: elements}, "linear": [elements, rows,
    matrices] of the Linear weights a quantized format stores}` of the model built on meta."""
    counts = dict(_count(class_name, library, json.dumps(config, sort_keys=True)))
    counts["other"] = dict(counts["other"])
    return counts


def build_on_meta(class_name: str, library: Optional[str], config_json: str):
    """The model `class_name` built from its config (JSON text) on the `meta` device: no weights allocated.

    Raises:
        `MissingPackage`, `PlanError`: see `model_class`; `PlanError` too when the config does not build.
    """
    import torch

    cls, lib = model_class(class_name, library)
    config = {k: v for k, v in json.loads(config_json).items() if not k.startswith("_")}
    try:
        with torch.device("meta"):
            return cls.from_config(config) if lib == "diffusers" else cls(cls.config_class(**config))
    except Exception as error:
        raise PlanError(f"Cannot build {class_name} from its config on the meta device: {error}") from error


def tally(tensors, class_name: str) -> Tuple[int, dict]:
    """`(floating elements, {dtype: elements} of the others)` of `tensors` (each given once) of `class_name`."""
    floating, other = 0, {}
    for tensor in tensors:
        if tensor.is_floating_point():
            floating += tensor.numel()
        else:
            dtype = str(tensor.dtype).replace("torch.", "")
            if dtype not in ITEMSIZE:
                raise PlanError(f"{class_name} has a tensor of dtype {dtype}, which the planner cannot size.")
            other[dtype] = other.get(dtype, 0) + tensor.numel()
    return floating, other


def linear_weights(slots, names=None, kept=()) -> Tuple[int, int, int]:
    """`(elements, rows, matrices)` of the `Linear` weights among `slots` (`(module, is_parameter, name)`, each tensor
    once): what a quantized format (`sizes.FORMATS`) stores in its own layout. Modules the class keeps unquantized
    (`kept`: its `_keep_in_fp32_modules`, T5's `wo`) are left out; `names` maps `id(module)` to its qualified name."""
    import torch

    elements = rows = matrices = 0
    for module, is_parameter, name in slots:
        weight = module._parameters.get(name) if is_parameter else None
        if name != "weight" or not isinstance(module, torch.nn.Linear) or weight is None or weight.dim() != 2:
            continue
        if kept and any(part in kept for part in (names or {}).get(id(module), "").split(".")):
            continue
        elements, rows, matrices = elements + weight.numel(), rows + weight.shape[0], matrices + 1
    return elements, rows, matrices


def kept_in_fp32(model) -> Tuple[tuple, dict]:
    """`(the class's _keep_in_fp32_modules, {id(module): qualified name})` of `model`."""
    kept = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    return kept, {id(module): name for name, module in model.named_modules()}


def module_slots(model) -> list:
    """`(module, is_parameter, name)` of every parameter and buffer of `model`, each tensor once."""
    seen, slots = set(), []
    for module in model.modules():
        for is_parameter, table in ((True, module._parameters), (False, module._buffers)):
            for name, tensor in table.items():
                if tensor is not None and id(tensor) not in seen:
                    seen.add(id(tensor))
                    slots.append((module, is_parameter, name))
    return slots


@functools.lru_cache(maxsize=64)
def _count(class_name: str, library: Optional[str], config_json: str) -> tuple:
    model = build_on_meta(class_name, library, config_json)
    _, lib = model_class(class_name, library)
    unique = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    floating, other = tally(unique.values(), class_name)
    parameters = sum(p.numel() for p in model.parameters())
    return (
        ("class", class_name),
        ("library", lib),
        ("parameters", parameters),
        ("floating", floating),
        ("other", dict(sorted(other.items()))),
        ("linear", list(linear_weights(module_slots(model), *reversed(kept_in_fp32(model))))),
    )
