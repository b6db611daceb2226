"""Seconds per image of every offload configuration on a shipped model spec at real size with random weights on a
CUDA GPU, against no offload measured in the same run: the benchmark behind `docs/benchmarks-gpu.md`.

The pipeline is built from the spec's configs (`benchmarks/realscale_build.py`; nothing is downloaded): the
components at real size with random weights, made on the GPU one at a time and kept on the host; tokenizers and
scheduler are the tiny pipeline's stand-ins, prompts go through the real-size text encoders. Every configuration
runs on a fresh pipeline object over the same component modules, reset in between (hooks removed, weights back on
the host, cache emptied, peak memory statistics reset). One untimed call without offload warms the GPU up first.

Per configuration: `--calls` timed calls; the first is reported apart, the others as their median and min-max seconds
per image, against no offload's median in the same run (`ratio`) and against the row's floor: no offload's median
plus the bytes the row moves host-to-device per steady call at `--floor-rate` (the page-locked rate measured on an
H200, 54 GB/s; `floor_ratio`); peak
allocated memory, beside the row's `memory_budget` where it has one (the `stream-*` rows: budgets below FLUX.1-dev's
23.8 GB transformer, which then streams its blocks); bytes that crossed the bus per steady call (this package's
configurations: the transfer ledger; the others: `doe.trace` over one more, untimed call); page-locked host bytes;
Nothing is priced from an assumed bandwidth, but the floor (a bound, at a stated rate). A configuration that runs out
of memory is reported as such. The peers users would pick instead run last: diffusers' group offloading and
diffusers-mm's `managed()` (`auto`, `block_pin`, when `diffusers_mm` is importable) leave hooks that cannot be
removed, so a row after one of them is not run: run each in its own process (`--only no-offload,mm-auto`).

    python benchmarks/realscale.py --model flux-dev --write docs/benchmarks-gpu.md
    python benchmarks/realscale.py --model wan2.1-t2v-14b --frames 17 --json
    python benchmarks/realscale.py --scale tiny --model flux-dev    # the same code on the CPU, tiny weights

Without CUDA (and without `--scale tiny`) it says so and exits 0. Tiny-scale CPU times are not benchmark figures.
Exit status: 0, 1 when a configuration failed with an error other than running out of memory, 2 for bad options.
"""

import argparse
import contextlib
import gc
import json
import os
import sys
import time
import traceback
from typing import NamedTuple

import torch

import diffusers_offload_ext as doe
from diffusers_offload_ext.models.bounds import parse_rate
from diffusers_offload_ext.models.errors import PlanError
from diffusers_offload_ext.models.specs import load_spec, shipped_models
from diffusers_offload_ext.testing import tiny
from diffusers_offload_ext.units import SizeError, format_size, parse_size

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import realscale_build as build  # noqa: E402  (next to this file; importable when loaded by path)

TINY_NOTE = "Tiny pipeline on the CPU: these times only exercise the code path; they are not benchmark figures."
MEASURED_NOTE = "Every figure is measured in this run; none is priced from an assumed bandwidth."
DENOISERS = "<denoisers>"  # replaced by the spec's denoiser names
BUDGET = "<budget>"  # replaced by --budget
SEED = 0  # every call makes the same image
LEGEND = (
    "x no offload: the median steady call over no offload's median steady call, in this run. Floor: no offload's "
    "median plus the bytes the row moves host-to-device per steady call at the floor rate (page-locked, measured on "
    "an H200); x floor: the median over it. Peak "
    "allocated: the most the CUDA allocator held during the row's calls (weights, ring buffers and activations), "
    "beside the row's memory budget (weights only; the difference is what the reserve is for). Moved: bytes "
    "that crossed the bus (an eviction that only drops the device copy moves none). Moved in the first call, "
    "setup included, and page-locked host bytes: this package's configurations only (the transfer ledger and "
    "`doe.offload_status`); `-`: not known for the others."
)


class Config(NamedTuple):
    key: str
    kind: str  # "none", "stock", "ours", "group", "sequential"
    options: dict


