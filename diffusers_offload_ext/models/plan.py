"""The planner behind `diffusers-offload plan`: each strategy's policy replayed over the model's call trace with
its real component sizes, what that means per generation and for the card, and the call to recommend."""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence, Union

from ..residency.reserve import reserve_for
from ..units import format_size
from .block_compare import block_residency
from .block_model import BlockPlans
from .bounds import MAX_GENERATIONS, MAX_STEPS, parse_bytes, parse_count, parse_rate, parse_seconds
from .errors import PlanError
from .generations import Generations, replay_generations
from .host import host_entry, parse_host
from .model import Model, load_model
from .strategies import STRATEGIES, Strategy, all_strategies, largest_offloaded

DEFAULT_VRAM = "24GiB"
#: Left free for activations when checking what fits (the residency manager's default `memory_reserve`).
DEFAULT_RESERVE = "3GiB"
#: Assumed, not measured: pageable host memory over PCIe 4.0 x16 (diffusers' offload copies from pageable memory).
DEFAULT_BANDWIDTH = "12GB/s"
#: Assumed, not measured: page-locked host memory over PCIe 4.0 x16 (what `pin_memory=True` and group offloading with
#: `use_stream=True` copy from; `diffusers-offload doctor` measures it on a CUDA machine).
DEFAULT_PINNED_BANDWIDTH = "24GB/s"
BANDWIDTH_NOTE = (
    "assumed or given, never measured by the planner (defaults: pageable host memory over PCIe 4.0 x16, about 12 GB/s "
    "each way, and page-locked about 24 GB/s host-to-device); strategy seconds = bytes host-to-device / h2d bandwidth "
    "+ bytes device-to-host / d2h bandwidth; block_residency prices page-locked copies at the pinned bandwidth"
)


class Request(NamedTuple):
    """A plan request, checked and bounded."""

    vram: int
    reserve: int
    steps: int
    generations: int
    preview: bool
    h2d_rate: int
    d2h_rate: int
    pinned_rate: int
    step_seconds: Optional[float]
    activations: Optional[int] = None
    first_reserve: Optional[int] = None


def check_request(
    *,
    vram,
    reserve,
    steps,
    generations,
    preview,
    h2d_bandwidth,
    d2h_bandwidth,
    pinned_bandwidth=DEFAULT_PINNED_BANDWIDTH,
    step_seconds=None,
    activations=None,
) -> Request:
    """Every argument parsed and bounded, before any work (`PlanError` names the first bad one; a reserve that leaves
    nothing of the card for weights is one). With `activations` (a known size), the reserve is what the runtime
    leaves for them once it has seen a call of that shape (`policies.reserve.reserve_for`: them and a margin)."""
    vram_bytes = parse_bytes(vram, argument="--vram")
    reserve_bytes = first = parse_bytes(reserve, argument="--reserve", allow_zero=True)
    known = None if activations is None else parse_bytes(activations, argument="--activations")
    if known is not None:
        reserve_bytes = reserve_for(known)
    argument = "--reserve" if known is None else "--activations"
    if reserve_bytes >= vram_bytes:
        raise PlanError(
            f"{argument} {format_size(reserve_bytes)}{' with its margin' if known else ''} leaves nothing of the "
            f"card's --vram {format_size(vram_bytes)} for weights: nothing fits. Lower {argument} (activations of a "
            "1024x1024 image take a few GiB) or give the card's real memory with --vram.",
            argument,
        )
    return Request(
        vram=vram_bytes,
        reserve=reserve_bytes,
        steps=parse_count(steps, argument="--steps", maximum=MAX_STEPS),
        generations=parse_count(generations, argument="--generations", maximum=MAX_GENERATIONS),
        preview=bool(preview),
        h2d_rate=parse_rate(h2d_bandwidth, argument="--h2d-bandwidth"),
        d2h_rate=parse_rate(d2h_bandwidth, argument="--d2h-bandwidth"),
        pinned_rate=parse_rate(pinned_bandwidth, argument="--pinned-bandwidth"),
        step_seconds=parse_seconds(step_seconds, argument="--step-seconds"),
        activations=known,
        first_reserve=first,
    )


