"""`diffusers-offload plan`: predicted transfers of each offload strategy for a real model on a card, from the
shipped model data (no weights, no pipeline run, no transformers needed)."""

from __future__ import annotations

from typing import List

from ..models.bounds import MAX_GENERATIONS, MAX_STEPS, REPLAYED_GENERATIONS, format_rate
from ..models.plan import DEFAULT_BANDWIDTH, DEFAULT_PINNED_BANDWIDTH, DEFAULT_RESERVE, DEFAULT_VRAM
from ..models.host import DEFAULT_DISK_BANDWIDTH, host_line
from . import output

HELP = "predict the bytes each offload strategy moves per generation, and the call to use"
ABOUT_SIZES = "Sizes in GiB (2^30 bytes)."


def add_parser(commands, common) -> None:
    p = commands.add_parser("plan", parents=[common], help=HELP, description=HELP + ".")
    p.add_argument("--model", help="a shipped model (see --list) or the path of a model spec JSON")
    p.add_argument("--list", action="store_true", help="list the shipped models")
    p.add_argument(
        "--vram", default=DEFAULT_VRAM, help=f"the card's memory, e.g. 24GiB, 80GB (default: {DEFAULT_VRAM})"
    )
    p.add_argument(
        "--reserve",
        default=DEFAULT_RESERVE,
        help="memory kept free for activations when checking what fits, ASSUMED when --activations is not given "
        f"(default: {DEFAULT_RESERVE}, the runtime's memory_reserve for a call shape it has not seen)",
    )
    p.add_argument(
        "--activations",
        help="the activations of the call when known (e.g. 6GiB: `doe.offload_status(pipe).learnt` reports them "
        "after a call on the card): the reserve is then them and a margin, as the runtime learns it",
    )
    p.add_argument("--steps", default="28", help=f"denoising steps per generation, 1 to {MAX_STEPS:,} (default: 28)")
    p.add_argument(
        "--generations",
        default="10",
        help=f"pipeline calls in a row, 1 to {MAX_GENERATIONS:,} (default: 10); the first {REPLAYED_GENERATIONS} are "
        "replayed move by move, later ones extrapolated from the period their bytes settle into",
    )
    p.add_argument("--preview", action="store_true", help="a step callback decodes a preview with the VAE every step")
    add_bandwidth_arguments(p, "the bytes")
    p.add_argument(
        "--pinned-bandwidth",
        default=DEFAULT_PINNED_BANDWIDTH,
        help="ASSUMED host-to-device bandwidth from page-locked memory, for block residency's and group offload's "
        f"copies (default: {DEFAULT_PINNED_BANDWIDTH}, PCIe 4.0 x16; `diffusers-offload doctor` measures it on CUDA)",
    )
    p.add_argument(
        "--ram",
        help="the host's memory (default: this machine's, the smaller of physical memory and the cgroup's limit): "
        "whether the weights fit it, which stay in their files, the disk reads per image",
    )
    p.add_argument(
        "--disk-bandwidth",
        help=f"the disk's read rate for weights read from their files (default: ASSUMED {DEFAULT_DISK_BANDWIDTH})",
    )
    p.add_argument(
        "--step-seconds",
        help="seconds one denoiser forward takes on the card without offload (measure it; e.g. seconds per image "
        "without offload / steps): block residency then models seconds per image, streamed copies hidden behind "
        "compute up to it (default: none, the copies alone)",
    )
    p.add_argument(
        "--dtype",
        action="append",
        metavar="COMPONENT=DTYPE",
        help="weights dtype of a component (or of every 'denoiser'), e.g. transformer=fp8; repeatable",
    )
    p.add_argument(
        "--component",
        action="append",
        metavar="NAME=[CLASS:]CONFIG.json",
        help="replace a component by a diffusers/transformers class and its config.json (built on the meta device; "
        "a transformers class needs transformers installed); repeatable",
    )
    p.set_defaults(handler=run)


def add_bandwidth_arguments(parser, what: str) -> None:
    """`--bandwidth` and the two `--h2d-bandwidth` / `--d2h-bandwidth` it stands for (all assumed, not measured)."""
    parser.add_argument(
        "--bandwidth",
        help=f"shorthand for both --h2d-bandwidth and --d2h-bandwidth (default: {DEFAULT_BANDWIDTH} each)",
    )
    for direction, words in (("h2d", "host-to-device"), ("d2h", "device-to-host")):
        parser.add_argument(
            f"--{direction}-bandwidth",
            help=f"ASSUMED {words} bandwidth that prices {what} in seconds, e.g. 12GB/s, 25GiB/s (default: "
            f"{DEFAULT_BANDWIDTH}, pageable memory over PCIe 4.0 x16; nothing here measures it)",
        )


def bandwidths(args) -> dict:
    """The two bandwidth texts of `args` (`--bandwidth` fills the ones not given)."""
    both = args.bandwidth or DEFAULT_BANDWIDTH
    return {"h2d_bandwidth": args.h2d_bandwidth or both, "d2h_bandwidth": args.d2h_bandwidth or both}


