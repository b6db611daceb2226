"""Seconds per image of every offload configuration on a real-size model with random weights, against no offload in
the same run, on a CUDA GPU: the benchmark behind `docs/benchmarks-gpu.md`.

The pipeline is the shipped model spec's (`diffusers-offload plan --list`): its components built from their configs
with random weights (nothing is downloaded), its tokenizers and scheduler those of the tiny pipeline of the same
class. Each configuration runs `--calls` calls on the same weights; the first call is reported apart, the others as
min-max. Bytes are what `doe.trace` saw cross the bus; page-locked bytes are `doe.offload_status`'s.

    python benchmarks/realscale.py --model flux-dev --write docs/benchmarks-gpu.md
    python benchmarks/realscale.py --scale tiny --model flux-dev      # the same code on the CPU, tiny weights

Without CUDA (and without `--scale tiny`) it says so and exits 0. Tiny-scale CPU times are not benchmark figures.
"""

import argparse
import datetime
import json
import platform
import sys
import time

import torch

import diffusers_offload_ext as doe
from diffusers_offload_ext.models.specs import load_spec, shipped_models
from diffusers_offload_ext.units import format_size

#: Configuration -> keyword arguments of `enable_model_cpu_offload` (`None`: no offload; a str: diffusers' own).
CONFIGS = {
    "no offload": None,
    "stock": {},
    "exclude denoiser": {"exclude_from_offload": "{denoiser}"},
    "keep during generation": {"keep_on_device_during_generation": True},
    "defaults, eviction without copies": {"zero_copy_eviction": True},
    "defaults, page-locked": {"zero_copy_eviction": True, "pin_memory": True},
    "keep during generation, page-locked": {"keep_on_device_during_generation": True, "pin_memory": True},
    "residency, everything fits": {"keep_on_device_between_generations": True},
    "residency 26GiB": {"memory_budget": "26GiB", "keep_on_device_between_generations": True},
    "residency 26GiB, page-locked, prefetch": {
        "memory_budget": "26GiB",
        "keep_on_device_between_generations": True,
        "pin_memory": True,
        "prefetch": True,
    },
    "group offload (block level, streams)": "group",
}
CUDA_ONLY = {"pin_memory", "prefetch"}


def build(model: str, scale: str, device: torch.device):
    """The pipeline of `model`'s spec, on the host; real size with random weights, or the tiny pipeline."""
    from diffusers_offload_ext.testing import tiny

    spec = load_spec(model)
    small = tiny.build(spec["tiny"])
    if scale == "tiny":
        return small, spec
    modules = {}
    for name, entry in spec["components"].items():
        modules[name] = _random(entry, device).to("cpu")
        torch.cuda.empty_cache()
    return type(small)(**{**small.components, **modules}), spec


def _random(entry: dict, device: torch.device) -> torch.nn.Module:
    import importlib

    cls = getattr(importlib.import_module(entry["library"]), entry["class"])
    dtype = getattr(torch, entry.get("dtype", "bfloat16"))
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            if entry["library"] == "diffusers":
                return cls.from_config(entry["config"]).eval()
            return cls(cls.config_class(**entry["config"])).eval()
    finally:
        torch.set_default_dtype(default)


def prepare(pipe, name: str, options, spec: dict, device: torch.device) -> bool:
    """Put `pipe` in configuration `name`; False (with nothing changed) where the device cannot run it."""
    if options is None:
        pipe.to(device)
        return True
    if options == "group":
        if device.type != "cuda" or not hasattr(pipe, "enable_group_offload"):
            return False
        doe.uninstall()
        pipe.enable_group_offload(device, offload_type="block_level", num_blocks_per_group=1, use_stream=True)
        return True
    if device.type != "cuda" and CUDA_ONLY & set(options):
        return False
    kwargs = {k: (v.format(denoiser=spec["denoisers"][0]) if isinstance(v, str) else v) for k, v in options.items()}
    if name == "stock":
        doe.uninstall()
    else:
        doe.install()
    pipe.enable_model_cpu_offload(device=device, **kwargs)
    return True


def reset(pipe) -> None:
    if doe.is_installed():
        doe.release(pipe)
    pipe.remove_all_hooks()
    if hasattr(pipe, "disable_group_offload"):
        try:
            pipe.disable_group_offload()
        except Exception:  # not group offloaded
            pass
    pipe.to("cpu")
    doe.uninstall()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def measure(pipe, kwargs: dict, calls: int, device: torch.device) -> dict:
    seconds = []
    with doe.trace(pipe) as trace:
        for _ in range(calls):
            start = time.perf_counter()
            pipe(**kwargs)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
    total = trace.summary()["total"]
    status = doe.offload_status(pipe) if doe.is_installed() else None
    return {
        "first_s": seconds[0],
        "steady_s": [min(seconds[1:]), max(seconds[1:])] if calls > 1 else None,
        "peak_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
        "moved_bytes": total["onload_bytes"] + total["offload_bytes"],
        "page_locked_bytes": status.pinned_bytes if status is not None else 0,
    }