CONFIGS = (
    Config("no-offload", "none", {}),
    Config("stock", "stock", {}),
    Config("default", "ours", {}),
    Config("exclude", "ours", {"exclude_from_offload": DENOISERS}),
    Config("keep", "ours", {"keep_on_device_during_generation": True}),
    Config("residency-fits", "ours", {"keep_on_device_between_generations": True}),
    Config("residency-budget", "ours", {"memory_budget": BUDGET, "keep_on_device_between_generations": True}),
    Config("zero-copy", "ours", {"zero_copy_eviction": True}),
    Config("zero-copy-exclude", "ours", {"exclude_from_offload": DENOISERS, "zero_copy_eviction": True}),
    Config("zero-copy-keep", "ours", {"keep_on_device_during_generation": True, "zero_copy_eviction": True}),
    Config("pinned-zero-copy", "ours", {"zero_copy_eviction": True, "pin_memory": True}),
    Config("pinned-keep", "ours", {"keep_on_device_during_generation": True, "pin_memory": True}),
    Config(
        "pinned-residency-budget-prefetch",
        "ours",
        {"memory_budget": BUDGET, "keep_on_device_between_generations": True, "pin_memory": True, "prefetch": True},
    ),
    # Budgets below FLUX.1-dev's 23.8 GB transformer: it streams its blocks (issue 11); compare with the two below.
    *(
        Config(
            f"stream-{budget}-prefetch",
            "ours",
            {
                "memory_budget": budget,
                "keep_on_device_between_generations": True,
                "pin_memory": True,
                "prefetch": True,
            },
        )
        for budget in ("16GiB", "8GiB")
    ),
    Config("sequential", "sequential", {}),
    Config("group", "group", {"offload_type": "block_level", "num_blocks_per_group": 1, "use_stream": True}),
    Config("mm-auto", "mm", {"strategy": "auto"}),
    Config("mm-block-pin", "mm", {"strategy": "block_pin"}),
)
#: Configurations whose hooks cannot be removed: nothing runs after them in the same process.
FOR_GOOD = ("group", "mm")
#: `--floor-rate`'s default: the page-locked host-to-device rate measured on an H200 (models/data/profiles/h200.json).
FLOOR_RATE = "54GB/s"


def resolve(options: dict, spec: dict, args) -> dict:
    """`options` with the placeholders replaced by this run's denoisers and budget."""
    values = {DENOISERS: list(spec["denoisers"]), BUDGET: args.budget}
    return {k: values.get(v, v) if isinstance(v, str) else v for k, v in options.items()}


def budget_of(options: dict):
    """Bytes of the row's `memory_budget` (`None` without one): its peak allocated memory is read against it."""
    return parse_size(options["memory_budget"]) if "memory_budget" in options else None


def label(config: Config, options: dict) -> str:
    """The call a configuration makes, as a user would write it."""
    arguments = ", ".join(f"{k}={v!r}" for k, v in options.items())
    return {
        "none": "pipe.to(device) (no offload)",
        "stock": "enable_model_cpu_offload() (stock diffusers)",
        "ours": f"enable_model_cpu_offload({arguments})",
        "sequential": "enable_sequential_cpu_offload() (stock diffusers)",
        "group": f"enable_group_offload(device, {arguments}) (diffusers)",
        "mm": f"diffusers_mm.managed(pipe, {arguments}) (diffusers-mm)",
    }[config.kind]


def skip_reason(config: Config, options: dict, device: torch.device, args):
    """Why `config` does not run here, or `None`."""
    from diffusers import DiffusionPipeline, __version__

    if config.kind == "sequential" and not args.sequential:
        return "slow at real scale: pass --sequential to run it"
    if config.kind == "sequential" and device.type != "cuda":
        return "CUDA only: accelerate's sequential offload fails with the CPU as execution device"
    if config.kind == "group" and not hasattr(DiffusionPipeline, "enable_group_offload"):
        return f"diffusers {__version__} has no DiffusionPipeline.enable_group_offload"
    if config.kind == "group" and device.type != "cuda":
        return "group offloading with use_stream=True needs CUDA streams: skipped on the CPU"
    if options.get("pin_memory") and device.type != "cuda":
        return "pin_memory=True page-locks host memory for CUDA copies: skipped on the CPU"
    if config.kind == "mm":
        import importlib.util

        if importlib.util.find_spec("diffusers_mm") is None:
            return "diffusers-mm is not installed: carry its wheel (pip download --no-deps diffusers-mm==0.4.0)"
        if device.type != "cuda":
            return "diffusers-mm manages a CUDA device: skipped on the CPU"
    return None


