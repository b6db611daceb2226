"""`diffusers-offload demo`: the tiny Flux pipeline run on the CPU under four offload settings, its transfer
ledger, and what the same moves cost for the real FLUX.1-dev (sizes from the shipped model data)."""

from __future__ import annotations

import importlib.util
from typing import Dict, List, Tuple

from ..constants import COPY, GiB, KiB, ONLOAD
from ..models.bounds import format_rate, parse_count, parse_rate
from . import output
from .plan import add_bandwidth_arguments, bandwidths

HELP = "run the tiny Flux pipeline under four offload settings and show its transfer ledger (what `make demo` runs)"
CONFIGS = (
    ("stock", "stock model offload", {}),
    ("exclude_transformer", 'exclude_from_offload=["transformer"]', {"exclude_from_offload": ["transformer"]}),
    ("keep_during_generation", "keep_on_device_during_generation=True", {"keep_on_device_during_generation": True}),
    ("memory_budget", "memory_budget (keep between)", {"keep_on_device_between_generations": True}),
)
#: The budget setting's `memory_budget` holds every component of the tiny pipeline but this one, as a 16 GiB card
#: (`BUDGET_CARD`) holds the real ones but T5 (which streams its blocks there: the tiny T5 is too small to).
BUDGET_LEAVES_OUT = "text_encoder_2"
BUDGET_CARD = "16GiB"
GENERATIONS, MAX_GENERATIONS = 3, 20
#: FLUX.1-dev's default number of steps, so that the real-model figures are per real generation.
STEPS, MAX_STEPS = 28, 200
REAL_MODEL = "flux-dev"
REAL_DTYPES = ("transformer=fp8",)
CARD = 24 * GiB
#: The `plan` of the same real model, card and dtypes (plan's own default is the model's bfloat16).
PLAN_COMMAND = f"diffusers-offload plan --model {REAL_MODEL} --vram 24GiB --dtype {','.join(REAL_DTYPES)} --preview"
INSTALL_DEMO = "pip install 'diffusers-offload-ext[demo]' (from a clone: pip install '.[demo]')"


def add_parser(commands, common) -> None:
    d = commands.add_parser("demo", parents=[common], help=HELP, description=HELP + ".")
    d.add_argument(
        "--generations", default=str(GENERATIONS), help=f"generations per setting, 1 to {MAX_GENERATIONS} (default: 3)"
    )
    d.add_argument("--steps", default=str(STEPS), help=f"denoising steps, 1 to {MAX_STEPS} (default: {STEPS})")
    add_bandwidth_arguments(d, "the real model's bytes")
    d.add_argument("--png", metavar="PATH", help="also write the timeline of the four settings to this PNG file")
    d.set_defaults(handler=run)


def run(args) -> int:
    generations = parse_count(args.generations, argument="--generations", maximum=MAX_GENERATIONS)
    steps = parse_count(args.steps, argument="--steps", maximum=MAX_STEPS)
    texts = bandwidths(args)
    rates = (
        parse_rate(texts["h2d_bandwidth"], argument="--h2d-bandwidth"),
        parse_rate(texts["d2h_bandwidth"], argument="--d2h-bandwidth"),
    )
    png = output.check_output_path(args.png, "--png") if args.png else None
    result, traces = run_demo(generations=generations, steps=steps, rates=rates, record=png is not None)
    if png:
        write_timeline(traces, png)
        result["png"] = png
    if args.json:
        output.emit_json(result)
    else:
        output.write(render(result, output.width()))
    return 0


def require_transformers() -> None:
    """Raise `MissingPackage` unless transformers is installed (the tiny pipelines' text encoders need it)."""
    from ..models.errors import MissingPackage

    if importlib.util.find_spec("transformers") is None:
        raise MissingPackage(
            "transformers", "the demo (its tiny Flux pipeline has CLIP and T5 text encoders)", INSTALL_DEMO
        )


def run_demo(*, generations: int, steps: int, rates: Tuple[int, int], record: bool = False):
    """Run the tiny Flux pipeline `generations` times with a preview callback under each setting of `CONFIGS`.

    Returns:
        `(result, traces)`: the JSON-ready result, and `{setting: Trace}` when `record` (else empty).
    """
    require_transformers()
    import torch

    from ..models import load_model
    from .. import install, is_installed, uninstall

    real = load_model(REAL_MODEL, REAL_DTYPES).sizes
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny pipelines are a few hundred kilobytes: more threads only add contention
    installed_before = is_installed()
    install()
    settings, traces = {}, {}
    try:
        with output.quiet_transformers():
            for key, title, options in CONFIGS:
                records, traces[key] = _run_setting(options, generations, steps, record)
                settings[key] = _figures(title, records, generations, real, rates)
        settings["memory_budget"].update(_planned_budget(generations, steps, rates))
    finally:
        if not installed_before:
            uninstall()
        torch.set_num_threads(threads)
    return _result(settings, generations, steps, rates, real), {k: t for k, t in traces.items() if t is not None}