def run(args) -> int:
    from ..models import plan, shipped_models
    from ..models.errors import PlanError
    from ..models.host import parse_host
    from ..models.plan import check_request

    if args.list:
        return _list(args)
    request = dict(
        vram=args.vram,
        reserve=args.reserve,
        steps=args.steps,
        generations=args.generations,
        preview=args.preview,
        pinned_bandwidth=args.pinned_bandwidth,
        step_seconds=args.step_seconds,
        activations=args.activations,
        **bandwidths(args),
    )
    check_request(**request)  # bad numbers are reported before a missing --model
    parse_host(args.ram, args.disk_bandwidth)
    request.update(ram=args.ram, disk_bandwidth=args.disk_bandwidth)
    if not args.model:
        raise PlanError("plan needs --model (one of: " + ", ".join(shipped_models()) + ", or a spec path).", "--model")
    result = plan(args.model, dtypes=args.dtype or (), components=args.component or (), **request)
    if args.json:
        output.emit_json(result)
    else:
        output.write(render(result, output.width()))
    return 0


def _list(args) -> int:
    from ..models.specs import load_spec, shipped_models

    models = {}
    for name in shipped_models():
        spec = load_spec(name)
        models[name] = {"title": spec.get("title"), "pipeline": spec.get("pipeline"), "repo": spec.get("repo")}
    if args.json:
        output.emit_json({"models": models})
    else:
        columns = output.width()
        rows = [[n, e["title"] or "", e["pipeline"] or ""] for n, e in models.items()]
        output.write(output.table(["model", "title", "pipeline"], rows, columns, [False] * 3))
    return 0


def render(result: dict, columns: int) -> List[str]:
    """The plan as text lines that fit in `columns`."""
    title = result["title"] or result["model"]
    preview = "a preview decoded every step" if result["preview"] else "no preview"
    lines = output.wrap(
        f"{title} ({result['pipeline']}): {result['steps']} steps x {result['generations']} generations, {preview}. "
        f"Card {output.gib(result['vram_bytes'])} GiB, {output.gib(result['reserve_bytes'])} GiB kept free for "
        f"activations. {ABOUT_SIZES}",
        columns,
    )
    lines += output.wrap(
        f"Activations {result['activations']['note']}.",
        columns,
    )
    lines += output.heading("Components (exact sizes from the shipped model data; no weights read):", columns)
    rows = [
        [name, c["class"], c["dtype"], f"{c['parameters']:,}", output.gib(c["nbytes"])]
        for name, c in result["components"].items()
    ]
    headers = ["component", "class", "dtype", "parameters", "GiB"]
    lines += output.table(headers, rows, columns, [False, False, False, True, True])
    lines += output.heading("Predicted transfers, GiB over the bus (legend below):", columns)
    lines += _strategy_table(result, columns)
    lines += [""] + _legend(result, columns) + [""] + _blocks(result, columns) + _verdict(result, columns)
    return lines + [""] + output.wrap(host_line(result["host"], output.gib), columns)


def _strategy_table(result: dict, columns: int) -> List[str]:
    headers = ["strategy", "setup", "first", "later", "mean", "s/gen*", "peak", "fits"]
    rows = []
    for entry in result["strategies"].values():
        if not entry["available"]:
            rows.append([entry["label"], "-", "-", "-", "-", "-", "-", "n/a"])
            continue
        fits = "yes" if entry["fits_with_reserve"] else "tight" if entry["fits_without_reserve"] else "no"
        rows.append(
            [
                entry["label"],
                output.gib(entry["setup_bytes"]),
                output.gib(entry["first_generation_bytes_excluding_setup"]),
                output.gib(entry["later_generation_bytes_mean"]),
                output.gib(entry["mean_bytes_per_generation_including_setup"]),
                f"{entry['seconds_at_assumed_bandwidth']['mean_per_generation_including_setup']:,.2f}",
                output.gib(entry["peak_bytes"]),
                fits,
            ]
        )
    return output.table(headers, rows, columns, [False] + [True] * 6 + [False])


def _legend(result: dict, columns: int) -> List[str]:
    label = max(len(e["label"]) for e in result["strategies"].values())
    lines = []
    for entry in result["strategies"].values():
        first = f"{entry['label'].ljust(label)}  "
        if entry["call"]:
            lines += output.wrap_call(entry["call"], columns, first, output.hanging(columns, label + 6))
        else:
            lines += output.wrap(entry["reason"], columns, " " * (label + 2), first)
    bandwidth = result["bandwidth"]
    h2d, d2h = format_rate(bandwidth["h2d_bytes_per_s"]), format_rate(bandwidth["d2h_bytes_per_s"])
    texts = [
        "setup: moved once when offload is enabled. first: the first generation, setup excluded. later: the mean of "
        "each later generation. mean: the setup and every generation, divided by the generations.",
        f"* s/gen: the mean in seconds, priced at ASSUMED bandwidths of {h2d} host-to-device and {d2h} "
        "device-to-host (not measured; set --h2d-bandwidth and --d2h-bandwidth: `diffusers-offload doctor` measures "
        "them on a CUDA machine).",
        "peak: most weights on the device at once. fits: yes = peak + reserve <= card; tight = peak <= card; "
        "no = peak > card.",
        f"Call trace: {len(result['call_trace'])} component uses per generation, {result['trace_source']}.",
    ]
    replay = next((e["replay"] for e in result["strategies"].values() if e["available"]), None)
    if replay and replay["extrapolated"]:
        texts.append(
            f"Generations after the first {replay['replayed_generations']} are extrapolated from the period of the "
            "replayed ones (see --help)."
        )
    for text in texts:
        lines += output.wrap(text, columns, "  ")
    return lines


