"""`record_transfers()`: every transfer made while it is active is wrapped in a `RecordingTransfer`, so that tests
see each move at the transfer seam (what moved, which way, how many bytes, copy or drop) whatever the transfer does
underneath."""

from __future__ import annotations

import contextlib
from typing import Iterator, List

from .. import transfer as transfers
from ..transfer import RecordingTransfer, Transfer


@contextlib.contextmanager
def record_transfers() -> Iterator[List[RecordingTransfer]]:
    """While active, `make_transfer` wraps each transfer it builds; yields the list of those recordings.

    Example:

    ```py
    >>> from diffusers_offload_ext.testing.recording import record_transfers

    >>> with record_transfers() as recordings:
    ...     pipe.enable_model_cpu_offload(device="cpu")
    >>> pipe("a cat")
    >>> [(call.op, call.moved.nbytes) for call in recordings[0].calls]
    ```
    """
    recordings: List[RecordingTransfer] = []

    def wrap(transfer: Transfer) -> Transfer:
        recording = RecordingTransfer(transfer)
        recordings.append(recording)
        return recording

    transfers._wrappers.append(wrap)
    try:
        yield recordings
    finally:
        transfers._wrappers.remove(wrap)
