"""`diffusers-offload plan`: the offload call to use for a real model on a card, on one screen (whether it fits, bytes
and seconds per image, the runner-up), from the shipped model data (no weights, no pipeline run, no transformers
needed); `--details` adds every strategy's and block residency's tables."""

from __future__ import annotations

from typing import List

from ..constants import GiB
from ..models.bounds import MAX_GENERATIONS, MAX_STEPS, REPLAYED_GENERATIONS, format_rate
from ..models.host import DEFAULT_DISK_BANDWIDTH
from ..models.profiles import DEFAULT_PROFILE
from ..models.request import DEFAULT_RESERVE, DEFAULT_VRAM
from ..units import format_size
from . import output, plan_details, plan_host

HELP = "the offload call to use for a model on a card: whether it fits, bytes and seconds per image"
ABOUT_SIZES = "Sizes in GiB (2^30 bytes)."


def add_parser(commands, common) -> None:
    p = commands.add_parser("plan", parents=[common], help=HELP, description=HELP + ".")
    p.add_argument(
        "--model",
        help="a shipped model by name or Hugging Face Hub id, any case (flux-dev, black-forest-labs/FLUX.1-dev; "
        "see --list), or the path of a model spec JSON",
    )
    p.add_argument("--list", action="store_true", help="list the shipped models and their Hub ids")
    p.add_argument(
        "--vram",
        default=DEFAULT_VRAM,
        help=f"the card's memory, e.g. 24GiB (default: {DEFAULT_VRAM}); 24GB is read as 24 GiB, as cards are sold",
    )
    p.add_argument("--details", action="store_true", help="also print every strategy's and block residency's tables")
    p.add_argument("--height", help="the call's height in pixels (default: the model's), which sizes the activations")
    p.add_argument("--width", help="the call's width in pixels (default: the model's)")
    p.add_argument("--frames", help="frames of a video call (default: the model's, e.g. 81 for Wan)")
    p.add_argument(
        "--reserve",
        help="memory kept free for activations when checking what fits (default: the activations ESTIMATED for the "
        f"call's size with the runtime's margin, or {DEFAULT_RESERVE} for a model without activation data)",
    )
    p.add_argument(
        "--activations",
        help="the activations of the call when known (e.g. 6GiB: `doe.offload_status(pipe).learnt` reports them "
        "after a call on the card): the reserve is then them and a margin, as the runtime learns it",
    )
    p.add_argument("--steps", help=f"denoising steps per generation, 1 to {MAX_STEPS:,} (default: the model's)")
    p.add_argument(
        "--generations",
        default="10",
        help=f"pipeline calls in a row, 1 to {MAX_GENERATIONS:,} (default: 10); the first {REPLAYED_GENERATIONS} are "
        "replayed move by move, later ones extrapolated from the period their bytes settle into",
    )
    p.add_argument("--preview", action="store_true", help="a step callback decodes a preview with the VAE every step")
    p.add_argument(
        "--profile",
        help="the measured copy rates that price the bytes in seconds: a shipped profile (h200: the H200 runs of "
        "docs/gpu-runs) or the file `diffusers-offload doctor --measure` wrote on your machine "
        f"(default: {DEFAULT_PROFILE})",
    )
    add_bandwidth_arguments(p, "the bytes")
    p.add_argument(
        "--pinned-bandwidth",
        help="host-to-device bandwidth from page-locked memory (the defaults on CUDA, block residency's and group "
        "offload's copies), given instead of the profile's",
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
        "without offload / steps): seconds per image then add the denoiser's compute, streamed copies hidden behind "
        "it with prefetch (default: none, the copies alone)",
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
    p.add_argument(
        "--optimum",
        action="store_true",
        help="also compute the block optimum, the least bytes of any block schedule (seconds of numpy), and the "
        "budget row's ratio to it",
    )
    p.set_defaults(handler=run)


def add_bandwidth_arguments(parser, what: str) -> None:
    """`--bandwidth` and the two `--h2d-bandwidth` / `--d2h-bandwidth` it stands for (given instead of measured)."""
    parser.add_argument(
        "--bandwidth", help="shorthand for both --h2d-bandwidth and --d2h-bandwidth, given instead of measured rates"
    )
    for direction, words in (("h2d", "host-to-device, pageable"), ("d2h", "device-to-host, into new host memory")):
        parser.add_argument(
            f"--{direction}-bandwidth",
            help=f"{words} bandwidth that prices {what} in seconds, e.g. 12GB/s, 25GiB/s, given instead of the rate "
            "profile's (then an assumption)",
        )


def bandwidths(args) -> dict:
    """The two bandwidth texts of `args` (`--bandwidth` fills the ones not given; `None`: the profile's)."""
    both = args.bandwidth
    return {"h2d_bandwidth": args.h2d_bandwidth or both, "d2h_bandwidth": args.d2h_bandwidth or both}


def run(args) -> int:
    from ..models import plan, shipped_models
    from ..models.errors import PlanError
    from ..models.host import parse_host
    from ..models.request import check_request

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
        height=args.height,
        width=args.width,
        frames=args.frames,
        profile=getattr(args, "profile", None),
        **bandwidths(args),
    )
    check_request(**request)  # bad numbers are reported before a missing --model
    parse_host(args.ram, args.disk_bandwidth)
    request.update(ram=args.ram, disk_bandwidth=args.disk_bandwidth)
    if not args.model:
        raise PlanError("plan needs --model (one of: " + ", ".join(shipped_models()) + ", or a spec path).", "--model")
    result = plan(
        args.model, dtypes=args.dtype or (), components=args.component or (), optimum=args.optimum, **request
    )
    if args.json:
        output.emit_json(result)
    else:
        output.write(render(result, output.width(), details=args.details))
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
        rows = [[n, e["repo"] or "", e["title"] or ""] for n, e in models.items()]
        output.write(output.table(["model", "Hub id", "title"], rows, columns, [False] * 3))
    return 0