def plan(
    model: str,
    *,
    vram: Union[str, int] = DEFAULT_VRAM,
    reserve: Union[str, int] = DEFAULT_RESERVE,
    steps: Union[int, str] = 28,
    generations: Union[int, str] = 10,
    preview: bool = False,
    h2d_bandwidth: Union[str, int] = DEFAULT_BANDWIDTH,
    d2h_bandwidth: Union[str, int] = DEFAULT_BANDWIDTH,
    pinned_bandwidth: Union[str, int] = DEFAULT_PINNED_BANDWIDTH,
    step_seconds: Optional[Union[float, str]] = None,
    dtypes: Sequence[str] = (),
    components: Sequence[str] = (),
    activations: Optional[Union[str, int]] = None,
    ram: Optional[Union[str, int]] = None,
    disk_bandwidth: Optional[Union[str, int]] = None,
) -> dict:
    """Predicted transfers of each offload strategy for `model` on a card, and the call to use.

    Args:
        model (`str`): A shipped model name (`diffusers-offload plan --list`) or a spec path.
        vram (`str` or `int`, defaults to `"24GiB"`): The card's memory.
        reserve (`str` or `int`, defaults to `"3GiB"`): Memory left for activations when checking what fits: the
            runtime's `memory_reserve`, what its automatic budget leaves for a call shape it has not seen.
        steps (`int`, defaults to 28): Denoising steps per generation (1 to `MAX_STEPS`).
        generations (`int`, defaults to 10): Pipeline calls in a row (1 to `MAX_GENERATIONS`); the first
            `REPLAYED_GENERATIONS` are replayed move by move, the rest extrapolated from their period.
        preview (`bool`, defaults to `False`): A step callback decodes a preview with the VAE every step.
        h2d_bandwidth, d2h_bandwidth (`str` or `int`, defaults to `"12GB/s"`): ASSUMED bandwidths that price the
            bytes in seconds, host-to-device and device-to-host (pageable host memory).
        pinned_bandwidth (`str` or `int`, defaults to `"24GB/s"`): ASSUMED host-to-device bandwidth from page-locked
            memory, for the copies of block residency and group offloading in `block_residency`.
        step_seconds (`float` or `str`, *optional*): Seconds of one denoiser forward on the card without offload;
            with it `block_residency` models seconds per image, streamed copies hidden behind compute up to it.
        dtypes (`Sequence[str]`, *optional*): `COMPONENT=DTYPE` overrides (`denoiser=fp8` for every denoiser).
        components (`Sequence[str]`, *optional*): `NAME=CONFIG.json` / `NAME=CLASS:CONFIG.json` replacements.
        activations (`str` or `int`, *optional*): The activations of the call, when known (measured: the runtime
            reports them in `doe.offload_status(pipe).learnt`): the reserve is then them and a margin, as the runtime
            leaves once it has seen a call of that shape, instead of `reserve`.
        ram, disk_bandwidth (`str` or `int`, *optional*): The host's memory (default: this machine's) and the disk's
            read rate (default: ASSUMED `models.host.DEFAULT_DISK_BANDWIDTH`) for the `host` entry.

    Returns:
        `dict`: JSON-ready, sizes in bytes: the model, card and request, `bandwidth` (assumed rates), `components`
        (class, dtype, parameters, bytes), `layout`, `chain`, one generation's `call_trace`, and per strategy in
        `strategies` the call, `setup_bytes` (once, at enable) and fields whose names say whether they include it,
        seconds at the assumed bandwidths, `peak_bytes` and whether it fits; then `recommended` (or `None`) and
        `notes` saying why a strategy is not recommended; `block_residency` (`models.block_compare`): when the
        offloaded components do not fit the budget together, how those larger than it stream, the modelled block
        optimum across components, and bytes and seconds per generation beside sequential, group and stock offload.
        The residency manager's row streams as the runtime does (`models.block_model.replay_streaming`).
        `host` (`models.host.host_plan`): whether the weights fit the RAM, which stay in their files, disk reads.

    Raises:
        `PlanError`: bad input. `MissingPackage`: a component to build on meta needs a missing package.
    """
    request = check_request(
        vram=vram,
        reserve=reserve,
        steps=steps,
        generations=generations,
        preview=preview,
        h2d_bandwidth=h2d_bandwidth,
        d2h_bandwidth=d2h_bandwidth,
        pinned_bandwidth=pinned_bandwidth,
        step_seconds=step_seconds,
        activations=activations,
    )
    host = parse_host(ram, disk_bandwidth)
    loaded = load_model(model, dtypes, components)
    call = loaded.call_trace(request.steps, request.preview)
    plans = BlockPlans(model, {n: c["dtype"] for n, c in loaded.components.items()}, components)
    entries, moved = {}, {}
    strategies = all_strategies(loaded.layout, loaded.sizes, loaded.denoisers, request.vram - request.reserve)
    for name, strategy in strategies.items():
        moved[name] = replay_generations(
            strategy.policy,
            call,
            loaded.sizes,
            request.generations,
            zero_copy=strategy.zero_copy,
            plans=plans if name == "residency" else None,
        )
        entries[name] = strategy_entry(strategy, moved[name], request)
    notes = _unavailable(entries, loaded, request)
    recommended = recommend(entries, loaded, request, notes)
    result = _result(loaded, request, call, entries, recommended, notes)
    budget = strategies["residency"].budget if "residency" in strategies else None
    result["block_residency"] = block_residency(loaded, request, call, plans, moved, budget)
    result["host"] = host_entry(result, call, host)
    return result


