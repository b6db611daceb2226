"""The options that choose how bytes move rather than which: `pin_memory` and `prefetch`, validated and merged with the
values in force (`None` keeps them)."""

from __future__ import annotations

from typing import Any, Union

PIN = "pin_memory"
PREFETCH = "prefetch"
AUTO = "auto"


def how_bytes_move(previous, pin_memory: Any, prefetch: Any, residency: bool) -> dict:
    """`{"pin_memory": ..., "prefetch": ...}` for `OffloadOptions`; raises before anything changes."""
    pin = previous.pin_memory if pin_memory is None else _pin(pin_memory)
    if prefetch is None:
        ahead = previous.prefetch and residency
    elif not isinstance(prefetch, bool):
        raise TypeError(f"`{PREFETCH}` must be True, False or None (keep the value set before), got {prefetch!r}.")
    elif prefetch and not residency:
        raise ValueError(
            f"`{PREFETCH}=True` needs the residency manager, which predicts the next component from the previous "
            "call: also pass `memory_budget=...` or `keep_on_device_between_generations=True`."
        )
    else:
        ahead = prefetch
    return {"pin_memory": pin, "prefetch": ahead}


def _pin(value: Any) -> Union[bool, str]:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    kind = ValueError if isinstance(value, str) else TypeError
    raise kind(
        f'`{PIN}` must be True, False or "auto" (page-lock where the device supports it), got {value!r}. Pass '
        f'`{PIN}="auto"` to page-lock the host copies on CUDA.'
    )
