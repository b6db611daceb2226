"""The memory budget of the residency manager: an explicit `memory_budget`, or the automatic one read from free
device memory minus the reserve (`memory_reserve`, or what the call shape's activations were seen to need), checked
against the components that never leave the device; and the lower limits while the components whose activations need
more room run."""

from __future__ import annotations

from typing import Dict, Mapping, Optional, Tuple

import torch
from diffusers.utils import logging

from ..transfer import memory
from ..units import format_size
from ..runtime.options import OffloadOptions

BUDGET, RESERVE, EXCLUDE = "memory_budget", "memory_reserve", "exclude_from_offload"

logger = logging.get_logger(f"diffusers.{__name__}")


#: The automatic budget is rounded down to this, so that small changes of free memory do not change the plan.
AUTO_BUDGET_STEP = 256 << 20


def resolve_budget(
    options: OffloadOptions,
    device: torch.device,
    stays: Mapping[str, int],
    held_bytes: int,
    fixed: Optional[Mapping[str, int]] = None,
    reserve: Optional[int] = None,
) -> Tuple[Optional[int], bool]:
    """The memory budget in force for the residency manager, checked against what must stay on the device.

    Args:
        options (`OffloadOptions`): The options in force.
        device (`torch.device`): The execution device.
        stays (`Mapping[str, int]`): Bytes of each component that never leaves the device (excluded ones, and the
            class's round trips).
        held_bytes (`int`): Bytes of the pipeline's weights already on `device` (free memory does not count them),
            those that cannot move included.
        fixed (`Mapping[str, int]`, *optional*): Bytes of each component that cannot move (bitsandbytes 8-bit): it
            counts against the budget where it was loaded. Beyond an explicit budget, a warning (not an error: no
            option of the user's put it there).
        reserve (`int`, *optional*): What the automatic budget leaves free (the call shape's learnt reserve);
            `memory_reserve` when not given.

    Returns:
        `(Optional[int], bool)`: the budget in bytes (`None`: unlimited) and whether it is the automatic one.

    Raises:
        `ValueError`: `memory_reserve` or an explicit `memory_budget` larger than the device, or the excluded components
            alone larger than an explicit `memory_budget`.
    """
    _check_against_device(options, device)
    reserve = options.memory_reserve if reserve is None else reserve
    stays_bytes = sum(stays.values())
    fixed = dict(fixed or {})
    if options.memory_budget is not None:
        budget = options.memory_budget
        if stays_bytes > budget:
            raise ValueError(
                f"The components that never leave the device ({sorted(stays)!r}, {stays_bytes} bytes = "
                f"{format_size(stays_bytes)}) alone exceed `{BUDGET}`={budget!r} ({format_size(budget)}). Pass a "
                f"`{BUDGET}` of at least {stays_bytes} bytes, or leave some of them out of `{EXCLUDE}`."
            )
        if fixed and stays_bytes + sum(fixed.values()) > budget:
            logger.warning(
                f"The components that cannot move ({sorted(fixed)!r}, bitsandbytes 8-bit, "
                f"{format_size(sum(fixed.values()))}) stay where they were loaded and leave "
                f"{format_size(max(budget - stays_bytes - sum(fixed.values()), 0))} of `{BUDGET}`="
                f"{format_size(budget)} to the others: each of them streams or runs alone. Raise `{BUDGET}`."
            )
        return budget, False
    stays = {**stays, **fixed}
    stays_bytes = sum(stays.values())
    free = memory.free_bytes(device)
    if free is None:
        return None, True
    budget = max((free + held_bytes - reserve) // AUTO_BUDGET_STEP * AUTO_BUDGET_STEP, 0)
    if stays_bytes > budget:
        logger.warning(
            f"The components that never leave the device ({sorted(stays)!r}, {format_size(stays_bytes)}) exceed the "
            f"automatic memory budget ({format_size(budget)}: free memory on {device} plus what the pipeline holds "
            f"there, minus the reserve, {format_size(reserve)}). Every other component will run alone."
        )
        budget = stays_bytes
    return budget, True


def _check_against_device(options: OffloadOptions, device: torch.device) -> None:
    """`memory_reserve` and an explicit `memory_budget` each fit the whole device, where its memory can be read."""
    total = memory.total_bytes(device)
    if total is not None and options.memory_reserve > total:
        reserve = options.memory_reserve
        raise ValueError(
            f"`{RESERVE}` is {format_size(reserve)} ({reserve} bytes), more than the whole device {device} has "
            f"({format_size(total)}). Pass a smaller reserve, for example `{RESERVE}='3GiB'`, or an explicit "
            f"`{BUDGET}`."
        )
    if total is not None and options.memory_budget is not None and options.memory_budget > total:
        budget = options.memory_budget
        raise ValueError(
            f"`{BUDGET}` is {format_size(budget)} ({budget} bytes), more than the whole device {device} has "
            f"({format_size(total)}): the weights it allows would not fit, let alone the activations beside them. "
            f"Pass at most the device's memory less what the activations need, for example `{BUDGET}="
            f"'{max(total - options.memory_reserve, 0) // (1 << 30)}GiB'`, or leave `{BUDGET}` out (`\"auto\"`) for "
            "the automatic budget."
        )


def component_limits(
    device: torch.device, held_bytes: int, reserves: Mapping[str, int], fitted: Mapping[str, int], stays_bytes: int
) -> Tuple[Tuple[str, int], ...]:
    """The most bytes of weights on the device while each component runs, below the budget where its activations
    need more room: free memory plus what the pipeline holds, minus the component's own learnt reserve (`reserves`,
    where free memory can be read), and no more than the weights that fitted beside it after an out-of-memory error
    (`fitted`); never below the components that never leave the device. Sorted `(component, bytes)` pairs."""
    free = memory.free_bytes(device)
    limits: Dict[str, int] = {}
    if free is not None:
        for name, reserve in reserves.items():
            limits[name] = max(free + held_bytes - reserve, 0) // AUTO_BUDGET_STEP * AUTO_BUDGET_STEP
    for name, nbytes in fitted.items():
        limits[name] = min(limits.get(name, nbytes), nbytes)
    return tuple(sorted((name, max(nbytes, stays_bytes)) for name, nbytes in limits.items()))