def strategy_entry(strategy: Strategy, moved: Generations, request: Request) -> dict:
    """One strategy's JSON entry. Field names say whether they include the setup (moves made once when offload is
    enabled): add `setup_bytes` and `first_generation_bytes_excluding_setup` for the first generation's start."""
    g = moved.generations

    def seconds(m) -> float:
        return m.h2d / request.h2d_rate + m.d2h / request.d2h_rate

    all_bytes = moved.setup.nbytes + moved.total.nbytes
    later = (moved.total.nbytes - moved.first.nbytes) / (g - 1) if g > 1 else None
    return {
        "label": strategy.label,
        "call": strategy.call,
        "available": True,
        "setup_bytes": moved.setup.nbytes,
        "first_generation_bytes_excluding_setup": moved.first.nbytes,
        "later_generation_bytes_mean": later,
        "all_generations_bytes_including_setup": all_bytes,
        "mean_bytes_per_generation_including_setup": all_bytes / g,
        "h2d_bytes_including_setup": moved.setup.h2d + moved.total.h2d,
        "d2h_bytes_including_setup": moved.setup.d2h + moved.total.d2h,
        "onloads_per_generation": moved.total.onloads / g,
        "seconds_at_assumed_bandwidth": {
            "setup": seconds(moved.setup),
            "first_generation_excluding_setup": seconds(moved.first),
            "mean_per_generation_including_setup": (seconds(moved.setup) + seconds(moved.total)) / g,
        },
        "peak_bytes": moved.peak,
        "fits_with_reserve": moved.peak + request.reserve <= request.vram,
        "fits_without_reserve": moved.peak <= request.vram,
        "replay": {"replayed_generations": moved.replayed, "extrapolated": moved.extrapolated, "period": moved.period},
        **({"budget_bytes": strategy.budget} if strategy.budget is not None else {}),
    }


