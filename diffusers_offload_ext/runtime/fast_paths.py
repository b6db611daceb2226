"""Which fast transport paths a pipeline's offload uses on its execution device, and why: evictions that drop the
device copy of unchanged weights (`zero_copy_eviction`), onloads from page-locked host memory (`pin_memory`), and
prefetches on a copy stream (`prefetch`). They change how bytes move, never which component is where.

**An accelerator**, here, is an execution device whose memory is not the host's: a tensor moved there reports that
device (`transfer.base.tensors_report`). CUDA, XPU and MPS devices are accelerators, and so is the simulated
accelerator of the tests (`cpu:0` inside a `SimulatedAccelerator`, whose tensors report `cpu:0`); the plain CPU is
not (`cpu:0` outside it: a tensor moved there stays `cpu`, host and device are one memory, and there is nothing to
drop or page-lock).

Defaults, each option not set (`None`):

- `zero_copy_eviction`: on on an accelerator; on the plain CPU, on with the residency manager or a host budget
  (`host_memory_budget`: its file-backed weights must not be copied into anonymous memory at each eviction) only (as
  before this default changed: the plain CPU's ledgers stay what they were);
- `pin_memory`: `"auto"` on an accelerator (page-locked where the device type can page-lock host memory, CUDA, and
  its self-check passed: `pinning/self_check.py`), off on the plain CPU; `"auto"` too wherever `prefetch=True` is
  passed (only page-locked memory can be copied while compute runs). `"auto"` page-locks nothing on the plain CPU;
- `prefetch`: on wherever host copies are page-locked and the device has copy streams (CUDA), in every mode.

Explicit values win: `False` turns a path off; `zero_copy_eviction=True` drops on the plain CPU too;
`pin_memory=True` raises where the device type cannot page-lock (`runtime/checks.py`) and falls back, with a warning,
where the self-check failed; `prefetch=True` with `pin_memory=False` raises (nothing could be prefetched);
`prefetch=True` on a device without copy streams does nothing, as before.
"""

from __future__ import annotations

from typing import Dict, NamedTuple

import torch

from ..pinning import store as pinned
from ..transfer import COPY_STREAMS
from ..transfer.base import tensors_report
from .options import OffloadOptions
from .validation import AUTO


class FastPaths(NamedTuple):
    """The fast paths in force on one pipeline (`doe.offload_status(pipe).fast_paths`).

    Args:
        accelerator (`bool`): The execution device's memory is not the host's (see the module's docstring).
        drops (`bool`): An eviction of an unchanged component drops the device copy instead of copying back.
        page_locked (`bool`): Host copies are page-locked in place (within the host budget), and onloads from them are
            queued without a host wait.
        prefetch (`bool`): The next component (the residency manager's prediction, or the next in the chain) is
            copied on a copy stream while the current one runs.
        why (`Dict[str, str]`): For each option (`zero_copy_eviction`, `pin_memory`, `prefetch`), why it is on or off.
    """

    accelerator: bool
    drops: bool
    page_locked: bool
    prefetch: bool
    why: Dict[str, str]


#: No fast path: before offload is armed.
NONE = FastPaths(False, False, False, False, {})


def accelerator(device: torch.device) -> bool:
    """Whether `device`'s memory is not the host's: tensors moved there report it (CUDA, XPU, MPS, the simulated
    accelerator), unlike the plain CPU's `cpu:0`."""
    return tensors_report(device)


def resolve(options: OffloadOptions, device: torch.device) -> FastPaths:
    """The fast paths `options` give on `device`. Page-locking is asked of the device here (`store.store_for`: once
    per device, after its self-check), so this may touch the driver; it changes nothing of a pipeline."""
    fast = accelerator(device)
    why: Dict[str, str] = {}
    if options.zero_copy is not None:
        drops = options.zero_copy
        why["zero_copy_eviction"] = f"zero_copy_eviction={drops!r}"
    elif fast:
        drops = True
        why["zero_copy_eviction"] = "default on an accelerator: unchanged weights are dropped, not copied back"
    elif options.host_budgeted and not options.residency:
        drops = True
        why["zero_copy_eviction"] = (
            "default under a host budget: file-backed weights are not copied into anonymous memory at each eviction"
        )
    else:
        drops = options.residency
        why["zero_copy_eviction"] = (
            "default on the plain CPU with the residency manager, as before"
            if drops
            else "default off on the plain CPU outside the residency manager: host and device are one memory"
        )
    locked, why["pin_memory"] = _page_locking(options, device, fast)
    prefetch, why["prefetch"] = _prefetch(options, device, locked)
    return FastPaths(fast, drops, locked, prefetch, why)


def wanted_pins(options: OffloadOptions, fast: bool):
    """`pin_memory` in force: as given; not set, `"auto"` on an accelerator or with `prefetch=True`, else `False`."""
    if options.pin_memory is not None:
        return options.pin_memory
    return AUTO if fast or options.prefetch is True else False


def _page_locking(options: OffloadOptions, device: torch.device, fast: bool):
    wanted = wanted_pins(options, fast)
    given = f"pin_memory={options.pin_memory!r}" if options.pin_memory is not None else None
    if wanted is False or (wanted == AUTO and not fast):
        return False, f"{given or 'default'} off on the plain CPU: host and device are one memory"
    if device.type not in pinned.LOCKERS:
        return False, f"{given or 'default'}: {device.type} cannot page-lock host memory (CUDA can)"
    store, verdict = pinned.store_for(device), pinned.verdict(device)
    if store is None:
        return False, f"{given or 'default'}: {verdict or 'host memory cannot be page-locked here'}; pageable copies"
    source = given or ("default on an accelerator" if fast else "prefetch=True")
    return True, f"{source}: {verdict or 'page-locked in place'}"


def _prefetch(options: OffloadOptions, device: torch.device, locked: bool):
    given = f"prefetch={options.prefetch!r}" if options.prefetch is not None else "default"
    if options.prefetch is False:
        return False, given
    if device.type not in COPY_STREAMS:
        return False, f"{given}: {device.type} has no copy stream (CUDA has)"
    if not locked:
        return False, f"{given}: only page-locked host memory can be copied while compute runs, and it is off"
    return True, f"{given}: the next component is copied on a copy stream while the current one runs"
