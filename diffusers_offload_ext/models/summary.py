"""The one screen of a plan: the call to use, whether it fits, its bytes and seconds per image, what streams, the
same call page-locked with prefetch, and the runner-up with why it comes second; from the plan's own entries."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from .strategies import STRATEGIES

#: What "seconds" means in a plan, without and with `--step-seconds`.
SECONDS = {
    "copies": "seconds are the copies alone, priced at the bandwidths stated (assumed unless given), no compute",
    "image": (
        "seconds per image = {forwards} denoiser forwards x {step:g} s (--step-seconds) + the copies priced at the "
        "bandwidths stated (assumed unless given); copies hidden behind compute only where a row says prefetch"
    ),
}


def fits(entry: dict) -> str:
    """`"yes"`: its weights' peak and the reserve fit the card; `"tight"`: the peak alone; `"no"`."""
    return "yes" if entry["fits_with_reserve"] else "tight" if entry["fits_without_reserve"] else "no"


def ranking(strategies: Dict[str, dict]) -> List[str]:
    """The strategies best first: those recommendable before the others, then by fit (yes, tight, no), then those
    that fit by bytes over every generation, as `plan.recommend` chooses, and those that do not by their weights'
    peak (the nearest to fitting first); ties in `STRATEGIES` order."""

    def key(name: str) -> Tuple:
        entry = strategies[name]
        if not entry["available"]:
            return (True, 3, 0, STRATEGIES.index(name))
        fit = ("yes", "tight", "no").index(fits(entry))
        cost = entry["peak_bytes"] if fit == 2 else entry["all_generations_bytes_including_setup"]
        return (not entry.get("recommendable", True), fit, cost, STRATEGIES.index(name))

    return sorted(strategies, key=key)


def _choice(result: dict, name: str) -> dict:
    entry = result["strategies"][name]
    choice = {"strategy": name, "label": entry["label"], "call": entry["call"], "available": entry["available"]}
    if not entry["available"]:
        return dict(choice, reason=entry["reason"])
    choice.update(
        fits=fits(entry),
        peak_bytes=entry["peak_bytes"],
        bytes_per_image=entry["mean_bytes_per_generation_including_setup"],
        seconds_per_image=entry["seconds_per_image"],
        reason=entry.get("reason"),
    )
    if name == "residency":
        choice["streams"] = _streams(result)
        choice["faster"] = _faster(result)
    return choice


def _streams(result: dict) -> Dict[str, dict]:
    """Per component that streams its blocks under the budget: blocks kept of all, and its bytes on the device."""
    block = result.get("block_residency") or {}
    streams = {}
    for name, stream in (block.get("streaming") or {}).items():
        if stream.get("available"):
            blocks = stream["blocks"]
            streams[name] = {
                "kept": len(blocks["resident"]),
                "blocks": len(blocks["resident"]) + len(blocks["streamed"]),
                "device_bytes": stream["device_bytes"],
                "component_bytes": stream["component_bytes"],
            }
    return streams


def _faster(result: dict) -> Optional[dict]:
    """The budget's call with `pin_memory=True, prefetch=True`: its seconds per image (steady), when priced."""
    rows = (result.get("block_residency") or {}).get("rows") or {}
    row = rows.get("budget_pinned")
    if row is None:
        return None
    steady = row["seconds_steady"] if row["seconds_steady"] is not None else row["seconds_first"]
    return {"options": "pin_memory=True, prefetch=True", "seconds_per_image": steady}


def summary(result: dict) -> dict:
    """The plan's one screen (see the module docstring): `use` (or `None`: nothing fits), `runner_up` (or `None`),
    `seconds` (what seconds mean here) and `nothing_fits` (why, when nothing does)."""
    order = ranking(result["strategies"])
    recommended = result["recommended"]
    use = _choice(result, recommended["strategy"]) if recommended else None
    rest = [n for n in order if recommended is None or n != recommended["strategy"]]
    runner_up = _choice(result, rest[0]) if rest else None
    forwards = sum(result["call_trace"].count(d) for d in result["denoisers"])
    kind = "copies" if result["step_seconds"] is None else "image"
    return {
        "use": use,
        "runner_up": runner_up,
        "seconds": SECONDS[kind].format(forwards=forwards, step=result["step_seconds"] or 0),
        "nothing_fits": None if recommended else " ".join(result["notes"]),
    }
