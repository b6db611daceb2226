"""A component loaded whole that comes to keep only some of its blocks: its kept blocks stay where they are (nothing
is copied to the device again) and the others go home, dropped where its host copy shows it unchanged (one
fingerprint of the component), else copied back; its host copy is cut in one per kept block for their later
eviction."""

from __future__ import annotations

from typing import Callable, Dict, Iterable

from ..constants import COPY, DROP, OFFLOAD
from ..transfer.base import HOST
from ..transfer.host_copy import HostCopy
from .streamed_block import move_slots


def adopt_whole(module, blocks, kept: Iterable[str], transfer, check: bool, emit: Callable) -> Dict[str, HostCopy]:
    """`module` (on the device whole, its `blocks` found) keeps `kept`: the others leave, each told to `emit(block,
    direction, nbytes, kind)`; returns the host copy of each kept block (sealed where the component was unchanged)."""
    kept = set(kept)
    entry = transfer.entry(module)
    whole = entry.host_copy
    copies = whole.split({block.name: block.slots for block in blocks}) if whole is not None else {}
    unchanged = whole is not None and whole.check and whole.unchanged(module)
    copier = transfer.copier()
    for block in blocks:
        if block.name in kept:
            continue
        part = copies.get(block.name)
        if unchanged:
            part.restore(module)
            emit(block.name, OFFLOAD, block.nbytes, DROP)
            continue
        if part is None or not part.write_back(module, copier.copy_home):
            move_slots(block.slots, HOST)
        emit(block.name, OFFLOAD, block.nbytes, COPY)
    adopted = {}
    for block in blocks:
        if block.name in kept:
            part = copies.get(block.name) or HostCopy(module, check, only=block.slots)
            if unchanged and check:
                part.seal(module)  # its device tensors are its host ones: the component was unchanged
            adopted[block.name] = part
    transfer.forget_host_copy(module)
    return adopted
