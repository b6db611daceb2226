"""What one pipeline's streams show: `BlockStatus` (`ComponentStatus.blocks`), and the live views the policy is told
of them (`Facts.streaming`: the bytes each holds; `Facts.kept`: the blocks each keeps and its ring)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Iterator, NamedTuple, Tuple


class BlockStatus(NamedTuple):
    """How a streaming component runs (`ComponentStatus.blocks`).

    Args:
        resident (`Tuple[str, ...]`): Its blocks kept on the device while it streams (`"<rest>"` is what no repeated
            block holds: embeddings, norms, projections).
        streamed (`Tuple[str, ...]`): Its blocks copied into the ring just before they run, in the order they ran.
        ring_bytes (`int`): Bytes of the ring of device buffers they pass through (`slots` of `slot_bytes`).
        slots (`int`): Ring buffers: the running block and those prefetched ahead.
        device_bytes (`int`): Bytes it holds on the device: the resident blocks and the ring.
        bytes_per_pass (`int`): Bytes streamed by one forward (one denoising step, for a denoiser).
        why (`str`): Why these blocks are kept and those stream, in words (the residency policy's reason).
    """

    resident: Tuple[str, ...]
    streamed: Tuple[str, ...]
    ring_bytes: int
    slots: int
    device_bytes: int
    bytes_per_pass: int
    why: str = ""


class StreamBytes(Mapping):
    """The bytes each streaming component of `streams` holds on the device, its kept blocks and ring: what the
    policy counts for it while it is resident (`Facts.streaming`), read live."""

    def __init__(self, streams) -> None:  # a `BlockStreams`
        self._choices = streams.choices

    def __getitem__(self, name: str) -> int:
        return self._choices[name].device_bytes

    def __iter__(self) -> Iterator[str]:
        return iter(self._choices)

    def __len__(self) -> int:
        return len(self._choices)


class KeptFacts(Mapping):
    """For each streaming component of `streams`, the blocks it keeps and the bytes of the ring it holds
    (`Facts.kept`), read live."""

    def __init__(self, streams) -> None:  # a `BlockStreams`
        self._streams = streams

    def __getitem__(self, name: str) -> tuple:
        choice = self._streams.choices[name]
        return frozenset(choice.kept), choice.ring_bytes

    def __iter__(self) -> Iterator[str]:
        return iter(self._streams.choices)

    def __len__(self) -> int:
        return len(self._streams.choices)
