"""`diffusers-offload`: plan transfers before downloading weights, run the demo, check the environment.

    diffusers-offload plan --model flux-dev --vram 24GiB --steps 28 --generations 10 [--preview] [--bandwidth 12GB/s]
    diffusers-offload demo [--png timeline.png]
    diffusers-offload doctor

Every command takes `--json`. Exit codes: 0 success, 2 a usage error (unknown model, bad size or bandwidth,
unreadable config, missing model class), 1 anything else.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import sys
from typing import Dict, List, Optional, Sequence

from ._models import (
    DEFAULT_BANDWIDTH_TEXT,
    DEFAULT_RESERVE_TEXT,
    PlanError,
    component_sizes,
    load_spec,
    parse_bandwidth,
    plan,
    shipped_models,
    tiny_module,
)

USAGE_ERROR = 2

STRATEGY_TITLES = {
    "stock": "stock model offload",
    "exclude_denoiser": "exclude_from_offload=<denoiser>",
    "keep_during_generation": "keep_on_device_during_generation=True",
    "residency": "residency manager (budget, kept between calls)",
}


# ----------------------------------------------------------------------------------------------------------------
# Output helpers: the only place that prints.
# ----------------------------------------------------------------------------------------------------------------


def _console():
    from rich.console import Console

    width = None if sys.stdout.isatty() else 150
    return Console(width=width, highlight=False)


def _emit_json(data) -> None:
    sys.stdout.write(json.dumps(data, indent=1, default=str) + "\n")


def _gb(nbytes: Optional[float]) -> str:
    if nbytes is None:
        return "-"
    return f"{nbytes / 1e9:.2f} GB"


def _seconds(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _error(message: str, as_json: bool, code: int = USAGE_ERROR) -> int:
    sys.stderr.write(f"diffusers-offload: error: {message}\n")
    if as_json:
        _emit_json({"error": message, "exit_code": code})
    return code


# ----------------------------------------------------------------------------------------------------------------
# plan
# ----------------------------------------------------------------------------------------------------------------


def _parse_dtypes(values: Sequence[str]) -> Dict[str, str]:
    dtypes = {}
    for value in values or ():
        if "=" not in value:
            raise PlanError(f"--dtype takes COMPONENT=DTYPE (e.g. transformer=fp8 or denoiser=fp8), got {value!r}.")
        name, dtype = value.split("=", 1)
        dtypes[name.strip()] = dtype.strip()
    return dtypes


def _strategy_label(name: str, entry: dict) -> str:
    call = entry.get("call") or ""
    options = call[call.find("(") + 1 : call.rfind(")")] if "(" in call else ""
    if name == "stock":
        return "stock (no options)"
    if name == "residency":
        return f"residency manager: {options}" if options else "residency manager"
    return options or STRATEGY_TITLES.get(name, name)


def _print_plan(result: dict) -> None:
    from rich.markup import escape
    from rich.table import Table

    console = _console()
    console.print(
        f"[bold]{escape(result['title'] or result['model'])}[/] ({result['pipeline']}) on a {result['vram_bytes'] / (1 << 30):.1f} GiB "
        f"card, {result['reserve_bytes'] / (1 << 30):.1f} GiB kept free for activations; {result['steps']} steps x "
        f"{result['generations']} generations{', preview decoded every step' if result['preview'] else ''}; "
        f"bandwidth {result['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s both ways."
    )
    sizes = Table(title="Components (built on the meta device from the shipped configs; no weights read)")
    for column in ("component", "class", "dtype", "parameters", "bytes"):
        sizes.add_column(column, justify="right" if column in ("parameters", "bytes") else "left")
    for name, entry in result["components"].items():
        sizes.add_row(name, entry["class"], entry["dtype"], f"{entry['parameters']:,}", _gb(entry["nbytes"]))
    console.print(sizes)
    table = Table(
        title="Predicted transfers per generation",
        caption=f"Call trace recorded from the {result['trace_source']}; moves replayed with the real sizes. "
        "Seconds = bytes that cross the bus / bandwidth.",
        caption_justify="left",
    )
    for column in (
        "strategy",
        "first generation",
        "each later one",
        "average",
        "seconds / generation",
        "peak on device",
    ):
        table.add_column(column, justify="left" if column == "strategy" else "right")
    table.add_column("fits")
    for name, entry in result["strategies"].items():
        title = escape(_strategy_label(name, entry))
        if not entry.get("available"):
            table.add_row(title, "[red]NOT AVAILABLE[/]", "", "", "", "", escape(entry.get("error", "")))
            continue
        fits = (
            "yes"
            if entry["fits"]
            else ("[yellow]without reserve[/]" if entry["fits_without_reserve"] else "[red]no[/]")
        )
        table.add_row(
            title,
            _gb(entry["first_generation_bytes"]),
            _gb(entry["later_generation_bytes"]),
            _gb(entry["bytes_per_generation"]),
            _seconds(entry["seconds_per_generation"]),
            _gb(entry["peak_bytes"]),
            fits,
        )
    console.print(table)
    recommended = result["recommended"]
    if recommended is None:
        console.print(
            "[red]No strategy keeps the weights in this card's memory[/]: the largest component alone does not fit. "
            "Use a smaller dtype (--dtype denoiser=fp8), `pipe.enable_group_offload(...)` or "
            "`pipe.enable_sequential_cpu_offload()`."
        )
    else:
        tight = "" if recommended["with_reserve"] else " (only without the activation reserve: expect it to be tight)"
        console.print(f"Recommended{tight}: [bold]{escape(recommended['call'])}[/]")


def cmd_plan(args) -> int:
    if args.list:
        models = {}
        for name in shipped_models():
            spec = load_spec(name)
            models[name] = {"title": spec.get("title"), "pipeline": spec.get("pipeline"), "repo": spec.get("repo")}
        if args.json:
            _emit_json({"models": models})
        else:
            for name, entry in models.items():
                sys.stdout.write(f"{name:20s} {entry['title']} ({entry['pipeline']}, {entry['repo']})\n")
        return 0
    if not args.model:
        raise PlanError("plan needs --model (one of: " + ", ".join(shipped_models()) + ", or a spec path).")
    result = plan(
        args.model,
        vram=args.vram,
        steps=args.steps,
        generations=args.generations,
        preview=args.preview,
        bandwidth=args.bandwidth,
        reserve=args.reserve,
        dtypes=_parse_dtypes(args.dtype),
        components=args.component or (),
    )
    if args.json:
        _emit_json(result)
    else:
        _print_plan(result)
    return 0


# ----------------------------------------------------------------------------------------------------------------
# demo
# ----------------------------------------------------------------------------------------------------------------

DEMO_CONFIGS = (
    ("stock", "stock model offload", {}),
    ("exclude_transformer", 'exclude_from_offload=["transformer"]', {"exclude_from_offload": ["transformer"]}),
    ("keep_during_generation", "keep_on_device_during_generation=True", {"keep_on_device_during_generation": True}),
)
DEMO_GENERATIONS = 3
#: FLUX.1-dev's default number of steps, so that the real-model figures are per real generation.
DEMO_STEPS = 28


def run_demo(
    *,
    generations: int = DEMO_GENERATIONS,
    steps: int = DEMO_STEPS,
    bandwidth: str = DEFAULT_BANDWIDTH_TEXT,
    png: Optional[str] = None,
):
    """Run the tiny Flux pipeline `generations` times with a preview callback under each demo configuration.

    Returns:
        `(result dict, traces)`: per configuration the ledger's counts and bytes per generation and what they mean
        for a real Flux-dev with an fp8 transformer on a 24 GB card; `traces` maps configuration to its `Trace`.
    """
    import torch

    from . import _install
    from ._state import transfer_ledger
    from ._trace import trace

    tiny = tiny_module()
    ok, reason = tiny.available("flux")
    if not ok:
        raise PlanError(f"The demo needs the tiny Flux pipeline: {reason}.")
    rate = parse_bandwidth(bandwidth)
    real = component_sizes(load_spec("flux-dev"), {"transformer": "float8_e4m3fn"})
    real_sizes = {name: entry["nbytes"] for name, entry in real.items()}
    card = 24 * 10**9
    installed_before = _install.is_installed()
    _install.install()
    results = {}
    traces = {}
    try:
        for key, title, options in DEMO_CONFIGS:
            pipe = tiny.build("flux")
            pipe.enable_model_cpu_offload(device="cpu", **options)
            ledger = transfer_ledger(pipe)
            with torch.no_grad(), trace(pipe) as recorded:
                for seed in range(generations):
                    kwargs = tiny.call_kwargs("flux", seed=seed, preview=True)
                    kwargs["num_inference_steps"] = steps
                    pipe(**kwargs)
            traces[key] = recorded
            records = list(ledger.records)
            in_calls = [r for r in records if r.call_index is not None]
            setup = [r for r in records if r.call_index is None]
            resident, peak = set(), 0
            for record in records:
                (resident.add if record.direction == "onload" else resident.discard)(record.component)
                peak = max(peak, sum(real_sizes[n] for n in resident))
            real_calls = sum(real_sizes[r.component] for r in in_calls if r.kind == "copy")
            real_setup = sum(real_sizes[r.component] for r in setup if r.kind == "copy")
            results[key] = {
                "options": title,
                "generations": generations,
                "onloads_per_generation": sum(r.direction == "onload" for r in in_calls) / generations,
                "offloads_per_generation": sum(r.direction == "offload" for r in in_calls) / generations,
                "tiny_bytes_per_generation": sum(r.copied_bytes for r in in_calls) / generations,
                "tiny_bytes_at_enable": sum(r.copied_bytes for r in setup),
                "flux_dev_fp8_bytes_per_generation": real_calls / generations,
                "flux_dev_fp8_bytes_at_enable": real_setup,
                "flux_dev_fp8_seconds_per_generation": real_calls / generations / rate,
                "flux_dev_fp8_peak_bytes": peak,
                "fits_24gb": peak <= card,
                "steps_per_generation": recorded.calls[0].steps if recorded.calls else 0,
            }
    finally:
        if not installed_before:
            _install.uninstall()
    if png:
        from ._report import plot_traces

        plot_traces([(f"tiny Flux, {title}", traces[key]) for key, title, _ in DEMO_CONFIGS], png)
    result = {
        "pipeline": "tiny FluxPipeline (diffusers_offload_ext.tiny), on the CPU",
        "generations": generations,
        "steps": steps,
        "preview": "callback_on_step_end decodes the latents with the VAE every step",
        "bandwidth_bytes_per_s": rate,
        "real_model": "FLUX.1-dev, transformer in float8_e4m3fn, text encoders and VAE in bfloat16, 24 GB card",
        "real_sizes": real_sizes,
        "configurations": results,
        "png": png,
    }
    return result, traces


def _print_demo(result: dict) -> None:
    from rich.table import Table

    console = _console()
    generations = result["generations"]
    table = Table(
        title=f"Tiny Flux, {generations} generations of {result['steps']} steps with a preview decoded every step "
        "(from the transfer ledger)",
        caption="Per generation = moves inside the pipeline calls / generations; 'at enable' = moves made once by "
        "enable_model_cpu_offload.",
        caption_justify="left",
    )
    for column in ("options", "onloads", "offloads", "bytes / generation", "bytes at enable"):
        table.add_column(column, justify="left" if column == "options" else "right")
    for entry in result["configurations"].values():
        table.add_row(
            entry["options"],
            f"{entry['onloads_per_generation']:g}",
            f"{entry['offloads_per_generation']:g}",
            f"{entry['tiny_bytes_per_generation'] / 1024:.0f} KiB",
            f"{entry['tiny_bytes_at_enable'] / 1024:.0f} KiB",
        )
    console.print(table)
    sizes = ", ".join(f"{n} {b / 1e9:.2f} GB" for n, b in result["real_sizes"].items())
    real = Table(
        title=f"What the same moves mean for {result['real_model']}",
        caption=f"Sizes from the shipped flux-dev config built on the meta device: {sizes}. "
        f"Bandwidth {result['bandwidth_bytes_per_s'] / 1e9:.0f} GB/s (pageable host memory over PCIe 4.0 x16), both "
        "directions.",
        caption_justify="left",
    )
    for column in ("options", "bytes / generation", "seconds / generation", "once at enable", "peak on device"):
        real.add_column(column, justify="left" if column == "options" else "right")
    real.add_column("fits 24 GB")
    for entry in result["configurations"].values():
        real.add_row(
            entry["options"],
            _gb(entry["flux_dev_fp8_bytes_per_generation"]),
            _seconds(entry["flux_dev_fp8_seconds_per_generation"]),
            _gb(entry["flux_dev_fp8_bytes_at_enable"]),
            _gb(entry["flux_dev_fp8_peak_bytes"]),
            "yes" if entry["fits_24gb"] else "[red]no[/]",
        )
    console.print(real)
    if result.get("png"):
        console.print(f"Timeline written to {result['png']}")


def cmd_demo(args) -> int:
    if args.generations < 1:
        raise PlanError(f"--generations must be a positive integer, got {args.generations}.")
    if args.steps < 1:
        raise PlanError(f"--steps must be a positive integer, got {args.steps}.")
    result, _ = run_demo(generations=args.generations, steps=args.steps, bandwidth=args.bandwidth, png=args.png)
    if args.json:
        _emit_json(result)
    else:
        _print_demo(result)
    return 0


# ----------------------------------------------------------------------------------------------------------------
# doctor
# ----------------------------------------------------------------------------------------------------------------


def _version(module: str) -> Optional[str]:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return None


def _host_memory() -> Optional[dict]:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()}
        return {"total_bytes": info.get("MemTotal"), "available_bytes": info.get("MemAvailable")}
    except (OSError, ValueError, IndexError):
        return None


def doctor() -> dict:
    """Versions, devices and memory, whether the plugin is installed and whether diffusers carries the patch."""
    import torch

    from . import __version__, _install
    from ._mixin import STOCK

    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "diffusers": _version("diffusers"),
        "accelerate": _version("accelerate"),
        "transformers": _version("transformers"),
        "diffusers-offload-ext": __version__,
        "rich": _version("rich"),
        "matplotlib": _version("matplotlib"),
    }
    devices: List[dict] = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            properties = torch.cuda.get_device_properties(index)
            entry = {"device": f"cuda:{index}", "name": properties.name, "total_bytes": properties.total_memory}
            try:
                free, _ = torch.cuda.mem_get_info(index)
                entry["free_bytes"] = free
            except Exception:
                entry["free_bytes"] = None
            devices.append(entry)
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        devices.append({"device": "mps", "name": "Apple MPS", "total_bytes": None, "free_bytes": None})
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        for index in range(torch.xpu.device_count()):
            devices.append({"device": f"xpu:{index}", "name": torch.xpu.get_device_name(index)})
    stock_parameters = inspect.signature(STOCK["enable_model_cpu_offload"]).parameters
    try:
        tiny = tiny_module()
        tiny_status = {name: tiny.available(name)[0] for name in tiny.PIPELINES}
    except Exception as error:
        tiny_status = {"error": str(error)}
    try:
        from . import _residency  # noqa: F401

        residency = True
    except ImportError:
        residency = False
    return {
        "versions": versions,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "host_memory": _host_memory(),
        "accelerators": devices,
        "plugin_installed": _install.is_installed(),
        "upstream_patch": {
            "exclude_from_offload": "exclude_from_offload" in stock_parameters,
            "keep_on_device_during_generation": "keep_on_device_during_generation" in stock_parameters,
        },
        "residency_manager": residency,
        "tiny_pipelines": tiny_status,
    }


def _print_doctor(report: dict) -> None:
    from rich.table import Table

    console = _console()
    table = Table(title="diffusers-offload doctor", show_header=False)
    table.add_column("what")
    table.add_column("value")
    for name, value in report["versions"].items():
        table.add_row(name, value or "[red]not installed[/]")
    table.add_row("platform", report["platform"])
    memory = report["host_memory"] or {}
    table.add_row(
        "host",
        f"{report['cpu_count']} CPUs, {_gb(memory.get('total_bytes'))} memory, {_gb(memory.get('available_bytes'))} "
        "available",
    )
    if report["accelerators"]:
        for device in report["accelerators"]:
            table.add_row(
                device["device"],
                f"{device.get('name')}: {_gb(device.get('total_bytes'))} total, {_gb(device.get('free_bytes'))} free",
            )
    else:
        table.add_row(
            "accelerators", "none (offload runs, but only `device='cpu'` works; traces replay stock's moves)"
        )
    table.add_row(
        "plugin installed", "yes" if report["plugin_installed"] else "no (call diffusers_offload_ext.install())"
    )
    patch = report["upstream_patch"]
    carried = patch["exclude_from_offload"] and patch["keep_on_device_during_generation"]
    table.add_row(
        "diffusers carries the patch",
        "yes" if carried else f"no (stock enable_model_cpu_offload: {json.dumps(patch)})",
    )
    table.add_row("residency manager", "present" if report["residency_manager"] else "[red]absent[/]")
    tiny = report["tiny_pipelines"]
    if "error" in tiny:
        table.add_row("tiny pipelines", f"[red]{tiny['error']}[/]")
    else:
        table.add_row("tiny pipelines", ", ".join(f"{n}{'' if ok else ' (unavailable)'}" for n, ok in tiny.items()))
    console.print(table)


def cmd_doctor(args) -> int:
    report = doctor()
    if args.json:
        _emit_json(report)
    else:
        _print_doctor(report)
    return 0


# ----------------------------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diffusers-offload",
        description="Plan, demonstrate and check model CPU offload for diffusers pipelines.",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    # `--json` is accepted after the command too; SUPPRESS keeps a value given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print one JSON object")
    commands = parser.add_subparsers(dest="command", metavar="{plan,demo,doctor}")
    commands.required = True

    p = commands.add_parser(
        "plan", parents=[common], help="predict transfer bytes and seconds per generation for each offload strategy"
    )
    p.add_argument("--model", help="a shipped model (see --list) or the path of a model spec JSON")
    p.add_argument("--list", action="store_true", help="list the shipped models")
    p.add_argument("--vram", default="24GiB", help="the card's memory, e.g. 24GiB, 80GB (default: 24GiB)")
    p.add_argument("--steps", type=int, default=28, help="denoising steps per generation (default: 28)")
    p.add_argument("--generations", type=int, default=10, help="pipeline calls in a row (default: 10)")
    p.add_argument("--preview", action="store_true", help="a callback decodes a preview with the VAE every step")
    p.add_argument(
        "--bandwidth",
        default=DEFAULT_BANDWIDTH_TEXT,
        help=f"host-device bandwidth, e.g. 12GB/s, 25GiB/s (default: {DEFAULT_BANDWIDTH_TEXT})",
    )
    p.add_argument(
        "--reserve",
        default=DEFAULT_RESERVE_TEXT,
        help=f"memory left for activations when checking what fits (default: {DEFAULT_RESERVE_TEXT})",
    )
    p.add_argument(
        "--dtype",
        action="append",
        metavar="COMPONENT=DTYPE",
        help="weights dtype of a component (or 'denoiser'), e.g. transformer=fp8; repeatable",
    )
    p.add_argument(
        "--component",
        action="append",
        metavar="NAME=[CLASS:]CONFIG.json",
        help="replace a component by any diffusers/transformers model class and its config.json; repeatable",
    )
    p.set_defaults(handler=cmd_plan)

    d = commands.add_parser("demo", parents=[common], help="run the tiny Flux demo (what `make demo` runs)")
    d.add_argument("--generations", type=int, default=DEMO_GENERATIONS, help="generations per configuration")
    d.add_argument("--steps", type=int, default=DEMO_STEPS, help=f"denoising steps (default: {DEMO_STEPS})")
    d.add_argument("--bandwidth", default=DEFAULT_BANDWIDTH_TEXT, help="bandwidth for the real-model seconds")
    d.add_argument("--png", help="also write the timeline of the three configurations to this PNG")
    d.set_defaults(handler=cmd_demo)

    c = commands.add_parser("doctor", parents=[common], help="versions, devices, plugin and patch status")
    c.set_defaults(handler=cmd_doctor)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of `diffusers-offload`; returns the exit code."""
    import torch

    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    # The tiny pipelines are a few hundred kilobytes: more threads only add contention.
    torch.set_num_threads(1)
    # Importing the pipeline classes makes transformers warn about image processors the tiny pipelines never use.
    verbosity = _transformers_verbosity(40)
    try:
        return args.handler(args)
    except PlanError as error:
        return _error(str(error), args.json)
    except KeyboardInterrupt:
        return _error("interrupted", args.json, code=130)
    finally:
        torch.set_num_threads(threads)
        _transformers_verbosity(verbosity)


def _transformers_verbosity(level: Optional[int]) -> Optional[int]:
    """Set transformers' log level (errors only = 40); return the previous one (`None` without transformers)."""
    try:
        from transformers.utils import logging as transformers_logging
    except ImportError:
        return None
    previous = transformers_logging.get_verbosity()
    if level is not None:
        transformers_logging.set_verbosity(level)
    return previous


if __name__ == "__main__":
    sys.exit(main())