def render(result: dict, columns: int, details: bool = False) -> List[str]:
    """The plan as text lines that fit in `columns`: the one screen (about 20 lines at 80 columns), after the tables
    with `details`."""
    lines = _header(result, columns)
    if details:
        lines += plan_details.render(result, columns) + [""] + plan_host.details(result["host"], columns) + [""]
    summary = result["summary"]
    if summary["use"] is None:
        lines += [""] + output.wrap("Nothing fits: " + summary["nothing_fits"], columns, "  ")
    else:
        lines += [""] + _choice("Use", summary["use"], result, columns)
    if summary["runner_up"] is not None:
        lines += [""] + _choice("Runner-up", summary["runner_up"], result, columns)
    lines += [""] + plan_host.short(result["host"], columns)
    return lines + _block_optimum(result, columns) + [""] + _footer(result, columns, details)


def _block_optimum(result: dict, columns: int) -> List[str]:
    """`--optimum`: the least bytes of any block schedule, and the budget row's ratio to it."""
    rows = (result.get("block_residency") or {}).get("rows") or {}
    best, budget = rows.get("block_optimum"), rows.get("budget")
    if best is None or budget is None or "to_block_optimum" not in budget:
        return []
    text = (
        f"Block optimum (the least bytes of any block schedule, the whole call known in advance): "
        f"{format_size(best['steady_generation_bytes'])} per later {_unit(result)}; the memory_budget row moves "
        f"{budget['to_block_optimum']:.2f}x that"
        + (
            " (below 1: it keeps sets of blocks other than the optimum's, each component's largest first)."
            if budget["to_block_optimum"] < 1
            else "."
        )
    )
    return [""] + output.wrap(text, columns, "  ")


