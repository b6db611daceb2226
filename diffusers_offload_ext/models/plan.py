"""The planner behind `diffusers-offload plan`: each strategy's policy replayed over the model's call trace with
its real component sizes, what that means per generation and for the card, and the call to recommend."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Union

from ..units import format_size
from .block_compare import block_residency
from .block_model import BlockPlans
from .generations import Generations, Moved, replay_generations
from .host import host_entry, parse_host
from .model import Model, load_model
from .request import DEFAULT_VRAM, Request, activation_assumption, check_request, complete, rates_note
from .specs import load_spec
from .summary import summary
from .strategies import STRATEGIES, Strategy, all_strategies, largest_offloaded


def plan(
    model: str,
    *,
    vram: Union[str, int] = DEFAULT_VRAM,
    reserve: Optional[Union[str, int]] = None,
    steps: Optional[Union[int, str]] = None,
    generations: Union[int, str] = 10,
    preview: bool = False,
    h2d_bandwidth: Optional[Union[str, int]] = None,
    d2h_bandwidth: Optional[Union[str, int]] = None,
    pinned_bandwidth: Optional[Union[str, int]] = None,
    step_seconds: Optional[Union[float, str]] = None,
    dtypes: Sequence[str] = (),
    components: Sequence[str] = (),
    activations: Optional[Union[str, int]] = None,
    height: Optional[Union[int, str]] = None,
    width: Optional[Union[int, str]] = None,
    frames: Optional[Union[int, str]] = None,
    profile: Optional[str] = None,
    ram: Optional[Union[str, int]] = None,
    disk_bandwidth: Optional[Union[str, int]] = None,
    optimum: bool = False,
) -> dict:
    """Predicted transfers of each offload strategy for `model` on a card, and the call to use.

    Args:
        model (`str`): A shipped model's name or Hugging Face Hub id, in any case (`"flux-dev"`,
            `"black-forest-labs/FLUX.1-dev"`; `diffusers-offload plan --list`), or a spec path.
        vram (`str` or `int`, defaults to `"24GiB"`): The card's memory; `"24GB"` is read as 24 GiB, as cards are
            sold (the result's `vram_note` says so).
        reserve (`str` or `int`, *optional*): Memory left for activations when checking what fits. Defaults to the
            activations estimated for the call's size (`models.activations`) with the runtime's margin, or 3 GiB
            for a model without activation data.
        steps (`int`, *optional*): Denoising steps per generation (1 to `MAX_STEPS`); defaults to the model's.
        generations (`int`, defaults to 10): Pipeline calls in a row (1 to `MAX_GENERATIONS`); the first
            `REPLAYED_GENERATIONS` are replayed move by move, the rest extrapolated from their period.
        preview (`bool`, defaults to `False`): A step callback decodes a preview with the VAE every step.
        h2d_bandwidth, d2h_bandwidth (`str` or `int`, *optional*): Rates that price the bytes in seconds instead of
            the profile's: host-to-device from pageable memory, device-to-host into new host memory.
        pinned_bandwidth (`str` or `int`, *optional*): Host-to-device rate from page-locked memory (the defaults on
            CUDA, block residency's and group offloading's copies) instead of the profile's.
        step_seconds (`float` or `str`, *optional*): Seconds of one denoiser forward on the card without offload;
            with it seconds per image add the denoiser's compute, streamed copies hidden behind it up to it.
        dtypes (`Sequence[str]`, *optional*): `COMPONENT=DTYPE` overrides (`denoiser=fp8` for every denoiser).
        components (`Sequence[str]`, *optional*): `NAME=CONFIG.json` / `NAME=CLASS:CONFIG.json` replacements.
        activations (`str` or `int`, *optional*): The activations of the call, when known (measured: the runtime
            reports them in `doe.offload_status(pipe).learnt`): the reserve is then them and a margin, as the runtime
            leaves once it has seen a call of that shape, instead of `reserve`.
        optimum (`bool`, defaults to `False`): Also compute the block optimum (`models.block_optimum`: the least bytes
            of any block schedule, exact over each component's blocks kept largest first; seconds of numpy), its row
            in `block_residency` and the budget row's ratio to it (`to_block_optimum`).
        height, width, frames (`int`, *optional*): The call's size (frames: video models), which sizes the estimated
            activations; default to the model's.
        profile (`str`, *optional*): The rate profile that prices seconds: a shipped name
            (`models.shipped_profiles()`: `"h200"`, the committed GPU runs, the default) or a profile file written by
            `diffusers-offload doctor --measure`.
        ram, disk_bandwidth (`str` or `int`, *optional*): The host's memory (default: this machine's) and the disk's
            read rate (default: ASSUMED `models.host.DEFAULT_DISK_BANDWIDTH`) for the `host` entry.

    Returns:
        `dict`: JSON-ready, sizes in bytes: the model, card and request (`call`: steps and size), `activations`
        (estimated, given or assumed), `bandwidth` (the rates and their profile), `components` (class, dtype,
        parameters, bytes), `layout`, `chain`, one generation's `call_trace`, and per strategy in `strategies` the
        call, `setup_bytes` (once, at enable) and fields whose names say whether they include it, `seconds` (from
        pageable memory, copies back) and `seconds_fast_paths` (the defaults on CUDA) at those rates,
        `peak_bytes` and whether it fits; then `recommended` (or `None`), `notes` saying why a strategy is not
        recommended and `summary` (the one screen: the call, whether it fits, bytes and seconds per image, the
        runner-up); `block_residency` (`models.block_compare`): when the offloaded components do not fit the budget
        together, how those larger than it stream, the modelled block optimum across components, and bytes and
        seconds per generation beside sequential, group and stock offload. The residency manager's row streams as
        the runtime does (`models.block_model.replay_streaming`). `host` (`models.host.host_plan`): whether the
        weights fit the RAM, which stay in their files, the disk reads per image.

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
        height=height,
        width=width,
        frames=frames,
        profile=profile,
    )
    host = parse_host(ram, disk_bandwidth)
    spec = load_spec(model)
    request = complete(request, spec)
    loaded = load_model(spec["path"] if not spec["shipped"] else spec["name"], dtypes, components)
    return _plan(loaded, spec, request, components, host, optimum)


