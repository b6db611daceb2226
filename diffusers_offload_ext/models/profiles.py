"""Rate profiles: measured copy rates between the host and a device, which price the planner's bytes in seconds.

A profile holds four rates in bytes per second: host-to-device from pageable memory (`h2d_pageable`, what
`module.to(device)` from ordinary host memory runs at), device-to-host into new pageable memory (`d2h_fresh`, what
`module.to("cpu")` runs at), host-to-device from page-locked memory (`h2d_page_locked`) and device-to-host into it
(`d2h_page_locked`). The shipped ones come from the committed GPU runs (`data/profiles/*.json`, each citing its
source); `diffusers-offload doctor --measure` writes the user's own (`write_profile`), and `plan --profile` reads
either (`load_profile`).
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Dict, List, Mapping, NamedTuple, Optional

from .errors import PlanError

#: The profile `plan` prices with when none is given: the H200 runs of 2026-11-26.
DEFAULT_PROFILE = "h200"
RATES = ("h2d_pageable", "d2h_fresh", "h2d_page_locked", "d2h_page_locked")
#: Rates a profile may hold, in bytes per second: 1 MB/s to 10 TB/s.
LOWEST, HIGHEST = 10**6, 10**13
_SHIPPED = pathlib.Path(__file__).resolve().parent / "data" / "profiles"
#: Most bytes a profile file may have.
MAX_FILE_BYTES = 1 << 16


class Profile(NamedTuple):
    """One device's copy rates (bytes per second), what they were measured on and where they come from. The
    page-locked rates are `None` where page-locked memory could not be had."""

    name: str
    device: str
    source: str
    measured: bool
    h2d_pageable: int
    d2h_fresh: int
    h2d_page_locked: Optional[int]
    d2h_page_locked: Optional[int]


def default_path() -> pathlib.Path:
    """Where `doctor --measure` writes a profile by default: `$XDG_CACHE_HOME/diffusers-offload/profile.json`
    (`~/.cache` when unset)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(cache) / "diffusers-offload" / "profile.json"


def shipped_profiles() -> List[str]:
    """The names of the shipped profiles."""
    return sorted(path.stem for path in _SHIPPED.glob("*.json"))


def load_profile(value: str) -> Profile:
    """The shipped profile named `value`, or the profile file at path `value` (as `doctor --measure` writes it).

    Raises:
        `PlanError`: no such profile, a file that is not a profile, or a rate out of 1 MB/s to 10 TB/s.
    """
    text = str(value)
    path = _SHIPPED / f"{text}.json" if text in shipped_profiles() else pathlib.Path(text).expanduser()
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise PlanError(
                f"--profile: {text[:80]!r} is larger than a profile ({MAX_FILE_BYTES} bytes).", "--profile"
            )
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise PlanError(
            f"--profile: {text[:80]!r} is neither a shipped profile ({', '.join(shipped_profiles())}) nor a profile "
            f"file ({type(error).__name__}). Write one with `diffusers-offload doctor --measure` on the machine.",
            "--profile",
        ) from None
    return from_mapping(data, default_name=path.stem)


def from_mapping(data: Mapping, default_name: str = "profile") -> Profile:
    """A `Profile` from its JSON form, every rate checked."""
    if not isinstance(data, Mapping):
        raise PlanError("--profile: a profile is a JSON object with the rates " + ", ".join(RATES) + ".", "--profile")
    rates = {key: _rate(data.get(key), key, required=key in RATES[:2]) for key in RATES}
    return Profile(
        name=str(data.get("name") or default_name)[:80],
        device=str(data.get("device") or "unknown device")[:200],
        source=str(data.get("source") or "")[:2000],
        measured=bool(data.get("measured", True)),
        **rates,
    )


def _rate(value, key: str, required: bool) -> Optional[int]:
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not LOWEST <= value <= HIGHEST:
        raise PlanError(
            f"--profile: `{key}` must be bytes per second from 1 MB/s to 10 TB/s, got {str(value)[:40]!r}.",
            "--profile",
        )
    return int(value)


def write_profile(path, rates: Mapping[str, float], device: str, name: Optional[str] = None) -> pathlib.Path:
    """Write measured `rates` (bytes per second, keys of `RATES` as `pinning.bandwidth.measure` returns them) for
    `device` as a profile at `path` (its folder made); returns the path."""
    path = pathlib.Path(path).expanduser()
    profile: Dict[str, object] = {
        "name": name or path.stem,
        "device": device,
        "source": "measured by `diffusers-offload doctor --measure` (pinning/bandwidth.py: the best of 3 copies "
        "of 256 MiB each way)",
        "measured": True,
    }
    profile.update({key: int(rates[key]) for key in RATES if rates.get(key) is not None})
    from_mapping(profile)  # what is written can be read
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile, indent=2) + "\n", encoding="utf-8")
    return path
