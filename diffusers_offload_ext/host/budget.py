"""The host budget: `host_memory_budget` resolved (a size, or `"auto"`: from the host's memory, `memory.py`), checked
against the host and against what must stay in RAM, and the plan that fits the pipeline's host bytes within it:
which components are re-mapped onto their checkpoint files (largest anonymous bytes first, only as many as the
budget needs), the staging ring's bytes, and what is left for page-locking.

Counted: page-locked bytes (weights and the staging ring) and anonymous bytes (weights, host copies kept for drops);
not counted: file-backed weights, which the kernel may drop and read again from their files. What must stay in RAM:
anonymous weights that no checkpoint file holds (converted on loading, changed, made by code), those of components
on the device now (their host copies), and the staging ring. `plan_host` raises before anything changes.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, NamedTuple, Optional, Tuple

from ..units import format_size
from .account import HostBytes, total
from .memory import HostMemory, margin, ring_bytes
from .remap import Prepared, prepare
from .regions import Regions

#: `host_memory_budget="auto"`, and `"off"` (no host budget: what was set before is cleared).
AUTO, OFF = "auto", "off"


class HostPlan(NamedTuple):
    """What `plan_host` decided, before anything changes.

    Args:
        budget (`int`): The host budget in bytes; `automatic` (`bool`): read from the host (`"auto"`).
        staging (`int`): Bytes of the staging ring (0: none; on the plain CPU the device reads the files in place).
        remaps (`Tuple[Tuple[str, Prepared], ...]`): The components to re-map onto their files, checked.
        measured (`Dict[str, HostBytes]`): Each component's host bytes before.
        counted (`int`): The bytes the budget counts once the re-mapping is done (the staging ring included).
    """

    budget: int
    automatic: bool
    staging: int
    remaps: Tuple[Tuple[str, Prepared], ...]
    measured: Dict[str, HostBytes]
    counted: int


def resolve(argument: str, value, host: HostMemory, held: int) -> Tuple[int, bool]:
    """`(bytes, automatic)` of a validated `host_memory_budget` (an `int` or `AUTO`); `ValueError` above the host's
    memory."""
    if value == AUTO:
        from .memory import automatic_budget

        return automatic_budget(host, held), True
    if value > host.size:
        raise ValueError(
            f"`{argument}`={format_size(value)!r} is more than this host's memory ({format_size(host.size)}: the "
            "smaller of physical memory and the cgroup's memory limit). Pass at most that, or "
            f'`{argument}="auto"` (what is available now, less a margin of {format_size(margin(host.size))}).'
        )
    return value, False


def plan_host(
    argument: str,
    value,
    measured: Mapping[str, HostBytes],
    candidates: Mapping[str, Tuple[object, Optional[str]]],
    host: HostMemory,
    stages: bool,
    regions: Optional[Regions] = None,
) -> HostPlan:
    """The plan for a host budget of `value` (`int` bytes or `AUTO`).

    Args:
        argument (`str`): The option's name, for messages.
        measured (`Mapping[str, HostBytes]`): Each armed component's host bytes now (`account.measure`).
        candidates (`Mapping[str, Tuple[torch.nn.Module, str or None]]`): The components that may be re-mapped (on
            the host now) and the folder of their checkpoint files (`None`: none found).
        host (`HostMemory`): The host's memory now.
        stages (`bool`): File-backed weights are copied to the device through a staging ring (a device whose host
            memory can be page-locked, that does not read host memory in place).

    Raises:
        `ValueError`: the budget is above the host's memory, or below what must stay in RAM.
    """
    now = total(measured)
    budget, automatic = resolve(argument, value, host, now.counted)
    regions = Regions.read() if regions is None else regions
    over = now.counted - budget
    remaps: List[Tuple[str, Prepared]] = []
    kept: Dict[str, Prepared] = {}
    order = sorted(candidates, key=lambda n: (-measured[n].anonymous, n))
    for name in order:
        module, folder = candidates[name]
        if measured[name].anonymous == 0 or folder is None:
            continue
        if over + (ring_bytes(budget) if stages else 0) <= 0:
            break
        prepared = prepare(module, folder, regions)
        kept[name] = prepared
        if prepared.mapped:
            remaps.append((name, prepared))
            over -= prepared.mapped
    file_backed = now.file_backed + sum(p.mapped for _, p in remaps)
    staging = ring_bytes(budget) if stages and file_backed else 0
    counted = now.counted - sum(p.mapped for _, p in remaps) + staging
    if counted > budget:
        raise ValueError(_below(argument, value, budget, counted, staging, measured, candidates, kept))
    return HostPlan(budget, automatic, staging, tuple(remaps), dict(measured), counted)


def _below(argument, value, budget, counted, staging, measured, candidates, kept) -> str:
    """The message of a budget below what must stay in RAM."""
    parts = []
    for name, bytes_ in measured.items():
        left = bytes_.counted - (kept[name].mapped if name in kept else 0)
        if left <= 0:
            continue
        if name not in candidates:
            why = "its host copy, while it is on the device"
        elif candidates[name][1] is None:
            why = "no safetensors checkpoint folder found for it"
        elif name in kept and kept[name].reasons:
            why = "; ".join(sorted(kept[name].reasons))
        else:
            why = "page-locked" if bytes_.page_locked else "anonymous"
        parts.append(f"`{name}`: {format_size(left)} ({why})")
    if staging:
        parts.append(f"the staging ring: {format_size(staging)}")
    return (
        f"`{argument}`={value!r} ({format_size(budget)}) is below what must stay in RAM: {format_size(counted)} "
        f"({', '.join(parts)}). Pass at least {format_size(counted)}, or load the pipeline so that its weights stay "
        "in their files (`diffusers_offload_ext.load_file_backed(...)`, or `from_pretrained` with the checkpoint's "
        "own `torch_dtype`)."
    )
