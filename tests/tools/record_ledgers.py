"""Record the transfer ledger of every tiny pipeline x scenario x option set, through the public API only.

The ledgers are the behaviour a refactoring of the runtime must keep byte for byte: run this script on the code
before the refactoring (it writes `tests/data/ledgers-baseline.json`), and `tests/test_ledger_baseline.py` compares
a subset of them to what the code under test records now. The script only uses `diffusers_offload_ext.install`,
`uninstall`, `transfer_ledger`, `module_nbytes`, the documented `enable_model_cpu_offload` options and the tiny
pipelines of the test suite, so it runs unchanged against any version of the package.

    PYTHONPATH=. python tests/tools/record_ledgers.py [--device plain|simulated|both] [--pipelines flux,sdxl]

Each execution device has its own file, because the fast paths differ by device: `ledgers-baseline.json` is the plain
CPU's (`cpu:0` is host memory: the plain paths, every eviction a copy), `ledgers-baseline-simulated.json` the
simulated accelerator's (`diffusers_offload_ext/testing/simulated_accelerator.py`: device memory distinct from the
host's, so unchanged components are dropped by default instead of copied back).

Each entry, keyed `"{pipeline}/{scenario}/{option}"`, holds:

* `options`: the `enable_model_cpu_offload` keyword arguments used (besides `device="cpu"`);
* `ledger`: every record, `[component, direction, nbytes, call_index, kind, step]`, in order;
* `hooked`: the components with an accelerate `CpuOffload` hook (or a subclass) at the end;
* `shape`: the shape of the last call's images;
* `checksum`: their float sum, rounded to 4 digits (informational: the tiny Flux-like pipelines are not
  bit-identical from run to run on the CPU, so it is never compared);
* or, instead of the above, `error`: `"ExceptionType: message"` when enabling offload or a call raised.

Importable: `record(name, scenario, option)`, `record_all()`, `header()`, `dumps(data)`, `diff(expected, actual)`,
`main(argv)`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

TESTS = pathlib.Path(__file__).resolve().parent.parent
ROOT = TESTS.parent
DATA = TESTS / "data"
DEFAULT_OUTPUT = DATA / "ledgers-baseline.json"
#: The execution devices a baseline is recorded on, and the file of each (`baseline_file`).
DEVICES = ("plain", "simulated")
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

import tiny_pipelines as tiny  # noqa: E402  (loads diffusers_offload_ext/tiny.py by path, not the package)

#: scenario -> (pipeline calls, preview-decoding step callback); as in tests/test_pipelines.py.
SCENARIOS = {"plain": (1, False), "preview": (1, True), "three_calls": (3, False)}
#: Option sets every pipeline runs (the keyword arguments come from `options_for`).
OPTIONS = (
    "stock",
    "exclude",
    "keep",
    "exclude+keep",
    "keep_between",
    "budget_fits",
    "budget_tight",
    "budget_tight_copy",
    "keep_between+exclude_vae",
)
#: Extra option sets for the two-expert Wan 2.2 pipeline (its main sets treat `transformer` as the denoiser).
WAN22_OPTIONS = ("exclude_transformer_2", "exclude_experts", "keep_experts", "keep_experts+exclude_vae")
_DENOISER = {"sd15": "unet", "sdxl": "unet", "sd_controlnet": "unet"}  # the others: "transformer"


def denoiser(name: str) -> str:
    return _DENOISER.get(name, "transformer")


def option_names(name: str) -> tuple:
    """The option sets recorded for pipeline `name`."""
    return OPTIONS + (WAN22_OPTIONS if name == "wan22" else ())


def components(pipe) -> dict:
    import torch

    return {n: m for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}


def tight_budget(name: str, pipe) -> int:
    """The denoiser's bytes plus half the largest text encoder's: the denoiser fits, not much else beside it."""
    from diffusers_offload_ext import module_nbytes

    modules = components(pipe)
    encoders = [module_nbytes(m) for n, m in modules.items() if n.startswith("text_encoder")]
    return module_nbytes(modules[denoiser(name)]) + max(encoders, default=0) // 2


def options_for(name: str, option: str, pipe) -> dict:
    """The `enable_model_cpu_offload` keyword arguments (besides `device`) of option set `option`."""
    main = denoiser(name)
    if option == "stock":
        return {}
    if option == "exclude":
        return {"exclude_from_offload": [main]}
    if option == "keep":
        return {"keep_on_device_during_generation": True}
    if option == "exclude+keep":
        return {"exclude_from_offload": [main], "keep_on_device_during_generation": True}
    if option == "keep_between":
        return {"keep_on_device_between_generations": True}
    if option == "budget_fits":
        return {"memory_budget": "80GiB"}
    if option == "budget_tight":
        return {"memory_budget": tight_budget(name, pipe), "keep_on_device_between_generations": True}
    if option == "budget_tight_copy":
        return {**options_for(name, "budget_tight", pipe), "zero_copy_eviction": False}
    if option == "keep_between+exclude_vae":
        return {"keep_on_device_between_generations": True, "exclude_from_offload": ["vae"]}
    if name == "wan22":
        experts = ["transformer", "transformer_2"]
        if option == "exclude_transformer_2":
            return {"exclude_from_offload": ["transformer_2"]}
        if option == "exclude_experts":
            return {"exclude_from_offload": experts}
        if option == "keep_experts":
            return {"keep_on_device_during_generation": experts}
        if option == "keep_experts+exclude_vae":
            return {"keep_on_device_during_generation": experts, "exclude_from_offload": ["vae"]}
    raise KeyError(f"unknown option set {option!r} for {name!r}")


def key(name: str, scenario: str, option: str) -> str:
    return f"{name}/{scenario}/{option}"


def all_keys(names=None):
    """Every `(name, scenario, option)`, available or not, in the order the file lists them."""
    for name in names or tiny.PIPELINES:
        for scenario in SCENARIOS:
            for option in option_names(name):
                yield name, scenario, option


def record(name: str, scenario: str, option: str) -> dict:
    """Build pipeline `name`, enable offload with option set `option`, run `scenario`, return the entry.

    Installs the extension if it is not installed (and leaves it installed)."""
    import torch
    from accelerate.hooks import CpuOffload

    import diffusers_offload_ext as doe

    calls, preview = SCENARIOS[scenario]
    doe.install()
    pipe = tiny.build(name)
    options = options_for(name, option, pipe)
    entry = {"options": options}
    try:
        pipe.enable_model_cpu_offload(device="cpu", **options)
        ledger = doe.transfer_ledger(pipe)
        with torch.no_grad():
            for _ in range(calls):
                images = tiny.run(pipe, name, seed=0, preview=preview)
    except Exception as error:  # recorded: a refactoring must raise the same
        entry["error"] = f"{type(error).__name__}: {error}"
        return entry
    entry["ledger"] = [[r.component, r.direction, r.nbytes, r.call_index, r.kind, r.step] for r in ledger.records]
    hooked = [n for n, m in components(pipe).items() if isinstance(getattr(m, "_hf_hook", None), CpuOffload)]
    entry["hooked"] = sorted(hooked)
    entry["shape"] = list(images.shape)
    entry["checksum"] = round(float(images.sum()), 4)
    return entry


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip()


def header() -> dict:
    import accelerate
    import diffusers
    import torch
    import transformers

    return {
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "accelerate": accelerate.__version__,
        "transformers": transformers.__version__,
        "commit": _commit(),
        "record": "[component, direction, nbytes, call_index, kind, step]",
    }


def baseline_file(device: str = "plain", diffusers_version: str = None):
    """The baseline file of `device` (`"plain"` or `"simulated"`); with `diffusers_version`, that version's own file
    if there is one (recorded when a diffusers version records different ledgers for a real reason)."""
    if device not in DEVICES:
        raise ValueError(f"`device` must be one of {DEVICES!r}, got {device!r}.")
    stem = "ledgers-baseline" + ("" if device == "plain" else f"-{device}")
    if diffusers_version is not None:
        specific = DATA / f"{stem}-diffusers-{diffusers_version}.json"
        if specific.exists():
            return specific
    return DATA / f"{stem}.json"


def _on(device: str):
    """The context the ledgers of `device` are recorded in: nothing for the plain CPU, the simulated accelerator."""
    import contextlib

    if device == "plain":
        return contextlib.nullcontext()
    from diffusers_offload_ext.testing.simulated_accelerator import SimulatedAccelerator

    return SimulatedAccelerator()


def record_all(names=None, progress=None, device: str = "plain") -> dict:
    """`{"header": ..., "{pipeline}/{scenario}/{option}": entry, ...}` for every available pipeline in `names`
    (default: all of `tiny.PIPELINES`) on `device` (`"plain"`: the plain CPU; `"simulated"`: the simulated
    accelerator). Uninstalls the extension at the end."""

    import diffusers_offload_ext as doe

    data = {"header": {**header(), "device": device}}
    doe.install()
    try:
        for name, scenario, option in all_keys(names):
            if not tiny.available(name)[0]:
                continue
            with _on(device):
                data[key(name, scenario, option)] = record(name, scenario, option)
            if progress is not None:
                progress(key(name, scenario, option))
    finally:
        doe.uninstall()
    return data


def dumps(data: dict) -> str:
    """JSON with one line per ledger record (small, and a diff of two files shows the records that changed)."""
    lines = ["{"]
    items = list(data.items())
    for i, (k, entry) in enumerate(items):
        comma = "," if i < len(items) - 1 else ""
        fields = []
        for field, value in entry.items():
            if field == "ledger" and value:
                rows = ",\n".join(f"      {json.dumps(r)}" for r in value)
                fields.append(f'    "ledger": [\n{rows}\n    ]')
            else:
                fields.append(f"    {json.dumps(field)}: {json.dumps(value, sort_keys=True)}")
        lines.append(f"  {json.dumps(k)}: {{\n" + ",\n".join(fields) + f"\n  }}{comma}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def load(path=DEFAULT_OUTPUT) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def comparable(entry: dict) -> dict:
    """The fields compared exactly: everything but the checksum, and each record without its step. The baseline was
    recorded when the ledger filled `step` only while `doe.trace` ran (null everywhere here); since the runtime core
    v2 the call tracker fills it always, which `tests/test_ledger_baseline.py` checks on its own."""
    entry = {k: v for k, v in entry.items() if k != "checksum"}
    if isinstance(entry.get("ledger"), list):
        entry["ledger"] = [record[:5] for record in entry["ledger"]]
    return entry


def diff(expected: dict, actual: dict) -> str:
    """A readable difference of two entries' compared fields ("" when equal)."""
    import difflib

    expected, actual = comparable(expected), comparable(actual)
    if expected == actual:
        return ""
    out = []
    for field in sorted(set(expected) | set(actual)):
        a, b = expected.get(field), actual.get(field)
        if a == b:
            continue
        if field == "ledger" and isinstance(a, list) and isinstance(b, list):
            lines = difflib.unified_diff(
                [json.dumps(r) for r in a], [json.dumps(r) for r in b], "baseline", "now", lineterm="", n=2
            )
            out.append(f"ledger ({len(a)} records in the baseline, {len(b)} now):\n" + "\n".join(lines))
        else:
            out.append(f"{field}: baseline {json.dumps(a)}\n{' ' * len(field)}  now      {json.dumps(b)}")
    return "\n".join(out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device", default="both", choices=DEVICES + ("both",), help="the execution device(s) to record on"
    )
    parser.add_argument("--output", default=None, help="JSON file to write (one device only; default: its baseline)")
    parser.add_argument("--pipelines", default=None, help="comma-separated tiny pipelines (default: all)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch

    import diffusers_offload_ext

    torch.set_num_threads(1)  # as the test suite (tests/conftest.py)
    print(f"diffusers_offload_ext from {diffusers_offload_ext.__file__}", file=sys.stderr)
    names = args.pipelines.split(",") if args.pipelines else None
    for name in names or tiny.PIPELINES:
        ok, reason = tiny.available(name)
        if not ok:
            print(f"skipped: {reason}", file=sys.stderr)
    devices = DEVICES if args.device == "both" else (args.device,)
    if args.output is not None and len(devices) > 1:
        parser.error("--output needs one --device")
    for device in devices:
        start = time.perf_counter()
        data = record_all(names, device=device)
        elapsed = time.perf_counter() - start
        path = pathlib.Path(args.output) if args.output is not None else baseline_file(device)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dumps(data), encoding="utf-8")
        print(f"{device}: {len(data) - 1} entries in {elapsed:.1f} s -> {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
