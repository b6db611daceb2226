"""`Placement`: where one pipeline's armed components are. It holds the components, reads which of them are on the
execution device from the book (each module's one record, which every pipeline holding it shares; the tensors say
where they can, and the record follows them), the ones streaming their blocks and how little room each could stream
in, and reads the truth again when a component's structure changed or its weights were moved from outside. It moves
nothing whole: its session does."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Dict, FrozenSet, Iterator, List, Optional, Set

import torch
from diffusers.utils import logging

from ..transfer import ELSEWHERE, MIXED, ON_DEVICE, ON_HOST, Entry, Transfer
from ..blocks.streamer import intact
from . import sharing
from ..blocks.find import REST
from ..blocks.streams import BlockStreams, block_items, stream_room

logger = logging.get_logger(f"diffusers.{__name__}")


class Sizes(Mapping):
    """Current bytes of the components of a placement, read from the book (a changed component is re-read lazily)."""

    def __init__(self, placement: "Placement", transfer: Transfer) -> None:
        self._placement, self._transfer = placement, transfer

    def __getitem__(self, name: str) -> int:
        entry = self._placement.entries[name]
        if entry.dirty:
            self._transfer.book.refresh(self._placement.modules[name], entry)
        return entry.nbytes

    def __iter__(self) -> Iterator[str]:
        return iter(self._placement.entries)

    def __len__(self) -> int:
        return len(self._placement.entries)


class BlockFacts(Mapping):
    """`Facts.blocks` of a placement: the blocks of each component that can stream (measured with its stream room),
    each marked as run or not by what its last stream learned."""

    def __init__(self, placement: "Placement") -> None:
        self._placement = placement

    def __getitem__(self, name: str) -> tuple:
        items = self._placement.block_items[name]
        uses = self._placement.streams.learned.get(name, (None, {}))[1]
        if not uses or not any(uses.values()):
            return items
        # The rest runs whenever the component does (a VAE's `decode` calls no `forward` its count would see).
        return tuple(item._replace(uses=int(item.key == REST or uses.get(item.key, 0) > 0)) for item in items)

    def __iter__(self) -> Iterator[str]:
        return iter(self._placement.block_items)

    def __len__(self) -> int:
        return len(self._placement.block_items)


class Placement:
    """The armed components of one pipeline and where they are.

    Args:
        recorder (`Recorder`): The pipeline's move recorder, for the moves of streamed blocks.
        calls (`CallTracker`): The pipeline's calls (what a stream learned in a failed call is not used).

    Attributes:
        modules (`Dict[str, torch.nn.Module]`): The armed components, in the pipeline's order.
        entries (`Dict[str, Entry]`): Their entries in the transfer's book.
        resident (`FrozenSet[str]`): Components on the execution device (a streaming one counts: it runs there), read
            from their entries (`Entry.resident`), less those that left the pipeline.
        readable (`bool`): Whether the tensors say where they are (the transfer's `readable`, for the hot path).
        streams (`BlockStreams`): The components that stream their blocks (larger than the room left them).
        stream_rooms (`Dict[str, int]`): The fewest device bytes each component can stream in (a fact for the policy,
            measured when armed and again when the component's size changes; absent: it cannot stream).
        block_facts (`BlockFacts`): Its blocks (`Facts.blocks`), measured with its stream room.
        fixed (`Dict[str, torch.nn.Module]`): The components that cannot move (`layout.fixed_of`): never moved, held
            for `offload_status` and the budget.
    """

    def __init__(self, recorder, calls) -> None:
        self.modules: Dict[str, torch.nn.Module] = {}
        self.entries: Dict = {}
        self._left: Set[str] = set()  # components that left the pipeline (until it is armed again)
        self._resident: FrozenSet[str] = frozenset()
        self._read = -1  # `Entry.flips` when `_resident` was read from the entries
        self.readable = False
        self.streams = BlockStreams(recorder, calls)
        self.stream_rooms: Dict[str, int] = {}
        self.block_items: Dict[str, tuple] = {}  # the blocks of each component that can stream (`block_facts`)
        #: `Facts.blocks`: those blocks, marked as run or not by their last stream.
        self.block_facts = BlockFacts(self)
        self._rooms_at: Dict[str, int] = {}  # each component's bytes when its stream room was measured
        self._names: Dict[int, str] = {}
        self._shared: FrozenSet[str] = frozenset()
        self._shared_at = -1  # `sharing.changes` when `_shared` was read
        self.fixed: Dict[str, torch.nn.Module] = {}
        self._book = None

    def take(self, modules: Dict[str, torch.nn.Module], transfer: Transfer, holder, fixed=None) -> List[str]:
        """Hold `modules` (the components as they are now, for session `holder`) and `fixed` (those that cannot
        move) and read where each one is; returns those found on another accelerator (the device changed), counted
        resident until they are sent home."""
        self.fixed, self._book = dict(fixed or {}), transfer.book
        for name, module in self.modules.items():
            if modules.get(name) is not module:
                sharing.leave(holder, module)
        for module in modules.values():
            sharing.join(holder, module)
        self.modules = modules
        self.entries = {name: transfer.entry(module) for name, module in modules.items()}
        self._names = {id(module): name for name, module in modules.items()}
        self.readable = transfer.readable
        self._left, self._read = set(), -1
        elsewhere = []
        for name, module in modules.items():
            where = transfer.locate(module)
            self.entries[name].resident = where in (ON_DEVICE, ELSEWHERE)
            if where == ELSEWHERE:
                elsewhere.append(name)
            elif where == MIXED:
                transfer.forget_host_copy(module)
        return elsewhere

    @property
    def resident(self) -> FrozenSet[str]:
        if self._read != Entry.flips:
            self._read = Entry.flips
            self._resident = frozenset(n for n, e in self.entries.items() if e.resident and n not in self._left)
        return self._resident

    def shared(self, name: str) -> bool:
        """Whether another pipeline holds component `name` too (read again only when who holds what changed)."""
        if self._shared_at != sharing.changes:
            self._shared_at = sharing.changes
            self._shared = frozenset(n for n, module in self.modules.items() if sharing.shared(module))
        return name in self._shared

    def left(self, name: str) -> None:
        """Component `name` left the pipeline: it no longer counts here, wherever it is (until armed again)."""
        self._left.add(name)
        self._read = -1

    def fixed_sizes(self) -> Dict[str, int]:
        """Bytes of each component that cannot move (counted against the budget where it was loaded)."""
        sizes = {}
        for name, module in self.fixed.items():
            entry = self._book.entry(module)
            if entry.dirty:
                self._book.refresh(module, entry)
            sizes[name] = entry.nbytes
        return sizes

    def fixed_bytes(self) -> int:
        return sum(self.fixed_sizes().values())

    def keep_host_copies(self, transfer: Transfer, drops: bool, excluded) -> None:
        """Host copies stay only for resident components that may be evicted without a copy."""
        for name, module in self.modules.items():
            if name not in self.resident or not drops or name in excluded:
                transfer.forget_host_copy(module)

    def measure_streams(self, names: List[str]) -> None:
        """The stream rooms of `names`; with none, none is known (the policy then never streams beside others)."""
        if not names:
            self.stream_rooms.clear()
            self.block_items.clear()
            self._rooms_at.clear()
        for name in names:
            room = stream_room(self.modules[name])
            self._rooms_at[name] = self.entries[name].nbytes
            items = block_items(self.modules[name]) if room is not None else None
            if room is None or items is None:
                self.stream_rooms.pop(name, None)
                self.block_items.pop(name, None)
            else:
                self.stream_rooms[name] = room
                self.block_items[name] = items

    def stream_room_stale(self, name: str) -> bool:
        """Component `name` changed size since its stream room was measured."""
        return self._rooms_at.get(name, self.entries[name].nbytes) != self.entries[name].nbytes

    def name_of(self, module: torch.nn.Module) -> Optional[str]:
        """The component name of `module` here, or `None`."""
        name = self._names.get(id(module))
        return name if name is not None and self.modules.get(name) is module else None

    def placed(self, module: torch.nn.Module, on_device: bool) -> None:
        """`module` is now on the device (or not): its record says so, which every pipeline holding it reads."""
        self._book.entry(module).resident = on_device

    def drifted(self, name: str, transfer: Transfer) -> bool:
        """Constant-time: whether the record of `name` may be wrong (its structure changed, or its first tensor, or a
        block of a streaming one, is not where the record says)."""
        entry = self.entries[name]
        if entry.dirty:
            return True
        if not self.readable:
            return False
        streamer = self.streams.active.get(name)
        if streamer is not None:
            return not intact(streamer)
        return transfer.is_resident(entry) is not (name in self.resident)

    def recheck(self, name: str, transfer: Transfer) -> None:
        """Read where component `name` really is (its structure changed, or its first tensor moved) and bring the
        record in line. A component found partly or wholly off the device is not resident: it will be onloaded
        before it runs, and its host copy is stale."""
        module, entry = self.modules[name], self.entries[name]
        if entry.dirty:
            transfer.book.refresh(module, entry)
        if name in self.streams.active:
            if not self.readable or intact(self.streams.active[name]):  # where tensors cannot tell, the record
                return
            logger.debug(f"`{name}` was moved outside offload while it streamed; streaming stops where it is.")
            self.streams.abandon(name)
        where = transfer.locate(module)
        if where not in (ON_DEVICE, ON_HOST, MIXED):
            return
        on = where == ON_DEVICE
        if on is not (name in self.resident) or where == MIXED:
            logger.debug(f"`{name}` was found {where} (moved outside offload); the record follows the tensors.")
            self.placed(module, on)
        if not on:
            transfer.forget_host_copy(module)

    def recheck_all(self, transfer: Transfer) -> None:
        """`recheck` every component that may have drifted (constant cost each where the tensors cannot tell)."""
        for name in self.modules:
            if self.entries[name].dirty or transfer.readable:
                self.recheck(name, transfer)

    def moved_outside(self, target: Optional[torch.device], transfer: Transfer) -> None:
        """`pipe.to(...)` moved components: read where they are now (or, where tensors cannot tell, take the target
        as the truth); host copies of what left the device are stale, and the page-locked host memory that no longer
        backs a component's weights (moved to the device, or to new host tensors) is unregistered and let go: only a
        resident component's host copy keeps what it page-locked."""
        for name, module in self.modules.items():
            if name in self.streams.active:
                self.streams.abandon(name)
            self.entries[name].dirty = True  # a dtype change leaves no other trace
            if transfer.readable:
                self.recheck(name, transfer)
            elif target is not None:
                on = target == transfer.device
                transfer.record(module, on)
                self.placed(module, on)
            if name not in self.resident:
                transfer.forget_host_copy(module)
        if transfer.pinning is not None:  # page-locked memory that no longer backs the weights goes (issue 31)
            for name, module in self.modules.items():
                if name not in self.resident or self.entries[name].host_copy is None:
                    transfer.pinning.forget_stale(module)