def _plan(
    loaded: Model, spec: dict, request: Request, components: Sequence[str], host: tuple, optimum: bool = False
) -> dict:
    call = loaded.call_trace(request.steps, request.preview)
    plans = BlockPlans(spec["path"] if not spec["shipped"] else spec["name"], _dtypes(loaded), components)
    entries, moved = {}, {}
    budget = request.vram - request.reserve
    strategies = all_strategies(loaded.layout, loaded.sizes, loaded.denoisers, budget, loaded.fixed_bytes)
    for name, strategy in strategies.items():
        moved[name] = replay_generations(
            strategy.policy,
            call,
            loaded.sizes,
            request.generations,
            zero_copy=strategy.zero_copy,
            plans=plans if name == "residency" else None,
        )
        entries[name] = strategy_entry(strategy, moved[name], request, forwards(loaded, call), loaded.fixed_bytes)
    notes = _held(loaded) + _unavailable(entries, loaded, request)
    recommended = recommend(entries, loaded, request, notes)
    result = _result(loaded, request, call, entries, recommended, notes)
    budget = strategies["residency"].budget if "residency" in strategies else None
    result["block_residency"] = block_residency(loaded, request, call, plans, moved, budget, optimum)
    result["summary"] = summary(result)
    result["host"] = host_entry(result, call, host)
    return result


def _dtypes(loaded: Model) -> Dict[str, str]:
    return {n: c["dtype"] for n, c in loaded.components.items()}


def forwards(loaded: Model, call: Sequence[str]) -> int:
    """Denoiser forwards in one generation."""
    return sum(call.count(d) for d in loaded.denoisers)


