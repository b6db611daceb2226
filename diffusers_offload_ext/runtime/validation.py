"""How each option of `enable_model_cpu_offload` is checked and merged with the options in force: the validators
(raising before anything changes, with the argument's name, the bad value, the valid choices and the fix) and the
sticky merges (`None` keeps what was set before) that the options table (`options.py`) names."""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping
from typing import Any, Optional, Tuple, Union

import torch

from ..layout import modules_of
from ..units import MAX_BYTES, UNIT_NAMES, SizeError, check_unit, format_size, parse_size

#: `memory_budget="auto"` and `pin_memory="auto"`; `host_memory_budget="off"`.
AUTO, OFF = "auto", "off"


# -- validators: `(argument, value, components) -> normalised value`, never called with `None` ------------------------
def names(argument: str, value: Any, components: Mapping[str, Any]) -> Tuple[str, ...]:
    """A component name or an iterable of them: the names in order, each once."""
    if isinstance(value, str):
        found = [value]
    elif isinstance(value, (bytes, bytearray, Mapping)) or not isinstance(value, Iterable):
        raise TypeError(
            f"`{argument}` must be a component name (str) or a list of component names, got {value!r} "
            f"of type {type(value).__name__}."
        )
    else:
        found = list(value)
        wrong = [name for name in found if not isinstance(name, str)]
        if wrong:
            raise TypeError(f"`{argument}` must contain only component names (str), got {wrong!r} in {found!r}.")
    valid = list(modules_of(components, movable=False))
    unknown = [name for name in found if name not in components]
    if unknown:
        raise ValueError(
            f"`{argument}` names unknown components {unknown!r}. Valid component names are {valid!r}: "
            f"pass only those."
        )
    not_modules = [name for name in found if not isinstance(components[name], torch.nn.Module)]
    if not_modules:
        kinds = {name: type(components[name]).__name__ for name in not_modules}
        raise ValueError(
            f"`{argument}` names components that are not `torch.nn.Module`s ({kinds!r}), so there is nothing to "
            f"offload or keep. Valid component names are {valid!r}."
        )
    return tuple(dict.fromkeys(found))


def excluded_names(argument: str, value: Any, components: Mapping[str, Any]) -> Tuple[str, ...]:
    """`names`, refusing a bool (there is no "every component" to exclude)."""
    if isinstance(value, bool):
        raise TypeError(
            f"`{argument}` must be a component name (str) or a list of component names, got {value!r}. "
            f"Pass `[]` to offload every component."
        )
    return names(argument, value, components)


def all_or_names(argument: str, value: Any, components: Mapping[str, Any]) -> Union[bool, Tuple[str, ...]]:
    """`True` (every component), `False` (none), or `names`."""
    return value if isinstance(value, bool) else names(argument, value, components)


def size(argument: str, value: Any, components=None, example: str = "20GiB") -> int:
    """A size: an int of bytes or a str with a unit; bounded, parsed in constant time."""
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


def size_or_auto(argument: str, value: Any, components=None) -> Optional[int]:
    """`size`, or `None` for `"auto"` (an explicit budget cleared: the automatic one applies again)."""
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return None
    check_unit(value, argument, texts_only=True)  # `memory_budget="100"`: a unit left out
    return size(argument, value, components)


def host_size(argument: str, value: Any, components=None) -> Union[int, str]:
    """`size`, `"auto"` (read from the host at each arming) or `"off"` (no host budget)."""
    if isinstance(value, str) and value.strip().lower() in (AUTO, OFF):
        return value.strip().lower()
    check_unit(value, argument, texts_only=True)  # `"100"`: a unit left out
    return size(argument, value, components, example="24GiB")


def reserve(argument: str, value: Any, components=None) -> int:
    """`size`; a text without a unit under 1 MiB (`memory_reserve="3"`) is refused as a unit left out, as for
    `memory_budget`."""
    check_unit(value, argument, texts_only=True)
    return size(argument, value, components, example="3GiB")


def flag(argument: str, value: Any, components=None) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"`{argument}` must be True, False or None (keep the value set before), got {value!r}.")
    return value


def bool_or_auto(argument: str, value: Any, components=None) -> Union[bool, str]:
    """`True`, `False` or `"auto"` (where the device supports it)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    kind = ValueError if isinstance(value, str) else TypeError
    raise kind(
        f'`{argument}` must be True, False or "auto" (page-lock where the device supports it), got {value!r}. Pass '
        f'`{argument}="auto"` to page-lock the host copies on CUDA.'
    )


# -- sticky merges: `(option, options in force, value, components, fields so far) -> {field: value}` ----------------
class _Keep:
    def __repr__(self) -> str:
        return "KEEP"


#: The value a merge receives for an option passed as `None` (or not at all): what is in force stays.
KEEP = _Keep()


def replace(option, previous, value: Any, components, fields: dict) -> dict:
    """The value given, or the one in force."""
    return {option.field: getattr(previous, option.field) if value is KEEP else value}


def present_names(option, previous, value: Any, components: Mapping[str, Any], fields: dict) -> dict:
    """The names given, or those in force whose component is still a module."""
    if value is KEEP:
        value = tuple(n for n in getattr(previous, option.field) if isinstance(components.get(n), torch.nn.Module))
    return {option.field: value}


def all_or_present_names(option, previous, value: Any, components: Mapping[str, Any], fields: dict) -> dict:
    """`keep_all` and the names (`option.field`) from `True`/`False` or names; not given, those in force."""
    if value is KEEP:
        return {"keep_all": previous.keep_all, **present_names(option, previous, KEEP, components, fields)}
    if isinstance(value, bool):
        return {"keep_all": value, option.field: ()}
    return {"keep_all": False, option.field: value}


def host_merge(option, previous, value: Any, components, fields: dict) -> dict:
    """`replace`, refused (merged after `zero_copy_eviction`) with `zero_copy_eviction=False` in force: every
    eviction would copy the file-backed weights into anonymous host memory."""
    merged = replace(option, previous, value, components, fields)
    if merged[option.field] not in (None, OFF) and fields["zero_copy"] is False:
        raise ValueError(
            f"`{option.name}` keeps weights in their safetensors files, and `zero_copy_eviction=False` is in force: "
            "every eviction would copy them into anonymous host memory. Leave `zero_copy_eviction` unset (a host "
            f'budget turns it on) or pass `zero_copy_eviction=True`; or pass `{option.name}="off"`.'
        )
    return merged


def prefetch_merge(option, previous, value: Any, components, fields: dict) -> dict:
    """The value given, or the one in force; refused (merged after `pin_memory`) where it is `True` with
    `pin_memory=False` in force: only page-locked host memory can be copied while compute runs, so nothing could be
    prefetched. (Not set, it is on wherever page-locking is: `runtime/fast_paths.py`.)"""
    merged = replace(option, previous, value, components, fields)
    if merged[option.field] is True and fields["pin_memory"] is False:
        given = "" if value is KEEP else f"`{option.name}={value!r}` "
        raise ValueError(
            f"{given or f'`{option.name}=True` (set before) '}copies only from page-locked host memory, and "
            "`pin_memory=False` is in force: nothing could be prefetched. Leave `pin_memory` unset or pass "
            '`pin_memory="auto"` (page-lock where the device supports it) or `pin_memory=True`; or pass '
            f"`{option.name}=False` (or leave it unset: it is then on only where host copies are page-locked)."
        )
    return merged
