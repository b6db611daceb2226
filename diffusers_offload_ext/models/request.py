"""A plan request: every number of `diffusers-offload plan` parsed and bounded before any work, then completed from
the model (its call's default steps and size, the activations estimated for that size) into what the planner uses."""

from __future__ import annotations

from typing import NamedTuple, Optional

from ..residency.reserve import reserve_for
from ..units import format_size
from .activations import MAX_FRAMES, MAX_SIDE, call_defaults, estimate
from .bounds import MAX_GENERATIONS, MAX_STEPS, parse_bytes, parse_card, parse_count, parse_rate, parse_seconds
from .errors import PlanError

DEFAULT_VRAM = "24GiB"
#: Left free for activations when the model has no activation data and none is given (the runtime's `memory_reserve`).
DEFAULT_RESERVE = "3GiB"
#: Assumed, not measured: pageable host memory over PCIe 4.0 x16 (diffusers' offload copies from pageable memory).
DEFAULT_BANDWIDTH = "12GB/s"
#: Assumed, not measured: page-locked host memory over PCIe 4.0 x16 (what `pin_memory=True` and group offloading with
#: `use_stream=True` copy from; `diffusers-offload doctor` measures it on a CUDA machine).
DEFAULT_PINNED_BANDWIDTH = "24GB/s"


class Request(NamedTuple):
    """A plan request, checked and bounded. `steps`, `height`, `width`, `frames` and `reserve` are `None` until
    `complete` fills them from the model; `reserve_source` says where the reserve comes from: `"given"`
    (`--reserve`), `"activations"` (`--activations` and the runtime's margin), `"estimated"` (the model's activation
    data for the call's size, and that margin) or `"default"` (`DEFAULT_RESERVE`)."""

    vram: int
    reserve: Optional[int]
    steps: Optional[int]
    generations: int
    preview: bool
    h2d_rate: int
    d2h_rate: int
    pinned_rate: int
    step_seconds: Optional[float]
    activations: Optional[int] = None
    first_reserve: Optional[int] = None
    height: Optional[int] = None
    width: Optional[int] = None
    frames: Optional[int] = None
    vram_note: Optional[str] = None
    reserve_source: str = "given"
    estimate: Optional[dict] = None


def check_request(
    *,
    vram=DEFAULT_VRAM,
    reserve=None,
    steps=None,
    generations=10,
    preview=False,
    h2d_bandwidth=DEFAULT_BANDWIDTH,
    d2h_bandwidth=DEFAULT_BANDWIDTH,
    pinned_bandwidth=DEFAULT_PINNED_BANDWIDTH,
    step_seconds=None,
    activations=None,
    height=None,
    width=None,
    frames=None,
) -> Request:
    """Every argument parsed and bounded, before any work (`PlanError` names the first bad one). `None` leaves a
    value to the model (`complete`)."""
    vram_bytes, note = parse_card(vram, argument="--vram")
    given = None if reserve is None else parse_bytes(reserve, argument="--reserve", allow_zero=True)
    known = None if activations is None else parse_bytes(activations, argument="--activations")
    request = Request(
        vram=vram_bytes,
        reserve=given,
        steps=None if steps is None else parse_count(steps, argument="--steps", maximum=MAX_STEPS),
        generations=parse_count(generations, argument="--generations", maximum=MAX_GENERATIONS),
        preview=bool(preview),
        h2d_rate=parse_rate(h2d_bandwidth, argument="--h2d-bandwidth"),
        d2h_rate=parse_rate(d2h_bandwidth, argument="--d2h-bandwidth"),
        pinned_rate=parse_rate(pinned_bandwidth, argument="--pinned-bandwidth"),
        step_seconds=parse_seconds(step_seconds, argument="--step-seconds"),
        activations=known,
        first_reserve=given,
        height=None if height is None else parse_count(height, argument="--height", maximum=MAX_SIDE),
        width=None if width is None else parse_count(width, argument="--width", maximum=MAX_SIDE),
        frames=None if frames is None else parse_count(frames, argument="--frames", maximum=MAX_FRAMES),
        vram_note=note,
    )
    if known is not None:
        request = request._replace(reserve=reserve_for(known), reserve_source="activations")
    if request.reserve is not None:
        _check_room(request)
    return request


