"""Real model sizes without weights, and the transfer planner behind `diffusers-offload plan`.

Component sizes come from the real architectures instantiated on the `meta` device from the configs shipped in
`configs/` (values from the models' published `config.json` files): parameter and buffer counts are exact, and no byte
of weights is read or downloaded. The component-call trace comes from running the matching tiny pipeline (the same
pipeline class, so the same `model_cpu_offload_seq` and the same call order) on the CPU with `doe.trace`.
"""

from __future__ import annotations

import copy
import functools
import json
import os
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from diffusers.utils import logging

from ._residency import parse_size as _residency_parse_size

logger = logging.get_logger(__name__)

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
#: Default host-to-device bandwidth: pageable host memory over PCIe 4.0 x16 (diffusers' offload does not pin memory).
DEFAULT_BANDWIDTH = 12e9
DEFAULT_BANDWIDTH_TEXT = "12GB/s"
#: Left free for activations when checking what fits (the residency manager's default `memory_reserve`).
DEFAULT_RESERVE_TEXT = "3GiB"

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _DTYPES[_name] = getattr(torch, _name)
if "float8_e4m3fn" in _DTYPES:
    _DTYPES["fp8"] = _DTYPES["float8_e4m3fn"]


class PlanError(ValueError):
    """A user error the CLI reports with exit code 2 (unknown model, bad size, unreadable config, ...)."""


# ----------------------------------------------------------------------------------------------------------------
# Parsing
# ----------------------------------------------------------------------------------------------------------------


def parse_size(text: str, *, what: str = "size") -> int:
    """Bytes in `text`: `"24GiB"`, `"24 GB"`, `"1.5TiB"`, `"512MiB"`, `"24e9"` (the grammar of `memory_budget`).

    Raises:
        `PlanError`: `text` is not a positive quantity with a known unit.
    """
    value = _residency_parse_size(str(text))
    if value is None:
        raise PlanError(
            f"Cannot read {what} {text!r}: write a number and a unit such as '24GiB', '24GB', '512MiB' "
            f"(KB/MB/GB/TB = powers of 1000, KiB/MiB/GiB/TiB = powers of 1024)."
        )
    if value <= 0:
        raise PlanError(f"{what.capitalize()} must be positive, got {text!r}.")
    return value


def parse_bandwidth(text: str) -> float:
    """Bytes per second in `text`: `"12GB/s"`, `"25 GiB/s"`, `"12e9"` (bytes per second).

    Raises:
        `PlanError`: `text` is not a positive rate.
    """
    raw = str(text).strip()
    lowered = raw.lower()
    body = raw[:-2] if lowered.endswith(("/s", "ps")) else raw
    try:
        return float(parse_size(body, what="bandwidth"))
    except PlanError:
        raise PlanError(
            f"Cannot read bandwidth {text!r}: write a rate such as '12GB/s' or '25GiB/s' (bytes per second)."
        ) from None


def parse_dtype(text: str) -> torch.dtype:
    """A dtype name (`bfloat16`/`bf16`, `float16`/`fp16`, `float32`/`fp32`, `float8_e4m3fn`/`fp8`)."""
    dtype = _DTYPES.get(str(text).strip().lower())
    if dtype is None:
        raise PlanError(f"Unknown dtype {text!r}; known: {', '.join(sorted(_DTYPES))}.")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# ----------------------------------------------------------------------------------------------------------------
# Model specs
# ----------------------------------------------------------------------------------------------------------------


def shipped_models() -> List[str]:
    """Names of the model specs shipped in `configs/`."""
    return sorted(f[: -len(".json")] for f in os.listdir(CONFIG_DIR) if f.endswith(".json"))


