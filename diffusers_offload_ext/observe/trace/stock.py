"""Replays of stock's offload on the CPU, where its moves cannot be seen (the execution device is the host): model
offload's moves come from stock's chain policy (`ChainPolicy.for_layout` on the pipeline's `PipelineLayout`) driven
by the recorded events, group offload's from its hooks' groups. Always recorded as `"replayed"`."""

from __future__ import annotations

from typing import Callable, Dict, Iterable, Optional, Set, Tuple

from ...constants import COPY, OFFLOAD, ONLOAD
from ...policies import ChainPolicy, apply
from .placement import tensor_nbytes
from .records import REPLAYED

CHAIN_WHERE = "replay: stock chain policy"
GROUP_WHERE = "replay: group offload"


class StockReplay:
    """Stock's moves, replayed as its hooks fire.

    Args:
        sizes (`Dict[str, int]`): Bytes of each component (the trace's `components`).
        resident (`Dict[str, int]`): Bytes of each component on the execution device; the replay updates it.
        record (`Callable`): `record(component, direction, nbytes, kind, source, src, dst, where)` adds a record.
    """

    def __init__(self, sizes: Dict[str, int], resident: Dict[str, int], record: Callable) -> None:
        self.sizes = sizes
        self.resident = resident
        self.record = record
        self.device = "cpu"
        self.chain: Optional[ChainPolicy] = None
        self.on_device: Set[str] = set()
        self.groups_on_device: Set[int] = set()
        self.group_bytes: Dict[int, int] = {}

    # -- model offload ------------------------------------------------------------------------------------------
    def follow(self, view, initial: bool) -> None:
        """Read the pipeline again: stock's chain, when its model offload is to be replayed. At the start of a trace,
        a pipeline between calls is in the state stock's arming leaves (it re-arms at the end of every call)."""
        self.device = view.device_name or "cpu"
        self.chain = ChainPolicy.for_layout(view.layout) if view.replays_model_offload else None
        if initial and self.chain is not None:
            self.on_device = set(self.chain.round_trip)
            for name in self.on_device:
                self.resident[name] = self.sizes.get(name, 0)

    def enabled(self) -> None:
        """Stock armed model offload (`enable_model_cpu_offload`, also at the end of every call)."""
        if self.chain is not None:
            self.replay(self.chain.on_enable(self.on_device).moves)

    def used(self, component: str) -> None:
        """`component` started running: its hook would onload it and evict its predecessor in the chain."""
        if self.chain is not None and component in self.chain.hooked:
            self.replay(self.chain.on_use(component, self.on_device).moves)

    def replay(self, moves: Iterable[Tuple[str, str]]) -> None:
        moves = list(moves)
        apply(moves, self.on_device)
        for direction, name in moves:
            nbytes = self.sizes.get(name, 0)
            self.resident[name] = nbytes if direction == ONLOAD else 0
            src, dst = ("cpu", self.device) if direction == ONLOAD else (self.device, "cpu")
            self.record(name, direction, nbytes, COPY, REPLAYED, src, dst, CHAIN_WHERE)

    # -- group offload ------------------------------------------------------------------------------------------
    def group_event(self, hook, module, component: str, method: str) -> None:
        """A group-offload hook method ran: the group goes on the device before its first forward and leaves after
        the forward of its offload leader."""
        group = getattr(hook, "group", None)
        if group is None:
            return
        key = id(group)
        nbytes = self._group_nbytes(key, group)
        if method == "pre_forward" and key not in self.groups_on_device:
            self.groups_on_device.add(key)
            self.resident[component] = self.resident.get(component, 0) + nbytes
            self.record(component, ONLOAD, nbytes, COPY, REPLAYED, "cpu", self.device, GROUP_WHERE)
        elif method == "post_forward" and key in self.groups_on_device:
            leader = getattr(group, "offload_leader", None)
            if leader is None or leader is module:
                self.groups_on_device.discard(key)
                self.resident[component] = max(0, self.resident.get(component, 0) - nbytes)
                self.record(component, OFFLOAD, nbytes, COPY, REPLAYED, self.device, "cpu", GROUP_WHERE)

    def _group_nbytes(self, key: int, group) -> int:
        if key not in self.group_bytes:
            seen: Set[int] = set()
            total = 0
            tensors = [t for m in getattr(group, "modules", []) or [] for t in _tensors(m)]
            tensors += list(getattr(group, "parameters", []) or []) + list(getattr(group, "buffers", []) or [])
            for tensor in tensors:
                if id(tensor) not in seen:
                    seen.add(id(tensor))
                    total += tensor_nbytes(tensor)
            self.group_bytes[key] = total
        return self.group_bytes[key]


def _tensors(module):
    yield from module.parameters()
    yield from module.buffers()