def complete(request: Request, spec: dict) -> Request:
    """`request` with what it left open taken from the model `spec`: the steps, height, width and frames of its
    call's defaults, and the reserve estimated for that size (`activations.estimate`, with the runtime's margin;
    `DEFAULT_RESERVE` for a model without activation data)."""
    defaults = call_defaults(spec)
    video = defaults["frames"] is not None
    if request.frames is not None and not video:
        raise PlanError(f"--frames is for video models; {spec.get('title') or spec['name']} makes images.", "--frames")
    filled = request._replace(
        steps=request.steps or defaults["steps"],
        height=request.height or defaults["height"],
        width=request.width or defaults["width"],
        frames=request.frames or defaults["frames"],
    )
    estimated = None
    if spec.get("shipped") and filled.height and filled.width:
        estimated = estimate(spec["name"], filled.height, filled.width, filled.frames or 1)
    filled = filled._replace(estimate=estimated)
    if filled.reserve is not None:
        return filled
    if estimated is None:
        filled = filled._replace(reserve=parse_bytes(DEFAULT_RESERVE, argument="--reserve"), reserve_source="default")
    else:
        filled = filled._replace(reserve=reserve_for(estimated["bytes"]), reserve_source="estimated")
    _check_room(filled)
    return filled


def _check_room(request: Request) -> None:
    """A reserve that leaves nothing of the card for weights is an error: nothing fits."""
    if request.reserve < request.vram:
        return
    vram = format_size(request.vram)
    if request.reserve_source == "estimated":
        raise PlanError(
            f"The activations estimated for a {size_text(request)} call ({format_size(request.estimate['bytes'])} in "
            f"the {request.estimate['largest']}, {format_size(request.reserve)} with the runtime's margin) leave "
            f"nothing of the card's --vram {vram} for weights: nothing fits. Plan a smaller call (--height, "
            "--width, --frames), or decode with `pipe.vae.enable_tiling()` and give its measured --activations.",
            "--vram",
        )
    argument = "--activations" if request.reserve_source == "activations" else "--reserve"
    margin = " with its margin" if request.reserve_source == "activations" else ""
    raise PlanError(
        f"{argument} {format_size(request.reserve)}{margin} leaves nothing of the card's --vram {vram} for weights: "
        f"nothing fits. Lower {argument} (activations of a 1024x1024 image take a few GiB) or give the card's real "
        "memory with --vram.",
        argument,
    )


def size_text(request: Request) -> str:
    """`"1024x1024"` or `"832x480, 81 frames"` (width x height, as people say them)."""
    text = f"{request.width}x{request.height}"
    return f"{text}, {request.frames} frames" if request.frames else text


def activation_assumption(request: Request) -> dict:
    """What the plan assumes of the activations, in bytes and in words."""
    reserve = format_size(request.reserve)
    source = request.reserve_source
    if source == "activations":
        note = (
            f"given: {format_size(request.activations)} of activations (--activations), and a margin: {reserve} kept "
            "free, as the runtime leaves once it has seen a call of this shape"
        )
    elif source == "estimated":
        parts = ", ".join(f"{name} {format_size(n)}" for name, n in request.estimate["parts"].items())
        note = (
            f"ESTIMATED for {size_text(request)} from the shipped activation data ({parts}; "
            f"models/activations.py says how), and a margin: {reserve} kept free. Give --activations once measured "
            "(`doe.offload_status(pipe).learnt`)"
        )
    elif source == "default":
        note = f"assumed: {reserve} kept free (no activation data for this model; give --activations when known)"
    else:
        note = f"given: {reserve} kept free (--reserve)"
    return {
        "source": source,
        "given": source == "activations",
        "bytes": request.activations if source == "activations" else (request.estimate or {}).get("bytes"),
        "estimate": request.estimate,
        "reserve_bytes": request.reserve,
        "note": note,
    }