def _blocks(result: dict, columns: int) -> List[str]:
    """Block residency: nothing when every offloaded component fits the budget together; else how the components
    larger than it stream, the static block optimum, and bytes and seconds beside sequential, group and stock."""
    entry = result.get("block_residency") or {}
    if not entry.get("needed"):
        return []
    lines = output.heading(
        f"Block residency: the components do not fit the budget's {output.gib(max(entry['room_bytes'], 0))} GiB "
        "together (block sizes from builds on the meta device; GiB per generation below):",
        columns,
    )
    for name, stream in entry["streaming"].items():
        lines += output.wrap(_streaming_text(name, stream), columns, "  ", "- ")
    lines += output.wrap(_optimum_text(entry["optimum"]), columns, "  ", "- ")
    headers = ["strategy", "first", "steady", "s first*", "s steady*", "fits"]
    rows = []
    for row in entry["rows"].values():
        steady = row["steady_generation_bytes"]
        fits = {True: "yes", False: "no", None: "-"}[row.get("fits")]
        rows.append(
            [
                row["label"],
                output.gib(row["first_generation_bytes"]),
                "-" if steady is None else output.gib(steady),
                f"{row['seconds_first']:,.2f}",
                "-" if row["seconds_steady"] is None else f"{row['seconds_steady']:,.2f}",
                fits,
            ]
        )
    lines += output.table(headers, rows, columns, [False] + [True] * 4 + [False])
    assumptions = entry["assumptions"]
    rates = {k: format_rate(assumptions[f"{k}_bytes_per_s"]) for k in ("pinned", "pageable", "d2h")}
    for text in (
        "GiB per generation (one call, one image): first, and steady once the calls repeat. fits: the weights' "
        "peak within the budget (stock: within the card); sequential and group offload hold about one block.",
        f"* ASSUMED bandwidths, not measured: page-locked {rates['pinned']} (--pinned-bandwidth), pageable "
        f"{rates['pageable']} host-to-device and {rates['d2h']} back: {assumptions['bandwidth']}.",
        f"* {assumptions['overlap'][0].upper()}{assumptions['overlap'][1:]}.",
    ):
        lines += output.wrap(text, columns, "  ")
    return lines + [""]


def _streaming_text(name: str, stream: dict) -> str:
    if not stream["available"]:
        return stream["reason"] + "."
    blocks = stream["blocks"]
    total = len(blocks["resident"]) + len(blocks["streamed"])
    return (
        f"{name} ({output.gib(stream['component_bytes'])} GiB) does not fit and streams (budget row): "
        f"{len(blocks['resident'])} of {total} blocks stay on the device while it runs "
        f"({output.gib(stream['kept_bytes'])} GiB), the others pass through a ring of {stream['slots']} buffers "
        f"({output.gib(stream['ring_bytes'])} GiB): {output.gib(stream['streamed_bytes_per_forward'])} GiB per "
        f"forward, {stream['forwards_per_generation']} forward(s) per generation; "
        f"{output.gib(stream['device_bytes'])} GiB on the device. "
        + (
            "Its kept blocks stay on the device between generations (only the others cross)."
            if stream.get("kept_between_generations")
            else "Its kept blocks are copied again at every generation (the other components need their room)."
        )
    )


def _optimum_text(optimum: dict) -> str:
    if not optimum["available"]:
        return f"Static block optimum: {optimum['reason']}."
    kept = ", ".join(f"{n} {len(b['kept'])}/{b['of']}" for n, b in optimum["blocks"].items())
    return (
        "Static block optimum (modelled; the runtime does not do this): the blocks used most per generation kept "
        f"for good across calls ({kept}: {output.gib(optimum['kept_bytes'])} GiB), one ring "
        f"({output.gib(optimum['ring_bytes'])} GiB) for the others, streamed at each use: "
        f"{output.gib(optimum['streamed_bytes_per_generation'])} GiB per generation. A static choice, not a bound: "
        "where components run one after another, the runtime's loads per call can move less."
    )


def _verdict(result: dict, columns: int) -> List[str]:
    lines = []
    for note in result["notes"]:
        lines += output.wrap(f"Note: {note}", columns, "  ")
    recommended = result["recommended"]
    if recommended is None:
        return lines
    lines += output.wrap_call(recommended["call"], columns, f"Recommended ({recommended['label']}): ", "  ")
    if not recommended["with_reserve"]:
        reserve = output.gib(result["reserve_bytes"])
        lines += output.wrap(
            f"(its peak fits only without the {reserve} GiB kept free for activations: expect it to be tight)",
            columns,
            "  ",
            "  ",
        )
    return lines
