"""Device names as the trace writes them (`"cpu"`, `"meta"`, `"cuda:0"`): the one place a device becomes a string."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

_NAMES: Dict[Any, str] = {}


def device_name(device: Any) -> Optional[str]:
    """`device` (a `torch.device`, a string or an accelerator index) as a string with an index for accelerators
    (`"cuda:0"`, the current device when it has none), `None` when unknown."""
    if device is None:
        return None
    if simulated(device):
        return "cpu:0"
    try:
        return _NAMES[device]
    except (KeyError, TypeError):
        pass
    key = device
    if isinstance(device, int):
        device = torch.device("cuda", device)
    device = torch.device(device)
    if device.type in ("cpu", "meta"):
        name = device.type
    elif device.index is None:
        # Not cached: the current device may change.
        return f"{device.type}:{_current_index(device.type)}"
    else:
        name = str(device)
    try:
        _NAMES[key] = name
    except TypeError:
        pass
    return name


def _current_index(kind: str) -> int:
    module = getattr(torch, kind, None)
    if module is not None and hasattr(module, "current_device"):
        try:
            return module.current_device()
        except Exception:  # not initialised: index 0 is what torch would pick
            return 0
    return 0


def simulated(device: Any) -> bool:
    """`device` is `cpu:0` while a simulated accelerator runs (a torch function mode marked
    `_is_simulated_accelerator`, `testing/simulated_accelerator.py`): a device apart from the host, whose moves are
    seen as on an accelerator, not replayed as on the CPU."""
    if not isinstance(device, (str, torch.device)) or str(device) != "cpu:0":
        return False
    stack = torch.overrides._get_current_function_mode_stack()
    return any(getattr(mode, "_is_simulated_accelerator", False) for mode in stack)
