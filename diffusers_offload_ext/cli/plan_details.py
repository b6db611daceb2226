"""`diffusers-offload plan --details`: the tables behind the one screen: the components, every strategy's bytes,
seconds, peak and fit with its call, and block residency (how components stream, the static block optimum, and
sequential, group and stock offload beside the budget)."""

from __future__ import annotations

from typing import List

from ..models.bounds import format_rate
from . import output

ABOUT_SIZES = "Sizes in GiB (2^30 bytes)."


def render(result: dict, columns: int) -> List[str]:
    """The plan's tables as text lines that fit in `columns` (the one screen follows them)."""
    lines = []
    lines += output.heading("Components (exact sizes from the shipped model data; no weights read):", columns)
    rows = [
        [name, c["class"], c["dtype"], f"{c['parameters']:,}", output.gib(c["nbytes"])]
        for name, c in result["components"].items()
    ]
    headers = ["component", "class", "dtype", "parameters", "GiB"]
    lines += output.table(headers, rows, columns, [False, False, False, True, True])
    lines += output.heading("Predicted transfers, GiB over the bus (legend below):", columns)
    lines += _strategy_table(result, columns)
    lines += [""] + _legend(result, columns) + [""] + _blocks(result, columns)
    for note in result["notes"]:
        lines += output.wrap(f"Note: {note}", columns, "  ")
    return lines


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
