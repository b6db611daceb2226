"""Block residency in the planner: each component's block sizes (from a build on the meta device), the stream plan
the runtime would make for a component within a room, and the residency manager's replay with its streams counted
block by block.

The residency manager answers `STREAM` for a component larger than the room it has (and for one that runs once
beside the resident components, `Facts.stream_rooms`); `policies.replay_trace` books such a stream as one onload of
the whole component. `replay_streaming` replays the same policy with the stream rooms the runtime would measure (the
least room in which a plan of `policies.choose_blocks` exists: the component has repeated blocks, its rest and a ring
fit) and books each stream as
the runtime moves it: the plan's kept blocks once when the stream starts, and the streamed blocks at every use of the
component while it streams (one pass per forward); as in the runtime, streams stop at every call's end unless
components stay between calls (`keep_on_device_between_generations`), where a stream the policy keeps, counted at
its kept blocks and ring, stays for the next call and its kept blocks are not copied again. Ring buffers
are sized without the runtime's 256-byte alignment of each tensor (under 0.01 % at real sizes). Importing it needs no
torch.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ..constants import END, OFFLOAD, ONLOAD, STREAM
from ..blocks.choice import DEPTH, Item, BlockChoice, least_room, choose_blocks
from ..policies import Decision, ReplayedMove, replay_trace
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


class RuntimeStreams:
    """`policy` as the runtime drives it when components stream: told the bytes each streaming component holds on
    the device (its plan's kept blocks and ring, `Facts.streaming`), which count in place of its size while it is
    resident. At a call's end, without `keep_between`, every streaming component stops (is offloaded) before the
    policy chooses what stays, among whole components; with it, the policy chooses among everything resident, and a
    stream it keeps stays for the next call (`Session.end_of_call`). Everything else is `policy`'s own answer."""

    def __init__(self, policy, plans: BlockPlans) -> None:
        self.policy, self.calls, self.plans = policy, policy.calls, plans
        self.streaming: Dict[str, int] = {}  # name -> bytes on the device of the plan it streams with

    def _facts(self, facts):
        return facts._replace(streaming=dict(self.streaming))

    def _seen(self, decision: Decision) -> Decision:
        for direction, name in decision.moves:
            plan = self.plans.plan(name, decision.overflow.limit) if direction == STREAM else None
            if plan is not None:
                self.streaming[name] = plan.device_bytes
            else:
                self.streaming.pop(name, None)  # moved whole (a stream without a plan is loaded whole)
        return decision

    def on_enable(self, resident, facts) -> Decision:
        return self._seen(self.policy.on_enable(resident, self._facts(facts)))

    def on_call_start(self, calls) -> Decision:
        return self._seen(self.policy.on_call_start(calls))

    def on_use(self, name, resident, facts) -> Decision:
        return self._seen(self.policy.on_use(name, resident, self._facts(facts)))

    def on_call_end(self, resident, facts) -> Decision:
        if getattr(self.policy, "keep_between", False):
            return self._seen(self.policy.on_call_end(resident, self._facts(facts)))
        stopped = [(OFFLOAD, name) for name in sorted(self.streaming)]
        self.streaming.clear()
        decision = self.policy.on_call_end(set(resident) - {name for _, name in stopped}, self._facts(facts))
        return self._seen(Decision.of(stopped + list(decision.moves), decision.overflow))


def replay_streaming(policy, trace: Sequence[str], sizes: Mapping[str, int], plans: BlockPlans, *, zero_copy: bool):
    """`(moves, peak)` of `policy` over `trace` (see `policies.replay_trace`) with streams booked block by block:
    a stream's onload is its kept blocks, each use of a streaming component adds one pass of its streamed blocks
    (a move of kind `STREAM`), and the peak counts a streaming component at its kept blocks and ring. A component
    that cannot stream is loaded whole, and a streaming one stops at the call's end unless components stay between
    calls and the policy keeps it, as the runtime does."""
    decisions = []
    result = replay_trace(
        RuntimeStreams(policy, plans),
        trace,
        sizes,
        zero_copy=zero_copy,
        stream_rooms=plans.rooms(sizes),
        check=lambda event, resident, decision: decisions.append((event, decision)),
    )
    moves, held, streaming, peak, calls = iter(result.moves), {}, {}, 0, 0
    booked: List[ReplayedMove] = []
    for event, decision in decisions:
        for direction, name in decision.moves:
            move = next(moves)
            plan = plans.plan(name, decision.overflow.limit) if direction == STREAM else None
            if plan is not None:
                streaming[name], held[name] = plan, plan.device_bytes
                move = move._replace(nbytes=plan.kept_bytes)
            elif move.direction == ONLOAD:
                held[name] = sizes[name]
            else:
                held.pop(name, None)
                stopped = streaming.pop(name, None)
                move = move._replace(nbytes=stopped.kept_bytes) if stopped is not None else move
            booked.append(move)
        if event in streaming:
            booked.append(ReplayedMove(ONLOAD, event, streaming[event].streamed_bytes, STREAM, calls))
        calls += event == END
        peak = max(peak, sum(held.values()))
    return booked, peak
