"""Block residency in the planner: each component's block sizes (from a build on the meta device), the stream plan of
one component within a room, and the residency manager's replay told those blocks, as the runtime tells it.

`replay_streaming` replays the same policy the runtime drives (`policies.replay_trace`) with the blocks of every
component that can stream (`Facts.blocks`): where the offloaded components do not all fit the budget, the policy
decides block by block which blocks each keeps (`residency/blockwise.py`), and the replay books what the runtime
moves: each newly kept block once, and at every use of a component keeping only some of its blocks, the blocks it
streams; with `keep_on_device_between_generations`, what is kept stays for the next call. Ring buffers are sized
without the runtime's 256-byte alignment of each tensor (under 0.01 % at real sizes). Importing it needs no torch.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Dict, Mapping, Optional, Sequence, Tuple

from ..blocks.choice import DEPTH, Item, BlockChoice, least_room, choose_blocks
from ..policies import replay_trace
from .recorded import DATA_DIR, config_key
from .sizes import component_bytes, parse_dtype
from .specs import load_spec, override_component

#: Block element counts of the shipped models' components (`testing/record_model_data.py --blocks` writes it).
BLOCKS_FILE = os.path.join(DATA_DIR, "blocks.json")
#: The name `blocks.REST` gives what no repeated block holds (`blocks/find.py` imports torch; this module must not).
REST = "<rest>"


@functools.lru_cache(maxsize=16)
def _block_counts(class_name: str, library: Optional[str], config_json: str) -> tuple:
    """`((block, floating elements, ((dtype, elements), ...), linear weights), ...)` of the class built on meta."""
    from .. import find_blocks
    from .meta import build_on_meta, kept_in_fp32, linear_weights, tally

    found = []
    model = build_on_meta(class_name, library, config_json)
    kept, names = kept_in_fp32(model)
    for block in find_blocks(model):
        tensors = [(sub._parameters if is_param else sub._buffers)[key] for sub, is_param, key in block.slots]
        floating, other = tally(tensors, class_name)
        found.append((block.name, floating, tuple(sorted(other.items())), linear_weights(block.slots, names, kept)))
    return tuple(found)


def block_counts(class_name: str, library: Optional[str], config: Mapping) -> list:
    """`[[block, floating elements, {dtype: elements}, [Linear weight elements, rows, matrices]], ...]` of a
    component built on meta (what `BLOCKS_FILE` ships, so that a plan of a shipped model needs no torch)."""
    counts = _block_counts(class_name, library, json.dumps(config, sort_keys=True))
    return [[name, floating, dict(other), list(linear)] for name, floating, other, linear in counts]


@functools.lru_cache(maxsize=None)
def shipped_block_counts() -> Dict[str, list]:
    """`{config key: block counts}` of every component of the shipped models (`BLOCKS_FILE`)."""
    if not os.path.exists(BLOCKS_FILE):
        return {}
    with open(BLOCKS_FILE, encoding="utf-8") as f:
        return json.load(f)["components"]


def block_bytes(entry: Mapping, dtype: str) -> Dict[str, int]:
    """`{block: bytes}` of one spec component whose floating tensors are in `dtype`, or whose Linear weights are in
    the quantized format `dtype` (the rest in the component's own dtype) (see `blocks/find.py`): from the shipped block
    counts when its class and config were recorded, else from a build on the meta device."""
    counts = shipped_block_counts().get(config_key(entry["class"], entry["config"]))
    if counts is None:
        counts = block_counts(entry["class"], entry.get("library"), entry["config"])
    rest = parse_dtype(entry.get("dtype", "float32"), formats=False)
    return {
        row[0]: component_bytes(
            {"floating": row[1], "other": row[2], "linear": row[3] if len(row) > 3 else None}, dtype, rest
        )
        for row in counts
    }


def spec_entry(model: str, components, name: str) -> Mapping:
    """The spec entry of component `name` of `model`, with `--component` replacements applied."""
    spec = load_spec(model)
    for text in components:
        spec = override_component(spec, text)
    return spec["components"][name]


class BlockPlans:
    """The blocks of a planned model's components and the stream plan of each within a room, as the runtime makes
    them (`blocks.streams.block_choice`: every block weighed once per forward, the rest kept).

    Args:
        model (`str`): The shipped model name or spec path.
        dtypes (`Mapping[str, str]`): The weights dtype of each component (the plan's, overrides applied).
        components (`Sequence[str]`, *optional*): The `--component` replacements.
    """

    def __init__(self, model: str, dtypes: Mapping[str, str], components: Sequence[str] = ()) -> None:
        self.model, self.dtypes, self.components = model, dict(dtypes), tuple(components)
        self._blocks: Dict[str, Dict[str, int]] = {}
        self._plans: Dict[Tuple[str, int], Optional[BlockChoice]] = {}

    @classmethod
    def of(cls, blocks: Mapping[str, Mapping[str, int]]) -> "BlockPlans":
        """Plans over given block sizes (`{component: doe.block_sizes(module)}`), for components built here."""
        plans = cls("", {})
        plans._blocks = {name: dict(sizes) for name, sizes in blocks.items()}
        return plans

    def blocks(self, name: str) -> Dict[str, int]:
        """`{block: bytes}` of component `name`, the rest first."""
        if name not in self._blocks:
            self._blocks[name] = block_bytes(spec_entry(self.model, self.components, name), self.dtypes[name])
        return self._blocks[name]

    def plan(self, name: str, room: int) -> Optional[BlockChoice]:
        """How component `name` streams within `room` bytes; `None` when it cannot (no repeated blocks, or less room
        than `least_room`)."""
        key = (name, int(room))
        if key not in self._plans:
            blocks = self.blocks(name)
            plan = None
            if any(block != REST for block in blocks):
                items = [Item(block, nbytes, 1) for block, nbytes in blocks.items()]
                forced = [REST] if REST in blocks else []
                plan = choose_blocks(items, max(int(room), 0), depth=DEPTH, forced=forced)
            self._plans[key] = plan
        return self._plans[key]

    def least_room(self, name: str) -> Optional[int]:
        """The fewest device bytes component `name` needs to stream (`None`: it has no repeated blocks)."""
        blocks = self.blocks(name)
        if all(block == REST for block in blocks):
            return None
        forced = [REST] if REST in blocks else []
        return least_room([Item(block, nbytes, 1) for block, nbytes in blocks.items()], depth=DEPTH, forced=forced)

    def rooms(self, names) -> Dict[str, int]:
        """`Facts.stream_rooms` of `names`, as the runtime measures them (`least_room`)."""
        return {name: room for name in names if (room := self.least_room(name)) is not None}

    def facts(self, names) -> Dict[str, Tuple[Item, ...]]:
        """`Facts.blocks` of `names`: the blocks of each one that can stream (its rest first), each run once per use,
        its ring slot its bytes (the runtime aligns each tensor of a slot to 256 bytes: under 0.01 % at real
        sizes)."""
        found = {}
        for name in names:
            blocks = self.blocks(name)
            if any(block != REST for block in blocks):
                found[name] = tuple(Item(block, nbytes, 1) for block, nbytes in blocks.items())
        return found


def replay_streaming(policy, trace: Sequence[str], sizes: Mapping[str, int], plans: BlockPlans, *, zero_copy: bool):
    """`(moves, peak)` of `policy` over `trace` (see `policies.replay_trace`) told the blocks of every component that
    can stream (`BlockPlans.facts`), as the runtime tells it: a residency policy then decides block by block when the
    components do not all fit its budget, and each use of a component keeping only some of its blocks books the
    blocks it streams (a move of kind `STREAM`); the peak counts its kept blocks and ring."""
    result = replay_trace(
        policy, trace, sizes, zero_copy=zero_copy, stream_rooms=plans.rooms(sizes), blocks=plans.facts(sizes)
    )
    return result.moves, result.peak