def _header(result: dict, columns: int) -> List[str]:
    title = result["title"] or result["model"]
    shape = result["call_shape"]
    size = f"{shape['width']}x{shape['height']}, " if shape["width"] else ""
    size += f"{shape['frames']} frames, " if shape["frames"] else ""
    preview = ", a preview decoded every step" if result["preview"] else ""
    lines = output.wrap(
        f"{title} ({result['pipeline']}) on a {card(result['vram_bytes'])} GiB card: {size}{result['steps']} steps, "
        f"{result['generations']} {_unit(result)}s in a row{preview}.",
        columns,
    )
    activations = result["activations"]
    if activations["source"] == "estimated":
        estimate = activations["estimate"]
        part = "the VAE decode" if estimate["largest"] == "vae" else f"the {estimate['largest']}"
        text = (
            f"Activations ESTIMATED at {output.gib(estimate['bytes'])} GiB ({part}; from the shipped activation "
            f"data); {output.gib(result['reserve_bytes'])} GiB kept free for them."
        )
        if estimate["largest"] == "vae" and estimate["bytes"] > 4 * GiB:
            text += " The VAE's tiling (pipe.vae.enable_tiling()) lowers them: then give --activations."
    else:
        text = f"Activations {activations['note']}."
    lines += output.wrap(text, columns)
    if result.get("vram_note"):
        lines += output.wrap(f"Note: {result['vram_note']}.", columns)
    return lines


def card(nbytes: int) -> str:
    """A card's size in GiB as people say it: `"16"`, `"7.45"`."""
    return f"{round(nbytes / GiB, 2):g}"


def _unit(result: dict) -> str:
    return "video" if result["call_shape"].get("frames") else "image"


def _choice(heading: str, choice: dict, result: dict, columns: int) -> List[str]:
    if not choice["available"]:
        return output.wrap(f"{heading}: {choice['label']}, not available: {choice['reason']}.", columns, "  ")
    size, reserve = card(result["vram_bytes"]), output.gib(result["reserve_bytes"])
    peak = output.gib(choice["peak_bytes"])
    verdict = {
        "yes": f"fits: {peak} GiB of weights at most + {reserve} GiB kept free <= {size} GiB",
        "tight": f"tight: {peak} GiB of weights fit {size} GiB, not with the {reserve} GiB kept free",
        "no": f"does not fit: {peak} GiB of weights at once > {size} GiB",
    }[choice["fits"]]
    lines = output.wrap(f"{heading} ({choice['label']}; {verdict}):", columns, "  ")
    lines += output.wrap_call(choice["call"], columns, "  ", "      ")
    for name, stream in (choice.get("streams") or {}).items():
        lines += output.wrap(
            f"{name} ({output.gib(stream['component_bytes'])} GiB) streams its blocks: {stream['kept']} of "
            f"{stream['blocks']} stay on the card, the others pass through a ring of buffers.",
            columns,
            "  ",
            "  ",
        )
    text = (
        f"Per {_unit(result)}: {output.gib(choice['bytes_per_image'])} GiB over the bus, "
        f"{choice['seconds_per_image']:,.2f} s"
    )
    pageable = choice.get("pageable")
    if pageable:
        text += f" as it runs on CUDA by default; {pageable['seconds_per_image']:,.2f} s with {pageable['options']}"
    if choice.get("reason") and heading != "Use":
        text += f". Not recommended: {choice['reason']}"
    return lines + output.wrap(text + ".", columns, "  ", "  ")


def _footer(result: dict, columns: int, details: bool) -> List[str]:
    bandwidth = result["bandwidth"]
    rates = [format_rate(bandwidth[k]) for k in ("h2d_bytes_per_s", "d2h_bytes_per_s", "pinned_h2d_bytes_per_s")]
    seconds = result["summary"]["seconds"]
    source = (
        f"given: {', '.join(bandwidth['given'])}; the others"
        if bandwidth.get("given")
        else ("measured" if not bandwidth.get("assumed") else "assumed")
    )
    lines = output.wrap(
        f"{seconds[0].upper()}{seconds[1:]}: {rates[0]} host-to-device and {rates[1]} back from pageable memory, "
        f"{rates[2]} page-locked ({source}: rate profile {bandwidth['profile']}, "
        f"{str(bandwidth['profile_device']).split(',')[0]}; `doctor --measure` measures yours, --profile reads it).",
        columns,
        "  ",
    )
    more = "--json: everything." if details else "--details: every strategy and block residency; --json: everything."
    return lines + output.wrap(f"{ABOUT_SIZES} {more}", columns, "  ")