def _unavailable(entries: Dict[str, dict], loaded: Model, request: Request) -> List[str]:
    """Mark the residency manager unavailable when the reserve leaves nothing, and not recommendable when its
    budget cannot hold the largest component; return why."""
    budget = request.vram - request.reserve
    if budget <= 0:
        reason = (
            f"--reserve {format_size(request.reserve)} leaves nothing of --vram {format_size(request.vram)} for "
            "weights, so there is no memory_budget to recommend"
        )
        entries["residency"] = {"label": "budget", "call": None, "available": False, "reason": reason}
        return [f"budget not evaluated: {reason}."]
    largest = largest_offloaded(loaded.layout, loaded.sizes)
    limit = entries["residency"]["budget_bytes"]
    if largest is None or entries["residency"]["peak_bytes"] <= limit:
        return []
    reason = (
        f"memory_budget {format_size(limit)} (--vram minus --reserve) cannot hold {largest} "
        f"({format_size(loaded.sizes[largest])}), and {largest} cannot stream its blocks within it (see block "
        "residency): it would run alone, over the budget"
    )
    entries["residency"].update(recommendable=False, reason=reason)
    return [f"budget not recommended: {reason}."]


def recommend(entries: Dict[str, dict], loaded: Model, request: Request, notes: List[str]) -> Optional[dict]:
    """The strategy that moves the fewest bytes among those whose peak fits with the reserve (else without it);
    `None`, with a note saying why, when none fits the card."""
    usable = [(n, e) for n, e in entries.items() if e["available"] and e.get("recommendable", True)]
    fit = [(n, e) for n, e in usable if e["fits_with_reserve"]]
    pool = fit or [(n, e) for n, e in usable if e["fits_without_reserve"]]
    if not pool:
        largest = largest_offloaded(loaded.layout, loaded.sizes)
        detail = f" ({largest} alone is {format_size(loaded.sizes[largest])})" if largest else ""
        notes.append(
            f"No strategy's peak fits in the card's {format_size(request.vram)}{detail}: use a smaller dtype "
            "(--dtype denoiser=fp8), a larger card, pipe.enable_group_offload(...) or "
            "pipe.enable_sequential_cpu_offload()."
        )
        return None
    name, entry = min(
        pool, key=lambda item: (item[1]["all_generations_bytes_including_setup"], STRATEGIES.index(item[0]))
    )
    return {"strategy": name, "label": entry["label"], "call": entry["call"], "with_reserve": bool(fit)}


def _result(loaded: Model, request: Request, call, entries, recommended, notes) -> dict:
    return {
        "model": loaded.name,
        "title": loaded.title,
        "pipeline": loaded.pipeline,
        "units": "bytes; bandwidths in bytes per second; seconds priced at the assumed bandwidths",
        "vram_bytes": request.vram,
        "reserve_bytes": request.reserve,
        "activations": activation_assumption(request),
        "steps": request.steps,
        "generations": request.generations,
        "preview": request.preview,
        "bandwidth": {
            "assumed": True,
            "h2d_bytes_per_s": request.h2d_rate,
            "d2h_bytes_per_s": request.d2h_rate,
            "pinned_h2d_bytes_per_s": request.pinned_rate,
            "note": BANDWIDTH_NOTE,
        },
        "step_seconds": request.step_seconds,
        "components": loaded.components,
        "layout": loaded.layout.to_dict(),
        "chain": list(loaded.layout.arrange().chain),
        "call_trace": call,
        "trace_source": f"generated for {request.steps} steps from {loaded.trace_source}",
        "strategies": entries,
        "recommended": recommended,
        "notes": notes,
    }


def activation_assumption(request: Request) -> dict:
    """What the plan assumes of the activations: `given` (`--activations`) or not, their bytes, the reserve kept free
    for them, and in words."""
    if request.activations is None:
        note = (
            f"assumed: {format_size(request.reserve)} kept free for activations (--reserve, what the runtime's "
            "automatic budget leaves for a call shape it has not seen yet; then it learns what the shape needs). "
            "Pass --activations when they are known"
        )
    else:
        note = (
            f"given: {format_size(request.activations)} of activations (--activations), and a margin: "
            f"{format_size(request.reserve)} kept free, as the runtime leaves once it has seen a call of this shape "
            f"(its first call of a shape leaves --reserve, {format_size(request.first_reserve)})"
        )
    return {
        "given": request.activations is not None,
        "bytes": request.activations,
        "reserve_bytes": request.reserve,
        "note": note,
    }