def strategy_entry(strategy: Strategy, moved: Generations, request: Request, forwards: int = 0, held: int = 0) -> dict:
    """One strategy's JSON entry. Field names say whether they include the setup (moves made once when offload is
    enabled): add `setup_bytes` and `first_generation_bytes_excluding_setup` for the first generation's start.
    `seconds_per_image`: the mean copy seconds with the defaults on CUDA (page-locked, unchanged weights dropped;
    `seconds_per_image_pageable`: from pageable memory, copies back), plus `forwards` denoiser forwards of
    `--step-seconds` when given (the whole components move between forwards: nothing is hidden). `held`: bytes on the
    device all the time (components that cannot move), in the peak."""
    g = moved.generations
    peak = moved.peak + held

    def pageable(m) -> float:
        return m.h2d / request.h2d_rate + m.d2h / request.d2h_rate

    def fast(m) -> float:  # page-locked host-to-device; evictions dropped (unchanged weights)
        return m.h2d / request.pinned_rate

    all_bytes = moved.setup.nbytes + moved.total.nbytes
    later = (moved.total.nbytes - moved.first.nbytes) / (g - 1) if g > 1 else None
    compute = forwards * (request.step_seconds or 0.0)
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
        "seconds": _seconds(moved, pageable),
        "seconds_fast_paths": _seconds(moved, fast),
        "seconds_per_image": _seconds(moved, fast)["mean_per_generation_including_setup"] + compute,
        "seconds_per_image_pageable": _seconds(moved, pageable)["mean_per_generation_including_setup"] + compute,
        "peak_bytes": peak,
        "fits_with_reserve": peak + request.reserve <= request.vram,
        "fits_without_reserve": peak <= request.vram,
        "replay": {"replayed_generations": moved.replayed, "extrapolated": moved.extrapolated, "period": moved.period},
        **({"budget_bytes": strategy.budget} if strategy.budget is not None else {}),
    }


def _seconds(moved: Generations, price) -> dict:
    """The setup, the first generation, the mean of the later ones and the mean per generation (setup included),
    priced by `price(moves)`."""
    g = moved.generations
    rest = Moved(moved.total.h2d - moved.first.h2d, moved.total.d2h - moved.first.d2h).times(1, max(g - 1, 1))
    return {
        "setup": price(moved.setup),
        "first_generation_excluding_setup": price(moved.first),
        "later_generation_mean": price(rest) if g > 1 else None,
        "mean_per_generation_including_setup": (price(moved.setup) + price(moved.total)) / g,
    }


def _held(loaded: Model) -> List[str]:
    """Why the components that cannot move are never moved (and count everywhere)."""
    return [
        f"{name} ({loaded.components[name]['dtype']}, {format_size(loaded.components[name]['nbytes'])}) cannot move "
        "(bitsandbytes 8-bit: `.to()` leaves its row scales behind): every strategy holds it on the card where it is "
        "loaded (load it there: device_map), counted in every peak and in the memory_budget"
        for name in loaded.fixed
    ]


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
    if largest is None or entries["residency"]["peak_bytes"] - loaded.fixed_bytes <= limit:
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
        "units": "bytes; bandwidths in bytes per second; seconds priced at the rates of `bandwidth`",
        "vram_bytes": request.vram,
        "vram_note": request.vram_note,
        "reserve_bytes": request.reserve,
        "activations": activation_assumption(request),
        "call_shape": {"height": request.height, "width": request.width, "frames": request.frames},
        "steps": request.steps,
        "generations": request.generations,
        "preview": request.preview,
        "bandwidth": {
            "assumed": bool(request.given) or not request.profile.measured,
            "profile": request.profile.name,
            "profile_device": request.profile.device,
            "profile_source": request.profile.source,
            "given": list(request.given),
            "h2d_bytes_per_s": request.h2d_rate,
            "d2h_bytes_per_s": request.d2h_rate,
            "pinned_h2d_bytes_per_s": request.pinned_rate,
            "note": rates_note(request),
        },
        "step_seconds": request.step_seconds,
        "components": loaded.components,
        "layout": loaded.layout.to_dict(),
        "chain": list(loaded.layout.arrange().chain),
        "denoisers": list(loaded.denoisers),
        "cannot_move": list(loaded.fixed),
        "call_trace": call,
        "trace_source": f"generated for {request.steps} steps from {loaded.trace_source}",
        "strategies": entries,
        "recommended": recommended,
        "notes": notes,
    }
