"""Block residency in the planner: each component's block sizes from a build on the meta device, and what running a
denoiser larger than the budget block by block moves per generation, beside sequential and group offload.

A model, not a replay: the denoiser keeps the blocks `policies.blocks.plan_stream` keeps within the room the budget
leaves it and streams the others at each of its forwards; every other component is loaded whole when it runs after
the denoiser did (streaming evicts everything else), as the runtime does. Sequential offload and diffusers' group
offloading (block level) both move every weight of a component at each of its forwards. Ring buffers are sized
without the runtime's 256-byte alignment of each tensor (under 0.01 % at real sizes). Importing it needs no torch.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Dict, List, Mapping, Optional

from ..policies import DEPTH, Item, plan_stream
from ..units import format_size
from .recorded import DATA_DIR, config_key
from .sizes import ITEMSIZE
from .specs import load_spec, override_component

#: Block element counts of the shipped models' components (`testing/record_model_data.py --blocks` writes it).
BLOCKS_FILE = os.path.join(DATA_DIR, "blocks.json")
#: The strategies the block model compares, in the order they are shown.
BLOCK_STRATEGIES = ("blocks", "sequential", "group")
OVERLAP_NOTE = (
    "seconds are the transfer time alone at the assumed host-to-device bandwidth, not overlapped with compute: with "
    "a copy stream (prefetch=True; group offload's use_stream=True) streamed copies overlap the compute of the block "
    "before, an assumption the planner does not model (it knows no compute times)"
)


@functools.lru_cache(maxsize=16)
def _block_counts(class_name: str, library: Optional[str], config_json: str) -> tuple:
    """`((block, floating elements, ((dtype, elements), ...)), ...)` of the class built on meta."""
    from ..blocks import find_blocks
    from .meta import build_on_meta, tally

    found = []
    for block in find_blocks(build_on_meta(class_name, library, config_json)):
        tensors = [(sub._parameters if is_param else sub._buffers)[key] for sub, is_param, key in block.slots]
        floating, other = tally(tensors, class_name)
        found.append((block.name, floating, tuple(sorted(other.items()))))
    return tuple(found)


def block_counts(class_name: str, library: Optional[str], config: Mapping) -> list:
    """`[[block, floating elements, {dtype: elements}], ...]` of a component built on meta (what `BLOCKS_FILE`
    ships, so that a plan of a shipped model needs no torch)."""
    counts = _block_counts(class_name, library, json.dumps(config, sort_keys=True))
    return [[name, floating, dict(other)] for name, floating, other in counts]


@functools.lru_cache(maxsize=None)
def shipped_block_counts() -> Dict[str, list]:
    """`{config key: block counts}` of every component of the shipped models (`BLOCKS_FILE`)."""
    if not os.path.exists(BLOCKS_FILE):
        return {}
    with open(BLOCKS_FILE, encoding="utf-8") as f:
        return json.load(f)["components"]


def block_bytes(entry: Mapping, dtype: str) -> Dict[str, int]:
    """`{block: bytes}` of one spec component whose floating tensors are in `dtype` (see `blocks.py`): from the
    shipped block counts when its class and config were recorded, else from a build on the meta device."""
    counts = shipped_block_counts().get(config_key(entry["class"], entry["config"]))
    if counts is None:
        counts = block_counts(entry["class"], entry.get("library"), entry["config"])
    return {
        name: floating * ITEMSIZE[dtype] + sum(n * ITEMSIZE[d] for d, n in other.items())
        for name, floating, other in counts
    }


def spec_entry(model: str, components, name: str) -> Mapping:
    """The spec entry of component `name` of `model`, with `--component` replacements applied."""
    spec = load_spec(model)
    for text in components:
        spec = override_component(spec, text)
    return spec["components"][name]


def others_bytes(call: List[str], hooked, sizes: Mapping[str, int], denoiser: str) -> int:
    """Bytes of the other components per generation: each loaded when it runs and is not on the device, everything
    but the denoiser evicted when the denoiser streams."""
    on_device, moved = set(), 0
    for name in call:
        if name == denoiser:
            on_device.clear()
        elif name in hooked and name not in on_device:
            moved += sizes[name]
            on_device.add(name)
    return moved


def block_residency(model: str, loaded, request, call: List[str], components=()) -> dict:
    """The `block_residency` entry of a plan: whether the largest offloaded component streams within the budget,
    its plan, and bytes and transfer seconds per generation for block residency, sequential and group offload."""
    arranged = loaded.layout.arrange()
    sizes = loaded.sizes
    hooked = [n for n in arranged.hooked if n in sizes]
    if not hooked:
        return {"needed": False, "reason": "no component is offloaded"}
    denoiser = max(hooked, key=lambda n: sizes[n])
    room = request.vram - request.reserve - sum(sizes[n] for n in arranged.round_trip if n in sizes)
    base = {"component": denoiser, "component_bytes": sizes[denoiser], "room_bytes": room}
    if sizes[denoiser] <= room:
        return dict(base, needed=False, reason=f"{denoiser} fits in the budget: nothing streams")
    blocks = block_bytes(spec_entry(model, components, denoiser), loaded.components[denoiser]["dtype"])
    items = [Item(name, nbytes, 1) for name, nbytes in blocks.items()]
    plan = plan_stream(items, max(room, 0), depth=DEPTH, forced=["<rest>"] if "<rest>" in blocks else [])
    if plan is None:
        reason = (
            f"the budget leaves {format_size(max(room, 0))} for {denoiser}: its rest and a ring of {DEPTH + 1} of "
            "its blocks do not fit; raise --vram or lower --reserve"
        )
        return dict(base, needed=True, available=False, reason=reason)
    forwards = call.count(denoiser)
    per_generation = {
        "blocks": others_bytes(call, hooked, sizes, denoiser) + plan.kept_bytes + forwards * plan.streamed_bytes,
        "sequential": sum(sizes[n] for n in call if n in hooked),
    }
    per_generation["group"] = per_generation["sequential"]
    return dict(
        base,
        needed=True,
        available=True,
        blocks={"resident": list(plan.kept), "streamed": list(plan.streamed)},
        kept_bytes=plan.kept_bytes,
        ring_bytes=plan.ring_bytes,
        device_bytes=plan.device_bytes,
        streamed_bytes_per_forward=plan.streamed_bytes,
        forwards_per_generation=forwards,
        bytes_per_generation=per_generation,
        seconds_per_generation_at_assumed_bandwidth={k: v / request.h2d_rate for k, v in per_generation.items()},
        note=OVERLAP_NOTE,
    )
