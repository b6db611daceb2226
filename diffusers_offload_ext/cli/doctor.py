"""`diffusers-offload doctor`: what matters for offload in this Python environment: installed versions,
accelerators, whether the installed diffusers already has the upstream patch's arguments, and what
`diffusers_offload_ext.install()` would change (the methods it replaces, the pipeline classes it cannot reach)."""

from __future__ import annotations

import ast
import importlib.util
import os
import platform
from importlib.metadata import PackageNotFoundError, version
from typing import Dict, List, Optional

from ..models.bounds import format_rate
from . import output

HELP = "versions, accelerators, whether diffusers has the patch, and what install() would change"
PACKAGES = ("torch", "diffusers", "accelerate", "transformers", "rich", "matplotlib")
PATCH_ARGUMENTS = ("exclude_from_offload", "keep_on_device_during_generation")
OVERRIDE = "enable_model_cpu_offload"


def add_parser(commands, common) -> None:
    c = commands.add_parser("doctor", parents=[common], help=HELP, description=HELP + ".")
    c.add_argument("--no-bandwidth", action="store_true", help="skip measuring copy bandwidth on a CUDA device")
    c.set_defaults(handler=run)


def run(args) -> int:
    with output.quiet_transformers():
        report = doctor(measure=not args.no_bandwidth)
    if args.json:
        output.emit_json(report)
    else:
        output.write(render(report, output.width()))
    return 0


def doctor(measure: bool = True) -> dict:
    """The environment report (JSON-ready); with `measure`, copy bandwidths on the first CUDA device."""
    accelerators = _accelerators()
    return {
        "versions": {
            "python": platform.python_version(),
            **{p: _version(p) for p in PACKAGES},
            "diffusers-offload-ext": _this_package(),
        },
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "host_memory": _host_memory(),
        "accelerators": accelerators,
        "bandwidth": _bandwidth(accelerators, measure),
        "upstream_patch": _upstream_patch(),
        "install_would": _install_changes(),
        "demo": _demo_readiness(),
    }


def _version(package: str) -> Optional[str]:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _this_package() -> str:
    """The version of the `diffusers_offload_ext` this process imports, and where it comes from."""
    import diffusers_offload_ext

    return f"{diffusers_offload_ext.__version__} ({os.path.dirname(os.path.abspath(diffusers_offload_ext.__file__))})"


def _host_memory() -> Optional[dict]:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()}
    except (OSError, ValueError, IndexError):
        return None
    return {"total_bytes": info.get("MemTotal"), "available_bytes": info.get("MemAvailable")}


def _accelerators() -> List[dict]:
    import torch

    devices = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            properties = torch.cuda.get_device_properties(index)
            free = None
            try:
                free, _ = torch.cuda.mem_get_info(index)
            except RuntimeError:
                pass
            devices.append({"device": f"cuda:{index}", "name": properties.name,
                            "total_bytes": properties.total_memory, "free_bytes": free})  # fmt: skip
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        devices.append({"device": "mps", "name": "Apple MPS", "total_bytes": None, "free_bytes": None})
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        for index in range(torch.xpu.device_count()):
            devices.append({"device": f"xpu:{index}", "name": torch.xpu.get_device_name(index),
                            "total_bytes": None, "free_bytes": None})  # fmt: skip
    return devices


def _bandwidth(accelerators: List[dict], measure: bool) -> dict:
    """Measured copy bandwidths (bytes per second) on the first CUDA device, or why there are none."""
    cuda = [d for d in accelerators if d["device"].startswith("cuda")]
    if not cuda:
        return {"measured": False, "reason": "no CUDA device: plan and demo price seconds at assumed bandwidths"}
    if not measure:
        return {"measured": False, "reason": "skipped (--no-bandwidth)"}
    import torch

    from ..pinning import bandwidth

    rates = bandwidth.measure(torch.device(cuda[0]["device"]))
    return {"measured": True, "device": cuda[0]["device"], "name": cuda[0]["name"], **rates}


def _upstream_patch() -> Dict[str, bool]:
    """Whether stock `DiffusionPipeline.enable_model_cpu_offload` (before any `install()`) takes each argument the
    upstream patch adds."""
    import inspect

    from ..marks import STOCK

    parameters = inspect.signature(STOCK[OVERRIDE]).parameters
    return {name: name in parameters for name in PATCH_ARGUMENTS}


def _install_changes() -> dict:
    from ..marks import REPLACED

    return {
        "replace_on_DiffusionPipeline": sorted(REPLACED),
        "wrap": "__call__ of every DiffusionPipeline subclass, imported already or later",
        "own_enable_model_cpu_offload": _overrides(),
    }


def _overrides() -> Dict[str, str]:
    """Each class that defines its own `enable_model_cpu_offload`: how `install()` gives it the options, or why not."""
    import diffusers

    from ..runtime.overrides import support

    found = {}
    for name in overriding_pipelines():
        try:  # a pipeline whose requirements are missing is a placeholder that raises on any use
            cls = getattr(diffusers, name, None)
            if cls is None:
                continue
            supported, reason = support(cls)
        except ImportError as error:
            found[name] = f"not importable here: {str(error).strip().splitlines()[0][:160]}"
            continue
        found[name] = ("adapted: " if supported else "rejects the options: ") + reason
    return found