def _run_setting(options: dict, generations: int, steps: int, record: bool):
    """The ledger records of `generations` calls under `options`, and their `Trace` when `record`."""
    import contextlib

    import torch

    from .. import trace, transfer_ledger
    from ..testing import tiny

    ok, reason = tiny.available("flux")
    if not ok:
        from ..models.errors import MissingPackage

        raise MissingPackage("a diffusers with FluxPipeline", f"the demo ({reason})", "pip install -U diffusers")
    pipe = tiny.build("flux")
    if options.get("keep_on_device_between_generations"):
        from .. import module_nbytes

        sizes = {n: module_nbytes(m) for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
        options = dict(options, memory_budget=sum(sizes.values()) - sizes[BUDGET_LEAVES_OUT])
    pipe.enable_model_cpu_offload(device="cpu", **options)
    ledger = transfer_ledger(pipe)
    recorder = trace(pipe) if record else contextlib.nullcontext()
    with torch.no_grad(), recorder as recorded:
        for seed in range(generations):
            kwargs = tiny.call_kwargs("flux", seed=seed, preview=True)
            kwargs["num_inference_steps"] = steps
            pipe(**kwargs)
    return list(ledger.records), recorded


def _planned_budget(generations: int, steps: int, rates: Tuple[int, int]) -> dict:
    """The budget setting's real-size figures: the plan's for the real model on a `BUDGET_CARD` card (its blocks
    stream there, and block moves do not map onto the tiny pipeline's by name)."""
    from ..models import plan

    result = plan(REAL_MODEL, vram=BUDGET_CARD, dtypes=REAL_DTYPES, steps=steps, generations=generations, preview=True,
                  h2d_bandwidth=rates[0], d2h_bandwidth=rates[1])  # fmt: skip
    entry = result["strategies"]["residency"]
    return {
        "real_call": entry["call"],
        "real_card_bytes": result["vram_bytes"],
        "real_source": f"plan at {BUDGET_CARD}",
        "real_bytes_per_generation": entry["mean_bytes_per_generation_including_setup"]
        - entry["setup_bytes"] / generations,
        "real_bytes_at_enable": entry["setup_bytes"],
        "real_seconds_per_generation_at_assumed_bandwidth": entry["seconds_per_image"],
        "real_peak_bytes": entry["peak_bytes"],
        "real_fits_card": entry["fits_with_reserve"],
    }


def _figures(title: str, records, generations: int, real: Dict[str, int], rates: Tuple[int, int]) -> dict:
    """Counts and bytes of one setting's ledger per generation, and priced with the real model's sizes."""
    in_calls = [r for r in records if r.call_index is not None]
    at_enable = [r for r in records if r.call_index is None]
    resident, peak = set(), 0
    for r in records:
        (resident.add if r.direction == ONLOAD else resident.discard)(r.component)
        peak = max(peak, sum(real[n] for n in resident))

    def real_bytes(selected, direction):
        return sum(real[r.component] for r in selected if r.kind == COPY and r.direction == direction)

    h2d, d2h = real_bytes(in_calls, "onload"), real_bytes(in_calls, "offload")
    return {
        "options": title,
        "onloads_per_generation": sum(r.direction == ONLOAD for r in in_calls) / generations,
        "offloads_per_generation": sum(r.direction != ONLOAD for r in in_calls) / generations,
        "tiny_bytes_per_generation": sum(r.copied_bytes for r in in_calls) / generations,
        "tiny_bytes_at_enable": sum(r.copied_bytes for r in at_enable),
        "real_bytes_per_generation": (h2d + d2h) / generations,
        "real_bytes_at_enable": real_bytes(at_enable, "onload") + real_bytes(at_enable, "offload"),
        "real_seconds_per_generation_at_assumed_bandwidth": (h2d / rates[0] + d2h / rates[1]) / generations,
        "real_peak_bytes": peak,
        "real_card_bytes": CARD,
        "real_source": "the ledger's moves",
        "real_fits_card": peak <= CARD,
    }


def _result(settings: dict, generations: int, steps: int, rates: Tuple[int, int], real: Dict[str, int]) -> dict:
    return {
        "pipeline": "tiny FluxPipeline (diffusers_offload_ext.testing.tiny), on the CPU",
        "generations": generations,
        "steps": steps,
        "preview": "callback_on_step_end decodes the latents with the VAE every step",
        "units": "bytes; bandwidths in bytes per second; seconds priced at the assumed bandwidths",
        "bandwidth": {"assumed": True, "h2d_bytes_per_s": rates[0], "d2h_bytes_per_s": rates[1]},
        "real_model": "FLUX.1-dev, transformer in float8_e4m3fn, text encoders and VAE in bfloat16",
        "real_sizes": real,
        "plan_command": PLAN_COMMAND,
        "configurations": settings,
        "png": None,
    }


def write_timeline(traces: dict, path: str) -> None:
    """The settings' timelines as one PNG at `path`."""
    from ..observe.report import plot_traces

    items = [(f"tiny Flux, {title}", traces[key]) for key, title, _ in CONFIGS]
    try:
        plot_traces(items, path)
    except OSError as error:
        raise output.OutputPathError(f"--png {path}: {error.strerror or error}.") from None


def render(result: dict, columns: int) -> List[str]:
    """The demo's result as text lines that fit in `columns` (tiny bytes in KiB, real ones in GiB)."""
    lines = output.wrap(
        f"Tiny Flux on the CPU, {result['generations']} generations of {result['steps']} steps with a preview decoded "
        "every step, from the transfer ledger (per generation: moves inside the calls / generations; at enable: moves "
        "made once by enable_model_cpu_offload). Binary units: KiB = 2^10 bytes, GiB = 2^30 bytes.",
        columns,
    )
    rows = [
        [
            e["options"],
            f"{e['onloads_per_generation']:g}",
            f"{e['offloads_per_generation']:g}",
            f"{e['tiny_bytes_per_generation'] / KiB:,.0f}",
            f"{e['tiny_bytes_at_enable'] / KiB:,.0f}",
        ]
        for e in result["configurations"].values()
    ]
    headers = ["options", "onloads", "offloads", "KiB/gen", "KiB at enable"]
    lines += [""] + output.table(headers, rows, columns, [False] + [True] * 4)
    return lines + [""] + _render_real(result, columns)


def _render_real(result: dict, columns: int) -> List[str]:
    sizes = ", ".join(f"{n} {output.gib(b)}" for n, b in result["real_sizes"].items())
    h2d, d2h = (format_rate(result["bandwidth"][k]) for k in ("h2d_bytes_per_s", "d2h_bytes_per_s"))
    lines = output.wrap(
        f"The same moves for {result['real_model']} (GiB; sizes from the shipped model data: {sizes}; the budget's "
        f"from the plan of a {BUDGET_CARD[:-3]} GiB card):",
        columns,
    )
    rows = [
        [
            e["options"],
            output.gib(e["real_bytes_per_generation"]),
            f"{e['real_seconds_per_generation_at_assumed_bandwidth']:,.2f}",
            output.gib(e["real_bytes_at_enable"]),
            output.gib(e["real_peak_bytes"]),
            f"{e['real_card_bytes'] / GiB:g}: " + ("yes" if e["real_fits_card"] else "no"),
        ]
        for e in result["configurations"].values()
    ]
    headers = ["options", "GiB/gen", "s/gen*", "enable", "peak", "fits"]
    lines += output.table(headers, rows, columns, [False] + [True] * 4 + [False])
    budget = result["configurations"]["memory_budget"].get("real_call")
    if budget:
        lines += output.wrap(f"The budget's call on a {BUDGET_CARD[:-3]} GiB card: {budget}", columns, "  ")
    lines += output.wrap(
        "fits: the card's GiB, and whether the weights' peak fits it (the budget's: with the activations kept "
        "free). "
        f"* priced at ASSUMED bandwidths of {h2d} host-to-device and {d2h} device-to-host (not measured; set "
        "--h2d-bandwidth and --d2h-bandwidth: `diffusers-offload doctor` measures them on a CUDA machine).",
        columns,
        "  ",
    )
    lines += output.wrap(
        f"The plan of the same model, dtypes and card (plan alone sizes FLUX.1-dev in bfloat16): "
        f"{result['plan_command']}",
        columns,
        "  ",
    )
    if result.get("png"):
        lines += output.wrap(f"Timeline written to {result['png']}", columns)
    return lines
