"""The options of `enable_model_cpu_offload`: validation (before anything changes), normalisation, the sticky merge,
the execution device and the memory budget."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterable, Mapping
from typing import Any, Optional, Tuple, Union

import torch
from diffusers.utils import logging


from ..constants import DEFAULT_RESERVE
from ..transfer import memory
from ..layout import modules_of
from ..units import MAX_BYTES, UNIT_NAMES, SizeError, check_unit, format_size, parse_size
from .transfer_options import how_bytes_move

EXCLUDE = "exclude_from_offload"
KEEP = "keep_on_device_during_generation"
BUDGET = "memory_budget"
RESERVE = "memory_reserve"
KEEP_BETWEEN = "keep_on_device_between_generations"
ZERO_COPY = "zero_copy_eviction"
#: `memory_budget="auto"` clears an explicit budget (the automatic one applies again).
AUTO = "auto"

logger = logging.get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class OffloadOptions:
    """The options in force on one pipeline (what `None` arguments keep on the next enable).

    Args:
        exclude_from_offload (`Tuple[str, ...]`, defaults to `()`): Components excluded from offload: on the
            execution device for good.
        keep_all (`bool`, defaults to `False`): `keep_on_device_during_generation=True` (every offloaded component).
        keep (`Tuple[str, ...]`, defaults to `()`): Components named in `keep_on_device_during_generation`.
        memory_budget (`int`, *optional*): Explicit `memory_budget` in bytes; `None`: the automatic one.
        memory_reserve (`int`, defaults to 3 GiB): `memory_reserve` in bytes.
        keep_between (`bool`, defaults to `False`): `keep_on_device_between_generations`.
        zero_copy (`bool`, *optional*): `zero_copy_eviction`; `None` (not set): on with the residency manager only.
        pin_memory (`bool` or `"auto"`, defaults to `False`): `pin_memory`.
        prefetch (`bool`, defaults to `False`): `prefetch`.
    """

    exclude_from_offload: Tuple[str, ...] = ()
    keep_all: bool = False
    keep: Tuple[str, ...] = ()
    memory_budget: Optional[int] = None
    memory_reserve: int = DEFAULT_RESERVE
    keep_between: bool = False
    zero_copy: Optional[bool] = None
    pin_memory: Union[bool, str] = False
    prefetch: bool = False

    @property
    def residency(self) -> bool:
        """Whether the residency manager is on: a `memory_budget` was set or `keep_on_device_between_generations`."""
        return self.memory_budget is not None or self.keep_between

    @property
    def drops(self) -> bool:
        """Whether an eviction of an unchanged component only drops its device copy: with `zero_copy_eviction=True` in
        every mode; when it was never set, with the residency manager only."""
        return self.residency if self.zero_copy is None else self.zero_copy

    def kept(self, offloaded: Iterable[str]) -> frozenset:
        """The names among `offloaded` that the chain must not evict."""
        offloaded = list(offloaded)
        return frozenset(offloaded) if self.keep_all else frozenset(n for n in self.keep if n in offloaded)


def _names(argument: str, value: Any, components: Mapping[str, Any]) -> Tuple[str, ...]:
    """Validate a str or an iterable of component names; return them in order, each once."""
    if isinstance(value, str):
        names = [value]
    elif isinstance(value, (bytes, bytearray, Mapping)) or not isinstance(value, Iterable):
        raise TypeError(
            f"`{argument}` must be a component name (str) or a list of component names, got {value!r} "
            f"of type {type(value).__name__}."
        )
    else:
        names = list(value)
        wrong = [name for name in names if not isinstance(name, str)]
        if wrong:
            raise TypeError(f"`{argument}` must contain only component names (str), got {wrong!r} in {names!r}.")
    valid = list(modules_of(components, movable=False))
    unknown = [name for name in names if name not in components]
    if unknown:
        raise ValueError(
            f"`{argument}` names unknown components {unknown!r}. Valid component names are {valid!r}: "
            f"pass only those."
        )
    not_modules = [name for name in names if not isinstance(components[name], torch.nn.Module)]
    if not_modules:
        kinds = {name: type(components[name]).__name__ for name in not_modules}
        raise ValueError(
            f"`{argument}` names components that are not `torch.nn.Module`s ({kinds!r}), so there is nothing to "
            f"offload or keep. Valid component names are {valid!r}."
        )
    return tuple(dict.fromkeys(names))


def _size(argument: str, value: Any, example: str) -> int:
    """Validate a size: an int of bytes or a str with a unit; bounded, parsed in constant time."""
    if isinstance(value, bool):
        raise ValueError(
            f"`{argument}` must be a size in bytes, not a bool: got {value!r}. Pass an int of bytes or a str with a "
            f"unit, for example `{argument}={example!r}`."
        )
    if isinstance(value, numbers.Integral):
        nbytes = int(value)
        if nbytes > MAX_BYTES:
            raise ValueError(
                f"`{argument}`={value!r} is too large: more than {format_size(MAX_BYTES)}. Pass the size of the "
                f"device memory to use, for example `{argument}={example!r}`."
            )
    elif isinstance(value, str):
        try:
            nbytes = parse_size(value)
        except SizeError as error:
            raise ValueError(
                f"`{argument}`={error.text!r} is {error.reason}. Pass an int of bytes or a number with a unit "
                f"({UNIT_NAMES}; KB, MB, GB, TB are powers of 1000), for example `{argument}={example!r}`."
            ) from None
    else:
        raise TypeError(
            f"`{argument}` must be an int (bytes), a str with a unit such as {example!r}, or None, got {value!r} of "
            f"type {type(value).__name__}."
        )
    if nbytes < 0:
        raise ValueError(f"`{argument}` must not be negative, got {value!r}. Pass for example {example!r}.")
    return nbytes


def _flag(argument: str, value: Any, previous: Optional[bool]) -> Optional[bool]:
    if value is None:
        return previous
    if not isinstance(value, bool):
        raise TypeError(f"`{argument}` must be True, False or None (keep the value set before), got {value!r}.")
    return value


def resolve_options(
    previous: OffloadOptions,
    components: Mapping[str, Any],
    exclude_from_offload: Any = None,
    keep_on_device_during_generation: Any = None,
    *,
    memory_budget: Any = None,
    memory_reserve: Any = None,
    keep_on_device_between_generations: Any = None,
    zero_copy_eviction: Any = None,
    pin_memory: Any = None,
    prefetch: Any = None,
) -> OffloadOptions:
    """Validate the new arguments and merge them with the ones in force (`None` keeps what was set before).

    Raises:
        `TypeError`: an argument of the wrong type.
        `ValueError`: a name that is not a component, or whose component is not a `torch.nn.Module`; a size that does
            not parse, is negative or is a bool.
    """
    if memory_budget is None:
        budget = previous.memory_budget
    elif isinstance(memory_budget, str) and memory_budget.strip().lower() == AUTO:
        budget = None
    else:
        check_unit(memory_budget, BUDGET, texts_only=True)  # `memory_budget="100"`: a unit left out
        budget = _size(BUDGET, memory_budget, "20GiB")
    reserve = previous.memory_reserve if memory_reserve is None else _size(RESERVE, memory_reserve, "3GiB")
    keep_between = _flag(KEEP_BETWEEN, keep_on_device_between_generations, previous.keep_between)
    zero_copy = _flag(ZERO_COPY, zero_copy_eviction, previous.zero_copy)
    residency = dict(memory_budget=budget, memory_reserve=reserve, keep_between=keep_between, zero_copy=zero_copy)
    residency.update(how_bytes_move(previous, pin_memory, prefetch, budget is not None or keep_between))

    if exclude_from_offload is None:
        exclude = tuple(n for n in previous.exclude_from_offload if isinstance(components.get(n), torch.nn.Module))
    elif isinstance(exclude_from_offload, bool):
        raise TypeError(
            f"`{EXCLUDE}` must be a component name (str) or a list of component names, got {exclude_from_offload!r}. "
            f"Pass `[]` to offload every component."
        )
    else:
        exclude = _names(EXCLUDE, exclude_from_offload, components)

    if keep_on_device_during_generation is None:
        keep_all = previous.keep_all
        keep = tuple(n for n in previous.keep if isinstance(components.get(n), torch.nn.Module))
    elif isinstance(keep_on_device_during_generation, bool):
        keep_all, keep = keep_on_device_during_generation, ()
    else:
        keep_all, keep = False, _names(KEEP, keep_on_device_during_generation, components)
    return OffloadOptions(exclude_from_offload=exclude, keep_all=keep_all, keep=keep, **residency)


#: The automatic budget is rounded down to this, so that small changes of free memory do not change the plan.
AUTO_BUDGET_STEP = 256 << 20


def resolve_budget(
    options: OffloadOptions,
    device: torch.device,
    stays: Mapping[str, int],
    held_bytes: int,
) -> Tuple[Optional[int], bool]:
    """The memory budget in force for the residency manager, checked against what must stay on the device.

    Args:
        options (`OffloadOptions`): The options in force.
        device (`torch.device`): The execution device.
        stays (`Mapping[str, int]`): Bytes of each component that never leaves the device (excluded ones, and the
            class's round trips).
        held_bytes (`int`): Bytes of the pipeline's weights already on `device` (free memory does not count them).

    Returns:
        `(Optional[int], bool)`: the budget in bytes (`None`: unlimited) and whether it is the automatic one.

    Raises:
        `ValueError`: `memory_reserve` larger than the device, or the excluded components alone larger than an explicit
            `memory_budget`.
    """
    total = memory.total_bytes(device)
    reserve = options.memory_reserve
    if total is not None and reserve > total:
        raise ValueError(
            f"`{RESERVE}` is {format_size(reserve)} ({reserve} bytes), more than the whole device {device} has "
            f"({format_size(total)}). Pass a smaller reserve, for example `{RESERVE}='3GiB'`, or an explicit "
            f"`{BUDGET}`."
        )
    stays_bytes = sum(stays.values())
    if options.memory_budget is not None:
        budget = options.memory_budget
        if stays_bytes > budget:
            raise ValueError(
                f"The components that never leave the device ({sorted(stays)!r}, {stays_bytes} bytes = "
                f"{format_size(stays_bytes)}) alone exceed `{BUDGET}`={budget!r} ({format_size(budget)}). Pass a "
                f"`{BUDGET}` of at least {stays_bytes} bytes, or leave some of them out of `{EXCLUDE}`."
            )
        return budget, False
    free = memory.free_bytes(device)
    if free is None:
        return None, True
    budget = max((free + held_bytes - reserve) // AUTO_BUDGET_STEP * AUTO_BUDGET_STEP, 0)
    if stays_bytes > budget:
        logger.warning(
            f"The components that never leave the device ({sorted(stays)!r}, {format_size(stays_bytes)}) exceed the "
            f"automatic memory budget ({format_size(budget)}: free memory on {device} plus what the pipeline holds "
            f"there, minus `{RESERVE}`={format_size(reserve)}). Every other component will run alone."
        )
        budget = stays_bytes
    return budget, True