def run(args) -> dict:
    device = torch.device("cuda", 0) if args.scale == "real" else torch.device("cpu", 0)
    pipe, spec = build(args.model, args.scale, device)
    from diffusers_offload_ext.testing import tiny

    kwargs = tiny.call_kwargs(spec["tiny"], pipe=pipe)
    if args.scale == "real":
        kwargs.update(height=args.size, width=args.size, num_inference_steps=args.steps)
    rows = {}
    for name, options in CONFIGS.items():
        if not prepare(pipe, name, options, spec, device):
            rows[name] = {"skipped": "needs CUDA" if device.type != "cuda" else "not in this diffusers"}
            continue
        try:
            rows[name] = measure(pipe, kwargs, args.calls, device)
        except torch.cuda.OutOfMemoryError as error:
            rows[name] = {"skipped": f"out of memory: {str(error).splitlines()[0][:80]}"}
        reset(pipe)
    base = rows["no offload"].get("steady_s") or [rows["no offload"]["first_s"]]
    for row in rows.values():
        if "first_s" in row:
            steady = row["steady_s"] or [row["first_s"]]
            row["ratio_to_no_offload"] = steady[0] / base[0]
    return {"header": header(args, device), "rows": rows}


def header(args, device: torch.device) -> dict:
    import accelerate
    import diffusers

    return {
        "model": args.model,
        "scale": args.scale,
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else f"CPU ({platform.processor() or '?'})",
        "cuda": torch.version.cuda,
        "versions": {
            "torch": torch.__version__,
            "diffusers": diffusers.__version__,
            "accelerate": accelerate.__version__,
        },
        "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/realscale.py " + " ".join(sys.argv[1:]),
        "calls": args.calls,
        "note": None if args.scale == "real" else "tiny weights on the CPU: these times are not benchmark figures",
    }


def markdown(result: dict) -> str:
    h = result["header"]
    lines = [f"# Offload on a real GPU: {h['model']}", "", f"{h['device']}, CUDA {h['cuda']}, {h['versions']}, "
             f"{h['date']}; `{h['command']}`; {h['calls']} calls per configuration.", ""]  # fmt: skip
    if h["note"]:
        lines += [f"**{h['note']}**", ""]
    lines += ["| configuration | s / image (steady) | first call s | ratio | peak allocated | moved | page-locked |",
              "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, r in result["rows"].items():
        if "skipped" in r:
            lines.append(f"| {name} | skipped: {r['skipped']} | | | | | |")
            continue
        steady = "-" if r["steady_s"] is None else f"{r['steady_s'][0]:.2f}-{r['steady_s'][1]:.2f}"
        peak = "-" if r["peak_bytes"] is None else format_size(r["peak_bytes"])
        lines.append(f"| {name} | {steady} | {r['first_s']:.2f} | {r['ratio_to_no_offload']:.2f} | {peak} | "
                     f"{format_size(r['moved_bytes'])} | {format_size(r['page_locked_bytes'])} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="flux-dev", choices=shipped_models())
    parser.add_argument("--scale", default="real", choices=("real", "tiny"))
    parser.add_argument("--calls", type=int, default=4, help="calls per configuration, 1 to 20")
    parser.add_argument("--steps", type=int, default=28, help="denoising steps (real scale), 1 to 200")
    parser.add_argument("--size", type=int, default=512, help="image height and width (real scale), 64 to 2048")
    parser.add_argument("--write", help="write the Markdown table to this file")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)
    for option, value, low, high in (("--calls", args.calls, 1, 20), ("--steps", args.steps, 1, 200),
                                     ("--size", args.size, 64, 2048)):  # fmt: skip
        if not low <= value <= high:
            parser.error(f"`{option}` must be {low} to {high}, got {value!r}.")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.scale == "real" and not torch.cuda.is_available():
        print("No CUDA GPU here: nothing measured (`--scale tiny` runs the same code on the CPU).")
        return 0
    result = run(args)
    text = markdown(result)
    if args.write:
        with open(args.write, "w", encoding="utf-8") as f:
            f.write(text)
    print(json.dumps(result, indent=1) if args.json else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