def _read_json(path: str, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as error:
        raise PlanError(f"Cannot read {what} {path!r}: {error.strerror or error}.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise PlanError(f"{what.capitalize()} {path!r} is not valid JSON: {error}.") from None
    if not isinstance(data, dict):
        raise PlanError(f"{what.capitalize()} {path!r} must hold a JSON object.")
    return data


def load_spec(model: str) -> dict:
    """The spec of `model`: a shipped name (`diffusers-offload plan --list`) or the path of a spec JSON file.

    A spec is `{"name", "pipeline", "tiny", "denoisers", "components": {name: {"class", "library", "dtype", "config"
    or "config_path"}}}`; `config_path` (relative to the spec file) points to a model's own `config.json`.

    Raises:
        `PlanError`: unknown name, unreadable or malformed file.
    """
    shipped = os.path.join(CONFIG_DIR, f"{model}.json")
    if os.path.isfile(shipped):
        path = shipped
    elif model.endswith(".json") or os.sep in model or os.path.exists(model):
        path = model
    else:
        raise PlanError(f"Unknown model {model!r}. Known models: {', '.join(shipped_models())}; or pass a spec path.")
    spec = _read_json(path, "model spec")
    base = os.path.dirname(os.path.abspath(path))
    components = spec.get("components")
    if not isinstance(components, dict) or not components:
        raise PlanError(f"Model spec {path!r} has no 'components' object.")
    for name, entry in components.items():
        if not isinstance(entry, dict) or "class" not in entry:
            raise PlanError(f"Component {name!r} of {path!r} needs at least a 'class'.")
        if "config" not in entry:
            if "config_path" not in entry:
                raise PlanError(f"Component {name!r} of {path!r} needs a 'config' object or a 'config_path'.")
            entry["config"] = _read_json(os.path.join(base, entry["config_path"]), f"config of {name!r}")
    spec.setdefault("name", os.path.splitext(os.path.basename(path))[0])
    spec.setdefault("denoisers", [n for n in components if n.startswith(("transformer", "unet"))])
    spec["path"] = path
    return spec


def override_component(spec: dict, text: str) -> dict:
    """Apply `NAME=PATH` or `NAME=CLASS:PATH` (a model's `config.json`) to a copy of `spec`."""
    if "=" not in text:
        raise PlanError(f"--component takes NAME=CONFIG.json or NAME=CLASS:CONFIG.json, got {text!r}.")
    name, value = text.split("=", 1)
    class_name = None
    if ":" in value and not os.path.exists(value):
        class_name, value = value.split(":", 1)
    config = _read_json(value, f"config of {name!r}")
    class_name = class_name or config.get("_class_name") or config.get("architectures", [None])[0]
    if not class_name:
        raise PlanError(f"Say which class {value!r} configures: --component {name}=CLASS:{value}.")
    spec = copy.deepcopy(spec)
    old = spec["components"].get(name, {})
    spec["components"][name] = {
        "class": class_name,
        "library": None,
        "dtype": old.get("dtype", "bfloat16"),
        "config": config,
    }
    return spec


def _model_class(class_name: str, library: Optional[str]):
    import diffusers

    libraries = [library] if library else ["diffusers", "transformers"]
    for lib in libraries:
        if lib == "diffusers" and hasattr(diffusers, class_name):
            return getattr(diffusers, class_name), "diffusers"
        if lib == "transformers":
            try:
                import transformers
            except ImportError:
                continue
            if hasattr(transformers, class_name):
                return getattr(transformers, class_name), "transformers"
    import diffusers as d

    versions = f"diffusers {d.__version__}"
    try:
        import transformers as t

        versions += f", transformers {t.__version__}"
    except ImportError:
        pass
    hint = " (Wan models need diffusers>=0.33)" if class_name.startswith(("Wan", "AutoencoderKLWan")) else ""
    raise PlanError(f"Class {class_name!r} is not in the installed {versions}{hint}.")


@functools.lru_cache(maxsize=64)
def _count(class_name: str, library: Optional[str], config_json: str) -> Tuple[int, Tuple[Tuple[str, int, bool], ...]]:
    """The parameter count, and `(dtype on meta, numel, is floating point)` of every parameter and buffer (each
    tensor once) of `class_name` built from its config on the `meta` device."""
    cls, lib = _model_class(class_name, library)
    config = {k: v for k, v in json.loads(config_json).items() if not k.startswith("_")}
    try:
        with torch.device("meta"):
            if lib == "diffusers":
                model = cls.from_config(config)
            else:
                model = cls(cls.config_class(**config))
    except Exception as error:
        raise PlanError(f"Cannot build {class_name} from its config on the meta device: {error}") from error
    seen = set()
    tensors = []
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        tensors.append((str(tensor.dtype).replace("torch.", ""), tensor.numel(), tensor.is_floating_point()))
    return sum(p.numel() for p in model.parameters()), tuple(tensors)


def component_sizes(spec: dict, dtypes: Optional[Mapping[str, str]] = None) -> Dict[str, dict]:
    """Parameters and bytes of every component of `spec`, built on the `meta` device.

    Args:
        spec (`dict`): From `load_spec`.
        dtypes (`Mapping[str, str]`, *optional*): Dtype overrides by component name (`"denoiser"` names every
            denoiser), e.g. `{"transformer": "float8_e4m3fn"}`.

    Returns:
        `Dict[str, dict]`: per component `class`, `dtype`, `parameters` (count), `buffers` (count of buffer
        elements), `nbytes` (floating tensors at the component's dtype, others at their own).
    """
    dtypes = dict(dtypes or {})
    if "denoiser" in dtypes:
        value = dtypes.pop("denoiser")
        for name in spec.get("denoisers", []):
            dtypes.setdefault(name, value)
    unknown = [n for n in dtypes if n not in spec["components"]]
    if unknown:
        raise PlanError(f"--dtype names unknown components {unknown}; known: {list(spec['components'])}.")
    sizes = {}
    for name, entry in spec["components"].items():
        dtype = parse_dtype(dtypes.get(name, entry.get("dtype", "float32")))
        itemsize = torch.empty((), dtype=dtype).element_size()
        parameters, tensors = _count(entry["class"], entry.get("library"), json.dumps(entry["config"], sort_keys=True))
        nbytes = 0
        for tensor_dtype, numel, floating in tensors:
            nbytes += numel * (
                itemsize if floating else torch.empty((), dtype=getattr(torch, tensor_dtype)).element_size()
            )
        sizes[name] = {
            "class": entry["class"],
            "dtype": dtype_name(dtype),
            "parameters": parameters,
            "elements": sum(numel for _, numel, _ in tensors),
            "nbytes": nbytes,
        }
    return sizes


# ----------------------------------------------------------------------------------------------------------------
# Traces from the tiny pipelines
# ----------------------------------------------------------------------------------------------------------------


def tiny_module():
    """`diffusers_offload_ext.tiny`; in a source checkout without it, `tests/tiny_pipelines.py`."""
    try:
        from . import tiny

        return tiny
    except ImportError:
        pass
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "tiny_pipelines.py")
    if not os.path.isfile(path):
        raise PlanError("The tiny pipelines (diffusers_offload_ext.tiny) are not installed; cannot record a trace.")
    module_spec = importlib.util.spec_from_file_location("_doe_tiny_pipelines", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def record_call_trace(tiny_name: str, *, steps: int, preview: bool = False):
    """Run tiny pipeline `tiny_name` once on the CPU (`steps` steps) under `doe.trace`.

    Returns:
        `(pipe, trace)`: the pipeline (no offload enabled) and the `Trace` with one call's component-call trace.
    """
    from ._trace import trace as start_trace

    tiny = tiny_module()
    ok, reason = tiny.available(tiny_name)
    if not ok:
        raise PlanError(f"Cannot record a trace: {reason}.")
    pipe = tiny.build(tiny_name)
    kwargs = tiny.call_kwargs(tiny_name, preview=preview)
    kwargs["num_inference_steps"] = steps
    with torch.no_grad(), start_trace(pipe) as recorded:
        pipe(**kwargs)
    return pipe, recorded


def pipeline_layout(pipe) -> dict:
    """Order, chain, hooked components and class-excluded components of `pipe`, as offload sees them."""
    from ._options import module_components

    modules = list(module_components(pipe.components))
    sequence = [n.strip() for n in (pipe.model_cpu_offload_seq or "").split("->")]
    chain = [n for n in dict.fromkeys(sequence) if n in modules]
    excluded = [n for n in (getattr(pipe, "_exclude_from_cpu_offload", None) or []) if n in modules]
    return {"order": modules, "chain": chain, "excluded": excluded, "sequence": sequence}


# ----------------------------------------------------------------------------------------------------------------
# The plan
# ----------------------------------------------------------------------------------------------------------------

STRATEGIES = ("stock", "exclude_denoiser", "keep_during_generation", "residency")


def _policies(layout: dict, sizes: Mapping[str, int], denoisers: Sequence[str], budget: int):
    """`{strategy: (policy, call string, zero_copy) or Exception}`, each a fresh policy object."""
    from ._policy import ChainPolicy
    from ._policy import layout as offload_layout

    order, chain, excluded = layout["order"], layout["chain"], layout["excluded"]
    pinned = [n for n in denoisers if n in order]

    sequence = layout["sequence"]

    def chain_policy(pin=(), kept_all=False):
        chain_, hooked, bounce = offload_layout(order, sequence, excluded, pin)
        return ChainPolicy(
            order=order, chain=chain_, hooked=hooked, pinned=pin, bounce=bounce, kept=hooked if kept_all else ()
        )

    names = ", ".join(f'"{n}"' for n in pinned)
    out = {
        "stock": (chain_policy(), "pipe.enable_model_cpu_offload()", False),
        "exclude_denoiser": (
            chain_policy(pin=pinned),
            f"pipe.enable_model_cpu_offload(exclude_from_offload=[{names}])",
            False,
        ),
        "keep_during_generation": (
            chain_policy(kept_all=True),
            "pipe.enable_model_cpu_offload(keep_on_device_during_generation=True)",
            False,
        ),
    }
    try:
        from ._residency import ResidencyPolicy
    except ImportError as error:
        out["residency"] = error
    else:
        chain, hooked, bounce = offload_layout(order, sequence, excluded)
        gib = budget / (1 << 30)
        out["residency"] = (
            ResidencyPolicy(
                order=order,
                chain=chain,
                hooked=hooked,
                sizes=sizes,
                bounce=bounce,
                budget=budget,
                keep_between=True,
            ),
            f'pipe.enable_model_cpu_offload(memory_budget="{gib:.1f}GiB", keep_on_device_between_generations=True)',
            True,
        )
    return out


def _simulate(policy, trace: Sequence[str], sizes: Mapping[str, int], zero_copy: bool) -> dict:
    """Moves of `policy` on `trace` from an all-on-host pipeline: bytes per call and peak bytes on the device."""
    from ._policy import END, ONLOAD

    resident: set = set()
    calls: List[dict] = []
    current = {"h2d": 0, "d2h": 0, "onloads": 0, "offloads": 0}
    setup = {"h2d": 0, "d2h": 0, "onloads": 0, "offloads": 0}
    peak = 0

    def run(moves, counter):
        nonlocal peak
        for direction, name in moves:
            if direction == ONLOAD:
                resident.add(name)
                counter["h2d"] += sizes[name]
                counter["onloads"] += 1
            else:
                resident.discard(name)
                counter["offloads"] += 1
                if not zero_copy:
                    counter["d2h"] += sizes[name]
            peak = max(peak, sum(sizes[n] for n in resident))

    run(policy.on_enable(resident), setup)
    for event in trace:
        if event == END:
            run(policy.on_enable(resident), current)
            calls.append(current)
            current = {"h2d": 0, "d2h": 0, "onloads": 0, "offloads": 0}
        else:
            run(policy.on_use(event, resident), current)
    return {"setup": setup, "calls": calls, "peak": peak}


def plan(
    model: str,
    *,
    vram: str = "24GiB",
    steps: int = 28,
    generations: int = 10,
    preview: bool = False,
    bandwidth: str = DEFAULT_BANDWIDTH_TEXT,
    reserve: str = DEFAULT_RESERVE_TEXT,
    dtypes: Optional[Mapping[str, str]] = None,
    components: Sequence[str] = (),
) -> dict:
    """Predicted transfer bytes and seconds per generation of each offload strategy for `model` on a card.

    Args:
        model (`str`): A shipped model name or a spec path (see `load_spec`).
        vram (`str`, defaults to `"24GiB"`): The card's memory.
        steps (`int`, defaults to 28): Denoising steps per generation.
        generations (`int`, defaults to 10): Pipeline calls in a row.
        preview (`bool`, defaults to `False`): A `callback_on_step_end` decodes a preview with the VAE every step.
        bandwidth (`str`, defaults to `"12GB/s"`): Host-device bandwidth, both directions.
        reserve (`str`, defaults to `"3GiB"`): Memory left for activations when checking what fits.
        dtypes (`Mapping[str, str]`, *optional*): Dtype overrides per component (`"denoiser"` for the denoisers).
        components (`Sequence[str]`, *optional*): `NAME=CONFIG.json` / `NAME=CLASS:CONFIG.json` overrides.

    Returns:
        `dict`: JSON-ready: the model, components (class, dtype, parameters, bytes), the recorded call trace, and
        per strategy the bytes and seconds of the first and of each later generation, the average per generation,
        the peak bytes on the device and whether it fits; plus the recommended call.

    Raises:
        `PlanError`: unknown model, bad size/bandwidth/dtype, unreadable config, missing model class.
    """
    from ._policy import END

    if not isinstance(steps, int) or steps < 1:
        raise PlanError(f"--steps must be a positive integer, got {steps!r}.")
    if not isinstance(generations, int) or generations < 1:
        raise PlanError(f"--generations must be a positive integer, got {generations!r}.")
    vram_bytes = parse_size(vram, what="VRAM size")
    reserve_bytes = parse_size(reserve, what="reserve") if str(reserve).strip() not in ("0", "0B") else 0
    rate = parse_bandwidth(bandwidth)
    spec = load_spec(model)
    for override in components:
        spec = override_component(spec, override)
    described = component_sizes(spec, dtypes)
    sizes = {name: entry["nbytes"] for name, entry in described.items()}

    pipe, recorded = record_call_trace(spec["tiny"], steps=steps, preview=preview)
    layout = pipeline_layout(pipe)
    missing = [n for n in layout["order"] if n not in sizes]
    if missing:
        raise PlanError(f"The model spec has no size for components {missing} of {type(pipe).__name__}.")
    layout["order"] = [n for n in layout["order"] if n in sizes]
    call = list(recorded.component_trace(0))
    trace = (call + [END]) * generations
    budget = max(vram_bytes - reserve_bytes, 0)

    strategies = {}
    for name, entry in _policies(layout, sizes, spec.get("denoisers", []), budget).items():
        if isinstance(entry, Exception):
            strategies[name] = {
                "available": False,
                "error": f"The residency manager is not in this build ({entry}).",
            }
            continue
        policy, call_string, zero_copy = entry
        sim = _simulate(policy, trace, sizes, zero_copy)
        per_call = [c["h2d"] + c["d2h"] for c in sim["calls"]]
        first = sim["setup"]["h2d"] + sim["setup"]["d2h"] + per_call[0]
        later = per_call[-1] if generations > 1 else None
        total = sim["setup"]["h2d"] + sim["setup"]["d2h"] + sum(per_call)
        strategies[name] = {
            "available": True,
            "call": call_string,
            "setup_bytes": sim["setup"]["h2d"] + sim["setup"]["d2h"],
            "first_generation_bytes": first,
            "later_generation_bytes": later,
            "total_bytes": total,
            "bytes_per_generation": total / generations,
            "h2d_bytes_per_generation": (sim["setup"]["h2d"] + sum(c["h2d"] for c in sim["calls"])) / generations,
            "d2h_bytes_per_generation": (sim["setup"]["d2h"] + sum(c["d2h"] for c in sim["calls"])) / generations,
            "onloads_per_generation": sum(c["onloads"] for c in sim["calls"]) / generations,
            "seconds_per_generation": total / generations / rate,
            "first_generation_seconds": first / rate,
            "peak_bytes": sim["peak"],
            "fits": sim["peak"] + reserve_bytes <= vram_bytes,
            "fits_without_reserve": sim["peak"] <= vram_bytes,
        }
    usable = [(n, s) for n, s in strategies.items() if s.get("available") and s["fits"]]
    tight = [(n, s) for n, s in strategies.items() if s.get("available") and s["fits_without_reserve"]]
    pool = usable or tight
    recommended = None
    if pool:
        best = min(pool, key=lambda item: (item[1]["total_bytes"], STRATEGIES.index(item[0])))
        recommended = {"strategy": best[0], "call": best[1]["call"], "with_reserve": bool(usable)}
    return {
        "model": spec["name"],
        "title": spec.get("title"),
        "pipeline": type(pipe).__name__,
        "vram_bytes": vram_bytes,
        "reserve_bytes": reserve_bytes,
        "budget_bytes": budget,
        "bandwidth_bytes_per_s": rate,
        "steps": steps,
        "generations": generations,
        "preview": preview,
        "components": described,
        "chain": layout["chain"],
        "call_trace": call,
        "trace_source": f"tiny {type(pipe).__name__} ({spec['tiny']}), {steps} steps"
        + (", preview every step" if preview else ""),
        "strategies": strategies,
        "recommended": recommended,
    }
