"""What `print(doe.offload_status(pipe))` shows: the call in force in the words `enable_model_cpu_offload` takes, the
budget, and one row per component (where it is, its bytes, its kept and streamed blocks, why it is there), plain text
at most about 100 columns; why each component is where it is, in those words; and the one line logged at arming."""

from __future__ import annotations

import dataclasses
import textwrap
from typing import List, Optional

from ..units import format_size

#: The widest a printed status gets; the `why` column wraps under itself.
WIDTH = 100
#: Each role's `why`, on the device and on the host (`{cause}`: why it was last evicted).
ROLE_WHY = {
    "excluded": "exclude_from_offload: on the device for good",
    "round trip": "the pipeline class keeps it on the device (_exclude_from_cpu_offload)",
    "kept": "keep_on_device_during_generation: stays until the call ends",
}


def why(role: str, on_device: bool, streams: bool, residency: bool, evicted: Optional[str]) -> str:
    """Why a component is where it is, in the words of the options (`evicted`: the `cause` of its last eviction in
    the ledger)."""
    if streams:
        return "larger than the room memory_budget leaves it: streams its blocks while it runs"
    if role in ROLE_WHY and (on_device or role != "kept"):
        return ROLE_WHY[role]
    if on_device:
        if residency:
            return "kept on the device within memory_budget"
        return "loaded to run; the next in the chain evicts it" if role == "chain" else "stays until the call ends"
    if evicted:
        return f"evicted ({evicted}); loaded again when it runs"
    return "on the host; loaded when it runs"


def called(options: dict) -> str:
    """`enable_model_cpu_offload(...)` with the options in force (`OffloadOptions` as a dict), as a user writes them."""
    words = []
    if options.get("exclude_from_offload"):
        words.append(f"exclude_from_offload={list(options['exclude_from_offload'])!r}")
    if options.get("keep_all"):
        words.append("keep_on_device_during_generation=True")
    elif options.get("keep"):
        words.append(f"keep_on_device_during_generation={list(options['keep'])!r}")
    if options.get("memory_budget") is not None:
        words.append(f"memory_budget={format_size(options['memory_budget']).replace(' ', '')!r}")
    if options.get("keep_between"):
        words.append("keep_on_device_between_generations=True")
    for name, field in (("zero_copy_eviction", "zero_copy"), ("pin_memory", "pin_memory")):
        if options.get(field) is not None:
            words.append(f"{name}={options[field]!r}")
    if options.get("prefetch"):
        words.append("prefetch=True")
    host = options.get("host_budget")
    if host is not None:
        words.append(f"host_memory_budget={host if isinstance(host, str) else format_size(host).replace(' ', '')!r}")
    return f"enable_model_cpu_offload({', '.join(words)})"


def transport(fast) -> str:
    """How the bytes move (`FastPaths`, `runtime/fast_paths.py`), in words."""
    if fast is None:
        return "not armed"
    on = [
        words
        for flag, words in (
            (fast.drops, "unchanged weights dropped, not copied back"),
            (fast.page_locked, "copied from page-locked host memory"),
            (fast.prefetch, "the next component prefetched on a copy stream"),
        )
        if flag
    ]
    return ", ".join(on) if on else "plain copies (pageable, copied back)"


def render(status) -> str:
    """The text of `status` (an `OffloadStatus`)."""
    if not status.enabled and not status.components:
        return "Model offload by diffusers_offload_ext is not enabled on this pipeline."
    state = "enabled" if status.enabled else "not armed now (hooks removed)"
    budget = (
        f"memory_budget {format_size(status.budget)} of weights"
        if status.budget is not None
        else ("no memory budget (unlimited)" if status.policy == "residency" else "stock's chain, no budget")
    )
    lines = textwrap.wrap(f"Model offload on {status.device}, {state}: {called(status.options)}", WIDTH) + [
        f"{budget}; {format_size(status.resident_bytes)} on the device now; {status.calls} call"
        + ("" if status.calls == 1 else "s")
        + (", one in progress" if status.in_call else ""),
        f"moves: {transport(status.fast_paths)}",
    ]
    if status.host_bytes is not None:
        host = status.host_bytes
        lines.append(
            f"host_memory_budget {format_size(status.host_budget)}: {format_size(host.counted)} counted "
            f"({format_size(host.page_locked)} page-locked, {format_size(host.anonymous)} anonymous), "
            f"{format_size(host.file_backed)} file-backed"
        )
    rows = [
        [
            name,
            c.where,
            format_size(c.nbytes),
            f"{len(c.blocks.resident)} kept, {len(c.blocks.streamed)} streamed" if c.blocks else "-",
            c.why,
        ]
        for name, c in status.components.items()
    ]
    return "\n".join(lines + table(["component", "where", "size", "blocks", "why"], rows))


def table(headers: List[str], rows: List[List[str]]) -> List[str]:
    """Columns padded to their widest cell; the last one wrapped under itself within `WIDTH`."""
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers) - 1)]
    left = sum(widths) + 2 * len(widths)
    lines = []
    for row in [headers, *rows]:
        head = "  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  "
        wrapped = textwrap.wrap(row[-1], max(WIDTH - left, 30)) or [""]
        lines.append((head + wrapped[0]).rstrip())
        lines += [(" " * left + more).rstrip() for more in wrapped[1:]]
    return lines


def arming_line(arming, sizes, fixed) -> str:
    """The one log line of an arming: what will stay on the device, stream its blocks, or stay where it was loaded,
    and how the others move (`arming`: an `Arming`; `sizes`, `fixed`: bytes of the armed components and of those that
    cannot move)."""
    options, arranged = arming.options, arming.arrangement
    parts = [f"Model offload armed on {arming.device}: {called(dataclasses.asdict(options))}"]
    stays = [*arranged.excluded, *arranged.round_trip]
    if stays:
        parts.append("on the device for good: " + ", ".join(stays))
    if fixed:
        parts.append("held where they were loaded (cannot move): " + ", ".join(fixed))
    moving = [n for n in arranged.hooked if n in sizes]
    if options.residency:
        room = None if arming.budget is None else arming.budget - sum(sizes.get(n, 0) for n in stays)
        room = None if room is None else room - sum(fixed.values())
        streams = [n for n in moving if room is not None and sizes[n] > room]
        if streams:
            parts.append(
                f"streams its blocks (larger than the {format_size(max(room, 0))} left): " + ", ".join(streams)
            )
        within = "within " + (
            f"memory_budget {format_size(arming.budget)}" if arming.budget is not None else "no budget"
        )
        kept = "kept between calls" if options.keep_between else "evicted at each call's end"
        parts.append(f"loaded when they run, {kept}, {within}: " + ", ".join(n for n in moving if n not in streams))
    else:
        kept = options.kept(moving)
        if kept:
            parts.append("kept until each call ends: " + ", ".join(n for n in moving if n in kept))
        others = [n for n in moving if n not in kept]
        if others:
            parts.append("loaded when they run, evicted by the next in the chain: " + ", ".join(others))
    parts.append("moves: " + transport(arming.fast))
    return "; ".join(parts) + "."
