"""The self-check a device passes before its page-locked copies are trusted: a small host buffer page-locked through
the same `Locker` the store uses, copied to the device and back without a host wait per copy (as the fast paths
copy), compared with what was written, and let go. A refusal, an error or a mismatch means the plain (pageable)
path, said once in one info line; nothing is left behind (the driver API returns refusals as codes, and the buffer is
unregistered whatever happened).
"""

from __future__ import annotations

import mmap
from typing import NamedTuple, Optional

import torch

from .locking import Locker

#: Bytes of the buffer: a few pages, and not page-aligned at either end (as a weight in a mapped file often is).
NBYTES = 3 * 4096 + 1000


class Verdict(NamedTuple):
    """`ok`: the device's page-locked copies can be trusted; `reason`: what the check found, in words."""

    ok: bool
    reason: str


def check(device: torch.device, locker: Optional[Locker], streamed: bool) -> Verdict:
    """Page-lock a buffer of `NBYTES` (plus an offset) with `locker`, copy it to `device` and back into page-locked
    memory, compare. `streamed`: the device has CUDA streams (`torch.cuda`'s API, or the tests' fake of it): the
    copies are then queued `non_blocking=True` and waited for once, through an event, as the fast paths do."""
    if locker is None:
        return Verdict(False, "self-check failed: no driver to page-lock host memory with")
    pattern = (torch.arange(NBYTES, dtype=torch.int64) * 37 % 251 + 1).to(torch.uint8)
    # Pages of its own (an anonymous mapping): no page shared with memory already registered for another device.
    mapping = mmap.mmap(-1, 2 * NBYTES + 64)
    room = torch.frombuffer(mapping, dtype=torch.uint8)
    start = 17  # neither end on a page boundary
    sent, back = room[start : start + NBYTES], room[start + NBYTES + 8 : start + 2 * NBYTES + 8]
    sent.copy_(pattern)
    pointer = room.data_ptr()
    code = locker.register(pointer, room.numel(), device)
    if code != 0:
        return Verdict(False, f"self-check failed: the driver refused to page-lock a test buffer (code {code})")
    try:
        return _round_trip(device, sent, back, pattern, streamed)
    except (RuntimeError, AssertionError) as error:
        return Verdict(
            False, f"self-check failed: a copy through page-locked memory raised {str(error).splitlines()[0][:160]}"
        )
    finally:
        locker.unregister(pointer, device)


def _round_trip(device, sent, back, pattern, streamed: bool) -> Verdict:
    with torch.no_grad():
        on_device = torch.empty(sent.shape, dtype=sent.dtype, device=device)
        on_device.copy_(sent, non_blocking=streamed)
        back.copy_(on_device, non_blocking=streamed)
        if streamed:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            event.synchronize()  # one host wait, for this one check
    if not torch.equal(back, pattern) or not torch.equal(sent, pattern):
        wrong = int((back != pattern).sum())
        return Verdict(
            False, f"self-check failed: a page-locked round trip came back with {wrong} of {sent.numel()} bytes wrong"
        )
    return Verdict(True, "self-check passed (a page-locked round trip compared equal)")