def overriding_pipelines() -> List[str]:
    """Pipeline classes of the installed diffusers that define their own `enable_model_cpu_offload` (so
    `install()` adapts them, or they reject the options), found by reading diffusers' source."""
    spec = importlib.util.find_spec("diffusers")
    if spec is None or not spec.submodule_search_locations:
        return []
    root = os.path.join(list(spec.submodule_search_locations)[0], "pipelines")
    found = []
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith(".py") and name != "pipeline_utils.py":
                found += _classes_defining(path, OVERRIDE)
    return sorted(set(found))


def _classes_defining(path: str, method: str) -> List[str]:
    with open(path, encoding="utf-8") as f:
        source = f.read()
    if f"def {method}(" not in source:
        return []
    tree = ast.parse(source, filename=path)
    return [
        node.name
        for node in tree.body
        if isinstance(node, ast.ClassDef)
        and any(isinstance(item, ast.FunctionDef) and item.name == method for item in node.body)
    ]


def _demo_readiness() -> dict:
    if importlib.util.find_spec("transformers") is None:
        from .demo import INSTALL_DEMO

        return {"ready": False, "missing": "transformers", "install": INSTALL_DEMO}
    return {"ready": True, "missing": None, "install": None}


def render(report: dict, columns: int) -> List[str]:
    """The report as text lines that fit in `columns` (memory in GiB)."""
    rows = [[name, value or "not installed"] for name, value in report["versions"].items()]
    memory = report["host_memory"] or {}
    rows.append(["platform", report["platform"]])
    rows.append(["host", f"{report['cpu_count']} CPUs, {output.gib(memory.get('total_bytes'))} GiB memory, "
                         f"{output.gib(memory.get('available_bytes'))} GiB available"])  # fmt: skip
    for device in report["accelerators"]:
        rows.append([device["device"], f"{device['name']}: {output.gib(device['total_bytes'])} GiB total, "
                                       f"{output.gib(device['free_bytes'])} GiB free"])  # fmt: skip
    if not report["accelerators"]:
        rows.append(["accelerators", "none: offload can only target device='cpu' here"])
    rows += _bandwidth_rows(report["bandwidth"])
    patch = report["upstream_patch"]
    carried = all(patch.values())
    rows.append(["diffusers has the patch", "yes: enable_model_cpu_offload takes " + ", ".join(patch) if carried
                 else "no: its enable_model_cpu_offload lacks " + ", ".join(n for n, v in patch.items() if not v)
                 + " (diffusers_offload_ext.install() adds them)"])  # fmt: skip
    changes = report["install_would"]
    rows.append(["install() replaces", "DiffusionPipeline." + ", ".join(changes["replace_on_DiffusionPipeline"])])
    rows.append(["install() wraps", changes["wrap"]])
    for name, how in changes["own_enable_model_cpu_offload"].items():
        rows.append([name, how])
    demo = report["demo"]
    rows.append(["demo", "ready" if demo["ready"] else f"needs {demo['missing']}: {demo['install']}"])
    return _key_values(rows, columns)


def _bandwidth_rows(measured: dict) -> List[list]:
    if not measured["measured"]:
        return [["bandwidth", "not measured: " + measured["reason"]]]
    rate = {k: format_rate(v) for k, v in measured.items() if k.startswith(("h2d", "d2h"))}
    locked = "h2d_page_locked" in rate
    return [
        ["host-to-device", f"{rate['h2d_pageable']} pageable"
         + (f", {rate['h2d_page_locked']} page-locked" if locked else "") + f" (measured on {measured['name']})"],
        ["device-to-host", f"{rate['d2h_fresh']} into new host memory (module.to('cpu'))"
         + (f", {rate['d2h_page_locked']} page-locked" if locked else "")],
        ["plan with them", f"--h2d-bandwidth {rate['h2d_pageable'].replace(' ', '')} "
         f"--d2h-bandwidth {rate['d2h_fresh'].replace(' ', '')}"
         + (f" --pinned-bandwidth {rate['h2d_page_locked'].replace(' ', '')}" if locked else "")
         + " (stock's moves: pageable host memory; block residency's: page-locked)"],
    ]  # fmt: skip


def _key_values(rows, columns: int) -> List[str]:
    """`key  value` lines, values wrapped under themselves, or under the key when the terminal is narrow."""
    key = max(len(k) for k, _ in rows)
    lines = ["diffusers-offload doctor"]
    for name, value in rows:
        if key + 2 + 20 <= columns:
            lines += output.wrap(str(value), columns, " " * (key + 2), name.ljust(key) + "  ")
        else:
            lines += [name] + output.wrap(str(value), columns, "    ", "    ")
    return lines