@contextlib.contextmanager
def stock_diffusers():
    """Stock `DiffusionPipeline` methods for the duration (this package's configurations use `doe.OffloadMixin`);
    the global install state is restored afterwards."""
    was_installed = doe.is_installed()
    doe.uninstall()
    try:
        yield
    finally:
        if was_installed:
            doe.install()


def fresh(base, config: Config):
    """A new pipeline object over `base`'s component modules: stock class, or with this package's mixin."""
    cls = type(base)
    if config.kind == "ours":
        cls = type(f"Offload{cls.__name__}", (doe.OffloadMixin, cls), {})
    pipe = cls(**base.components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def prepare(pipe, config: Config, options: dict, device: torch.device) -> None:
    """Put `pipe` in `config`."""
    if config.kind == "none":
        pipe.to(device)
    elif config.kind == "sequential":
        pipe.enable_sequential_cpu_offload(device=device)
    elif config.kind == "group":
        pipe.enable_group_offload(device, **options)
    elif config.kind == "mm":
        from diffusers_mm import managed

        managed(pipe, **options)
    else:
        pipe.enable_model_cpu_offload(device=device, **options)


def reset(pipe, config: Config, device: torch.device) -> None:
    """Hooks removed and weights back on the host (the peers of `FOR_GOOD`, which run last, are left as they are)."""
    if config.kind not in FOR_GOOD:
        if config.kind == "ours":
            doe.release(pipe)
        pipe.remove_all_hooks()
        pipe.to("cpu")
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def timed_calls(pipe, make_kwargs, calls: int, device: torch.device) -> list:
    """Wall-clock seconds of each of `calls` calls, the device synchronised at the end of each."""
    seconds = []
    for _ in range(calls):
        start = time.perf_counter()
        pipe(**make_kwargs())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    return seconds


def moved_bytes(pipe, config: Config, make_kwargs, calls: int) -> dict:
    """Bytes that crossed the bus: the ledger's for this package's configurations, else `doe.trace`'s over one more
    (untimed) call."""
    if config.kind == "ours":
        per_call = doe.transfer_ledger(pipe).summary()["per_call"]
        empty = {"total_bytes": 0, "dropped_bytes": 0}
        steady, setup = per_call.get(calls - 1, empty), per_call.get(None, empty)
        return {
            "moved_steady_bytes": steady["total_bytes"],
            "onload_steady_bytes": steady.get("onload_bytes", 0),
            "dropped_steady_bytes": steady["dropped_bytes"],
            "moved_first_bytes": setup["total_bytes"] + per_call.get(0, empty)["total_bytes"],
            "pinned_bytes": doe.offload_status(pipe).pinned_bytes,
            "bytes_source": "transfer ledger",
        }
    with doe.trace(pipe) as trace:
        pipe(**make_kwargs())
    summary = trace.summary()
    source = "doe.trace, observed"
    if summary["replayed"]:
        source = "doe.trace, replayed from stock's policy (the CPU shows no moves): predicted, not measured"
    total = summary["total"]
    return {"moved_steady_bytes": total["total_bytes"], "onload_steady_bytes": total.get("onload_bytes", 0),
            "dropped_steady_bytes": total["dropped_bytes"], "moved_first_bytes": None, "pinned_bytes": None,
            "bytes_source": source}  # fmt: skip


def measure(base, config: Config, spec: dict, args, device: torch.device, make_kwargs) -> dict:
    """One row: the configuration prepared on a fresh pipeline, timed, its bytes counted, then reset."""
    options = resolve(config.options, spec, args)
    row = {"key": config.key, "label": label(config, options), "status": "ok", "budget_bytes": budget_of(options)}
    reason = skip_reason(config, options, device, args)
    if reason is not None:
        return {**row, "status": "skipped", "reason": reason}
    pipe = fresh(base, config)
    try:
        prepare(pipe, config, options, device)
        seconds = timed_calls(pipe, make_kwargs, args.calls, device)
        steady = sorted(seconds[1:])
        row.update(seconds=seconds, first_s=seconds[0], steady_s=[steady[0], steady[-1]])
        row["median_s"] = steady[len(steady) // 2] if len(steady) % 2 else sum(steady[len(steady) // 2 - 1 :][:2]) / 2
        row.update(moved_bytes(pipe, config, make_kwargs, args.calls))
        row["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    except torch.cuda.OutOfMemoryError as error:
        row = {**row, "status": "out of memory", "reason": str(error).splitlines()[0][:160]}
    except Exception as error:  # reported in the table; the run goes on and exits 1
        traceback.print_exc(file=sys.stderr)
        row = {**row, "status": "error", "reason": f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"}
    try:
        reset(pipe, config, device)
    except Exception as error:  # the weights' state is unknown: no later configuration can run on them
        traceback.print_exc(file=sys.stderr)
        row["reset_failed"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
    return row


def selected(args) -> tuple:
    """The configurations this run measures: `--only`'s, in the table's order, or all."""
    return tuple(c for c in CONFIGS if args.only is None or c.key in args.only)


def measure_all(base, spec: dict, args, device: torch.device, make_kwargs, on_row=None) -> list:
    """A row per selected configuration, in order, `on_row(rows)` called after each; after a reset that failed the
    others are not run."""
    rows = []
    for config in selected(args):
        ran = [r for r in rows if r["status"] != "skipped" and _kind(r["key"]) in FOR_GOOD]
        if ran:
            why = (
                f"not run: {ran[0]['key']!r}'s hooks cannot be removed; run it in its own process "
                f"(--only no-offload,{config.key})"
            )
            rows.append({"key": config.key, "label": label(config, resolve(config.options, spec, args)),
                         "status": "not run", "reason": why})  # fmt: skip
        elif rows and "reset_failed" in rows[-1]:
            why = f"not run: resetting {rows[-1]['key']!r} failed ({rows[-1]['reset_failed']})"
            rows.append({"key": config.key, "label": label(config, resolve(config.options, spec, args)),
                         "status": "error", "reason": why})  # fmt: skip
        else:
            rows.append(measure(base, config, spec, args, device, make_kwargs))
        if on_row is not None:
            on_row(rows)
    return rows


def warm_up(base, make_kwargs, device: torch.device) -> str:
    """One untimed call without offload, so that no configuration pays for the first kernels."""
    pipe = fresh(base, CONFIGS[0])
    try:
        pipe.to(device)
        pipe(**make_kwargs())
        return "one untimed call without offload before the first configuration"
    except torch.cuda.OutOfMemoryError:
        return "no warm-up call: the pipeline does not fit on the device without offload"
    finally:
        reset(pipe, CONFIGS[0], device)


def _kind(key: str) -> str:
    return next(c.kind for c in CONFIGS if c.key == key)


def add_ratios(rows: list, floor_rate: int = None) -> None:
    """`ratio`: a row's median steady call over no offload's median, from the same run; `floor_s`: no offload's median
    plus the row's host-to-device bytes per steady call at `floor_rate` bytes per second, and `floor_ratio` the row's
    median over it (how far from the bus's floor)."""
    base = next((r for r in rows if r["key"] == "no-offload" and r["status"] == "ok"), None)
    for row in rows:
        if row["status"] != "ok":
            continue
        row["ratio"] = row["median_s"] / base["median_s"] if base is not None else None
        if base is not None and floor_rate:
            row["floor_s"] = base["median_s"] + (row.get("onload_steady_bytes") or 0) / floor_rate
            row["floor_ratio"] = row["median_s"] / row["floor_s"]


def run(args, argv, on_row=None) -> dict:
    """Every selected configuration on `args.model`: `{"header": ..., "rows": [...]}`; `on_row(result)` is called
    with the result so far after each row (the header complete, `rows` those measured)."""
    device = torch.device("cuda", torch.cuda.current_device()) if args.scale == "real" else torch.device("cpu")
    spec = load_spec(args.model)
    with stock_diffusers():
        base = build.build_pipeline(spec, args.scale, device)
        kwargs = build.call_kwargs(spec, base, args)

        def make_kwargs():
            return {**kwargs, "generator": torch.Generator("cpu").manual_seed(SEED)}

        warm = warm_up(base, make_kwargs, device)
        header = build.machine(device, argv)
        header.update(model=args.model, scale=args.scale, calls=args.calls, budget=args.budget, warm_up=warm,
                      floor_rate=args.floor_rate)  # fmt: skip
        header.update(inputs=build.describe_inputs(spec, kwargs, args), components=build.component_sizes(base))
        header["notes"] = [MEASURED_NOTE] + ([TINY_NOTE] if args.scale == "tiny" else [])

        def partial(rows):
            add_ratios(rows, args.floor_rate)
            if on_row is not None:
                on_row({"header": header, "rows": rows})

        rows = measure_all(base, spec, args, device, make_kwargs, partial)
    add_ratios(rows, args.floor_rate)
    return {"header": header, "rows": rows}


def _table_row(r: dict) -> str:
    if r["status"] != "ok":
        return f"| `{r['label']}` | {r['status']}: {r['reason']} | | | | | | | | | | |"
    cells = [
        f"`{r['label']}`",
        f"{r['median_s']:.3f} ({r['steady_s'][0]:.3f}-{r['steady_s'][1]:.3f})",
        f"{r['first_s']:.3f}",
        "-" if r["ratio"] is None else f"{r['ratio']:.2f}",
        "-" if r.get("floor_s") is None else f"{r['floor_s']:.3f}",
        "-" if r.get("floor_ratio") is None else f"{r['floor_ratio']:.2f}",
        _size(r["peak_allocated_bytes"]),
        _size(r.get("budget_bytes")),
        *(_size(r[k]) for k in ("moved_steady_bytes", "moved_first_bytes", "pinned_bytes")),
        r["bytes_source"],
    ]
    return "| " + " | ".join(cells) + " |"


def _size(nbytes) -> str:
    return "-" if nbytes is None else format_size(nbytes)


def markdown(result: dict) -> str:
    """The result as a Markdown page."""
    h = result["header"]
    versions = ", ".join(f"{k} {v}" for k, v in h["versions"].items())
    sizes = ", ".join(f"{k} {format_size(v)}" for k, v in h["components"].items())
    gpu = f", driver {h['driver']}, CUDA {h['cuda']}" if h["driver"] else ""
    lines = [f"# Offload on a real GPU: {h['model']} ({h['scale']} scale)", ""]
    lines += [f"**{note}**" if note == TINY_NOTE else note for note in h["notes"]] + [""]
    lines += [f"- device: {h['device']}{gpu}; {h['platform']}", f"- versions: {versions}", f"- date: {h['date']}",
              f"- command: `{h['command']}`", f"- inputs: {h['inputs']}", f"- components: {sizes}",
              f"- {h['calls']} timed calls per configuration; {h['warm_up']}", ""]  # fmt: skip
    lines += ["| configuration | s / image, median of calls 2+ (min-max) | first call s | x no offload | floor s | "
              "x floor | peak allocated | memory budget | moved per steady call | moved in first call | "
              "page-locked host | bytes from |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    lines += [_table_row(row) for row in result["rows"]] + ["", LEGEND]
    return "\n".join(lines) + "\n"


def _bounded(parser, option: str, value: int, low: int, high: int, why: str = "") -> None:
    if not low <= value <= high:
        parser.error(f"argument {option}: must be {low} to {high}{why}, got {value!r}")


def parse(argv) -> argparse.Namespace:
    """The options, checked; a bad one exits 2 naming it, its value and the valid ones."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--model", default="flux-dev", choices=shipped_models(), help="a shipped model spec")
    parser.add_argument("--scale", default="real", choices=("real", "tiny"), help="tiny: the tiny pipeline on the CPU")
    parser.add_argument("--calls", type=int, default=None, help="timed calls per configuration, 2 to 20 (4; tiny 2)")
    parser.add_argument("--steps", type=int, default=28, help="denoising steps, 1 to 200 (real scale)")
    parser.add_argument("--height", type=int, default=512, help="image height, 64 to 2048, a multiple of 16")
    parser.add_argument("--width", type=int, default=512, help="image width, 64 to 2048, a multiple of 16")
    parser.add_argument("--frames", type=int, default=17, help="video frames (Wan), 1 to 121, 4k+1")
    parser.add_argument("--budget", default="26GiB", help="memory_budget of the residency rows (26GiB)")
    parser.add_argument(
        "--floor-rate", default=FLOOR_RATE, help=f"the rate of a row's floor, host-to-device ({FLOOR_RATE})"
    )
    parser.add_argument("--sequential", action="store_true", help="also run enable_sequential_cpu_offload (slow)")
    parser.add_argument("--write", metavar="PATH", help="write the Markdown table to PATH")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    parser.add_argument("--json-out", metavar="PATH", help="write the JSON document to PATH, again after each row")
    keys = [c.key for c in CONFIGS]
    parser.add_argument("--only", metavar="KEYS", help=f"comma-separated configurations to run, of: {', '.join(keys)}")
    args = parser.parse_args(argv)
    if args.only is not None:
        args.only = [k.strip() for k in args.only.split(",") if k.strip()]
        unknown = [k for k in args.only if k not in keys]
        if unknown or not args.only:
            parser.error(
                f"argument --only: unknown configuration(s) {unknown or args.only!r}; valid: {', '.join(keys)}"
            )
    args.calls = (4 if args.scale == "real" else 2) if args.calls is None else args.calls
    try:
        args.floor_rate = parse_rate(args.floor_rate, argument="--floor-rate")
    except PlanError as error:
        parser.error(f"argument --floor-rate: {error}")
    _bounded(parser, "--calls", args.calls, 2, 20, " (the first call is reported apart from the steady state)")
    _bounded(parser, "--steps", args.steps, 1, 200)
    for option, value in (("--height", args.height), ("--width", args.width)):
        _bounded(parser, option, value, 64, 2048)
        if value % 16:
            parser.error(f"argument {option}: must be a multiple of 16, got {value!r}")
    _bounded(parser, "--frames", args.frames, 1, 121)
    if (args.frames - 1) % 4:
        parser.error(f"argument --frames: must be 4k+1 (1, 5, 9, ..., 121), got {args.frames!r}")
    try:
        if parse_size(args.budget) <= 0:
            raise SizeError(args.budget, "not above zero")
    except SizeError as error:
        parser.error(f"argument --budget: {error} (for example 26GiB, 24GB, 20000000000)")
    ok, why = tiny.available(load_spec(args.model)["tiny"])
    if not ok:
        parser.error(f"argument --model: {args.model!r} cannot run with the installed packages: {why}")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    if args.scale == "real" and not torch.cuda.is_available():
        print("No CUDA GPU here: nothing measured (`--scale tiny` runs the same code on the CPU, tiny weights).")
        return 0

    def write(result):  # after each row, so that a run stopped midway keeps the rows it measured
        if args.write:
            with open(args.write, "w", encoding="utf-8") as f:
                f.write(markdown(result))
        if args.json_out:
            with open(args.json_out, "w", encoding="utf-8") as f:
                json.dump(result, f, indent=1)

    result = run(args, argv, write)
    write(result)
    if args.json:
        print(json.dumps(result, indent=1))
    elif args.write:
        print(f"Wrote {args.write}: {len(result['rows'])} configurations of {args.model} ({args.scale} scale).")
    else:
        print(markdown(result), end="")
    return 1 if any(row["status"] == "error" for row in result["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
