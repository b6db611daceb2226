"""Sizes as people write them: parsing `"20GiB"` into bytes (bounded, in constant time) and formatting bytes back."""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Optional

from .constants import GiB, KiB, MiB, TiB

#: Sizes above this are rejected: no device or host has an exbibyte.
MAX_BYTES = 1 << 60
#: Longest size text accepted (so that parsing is constant time).
MAX_TEXT = 64
#: Largest decimal exponent accepted (`"1e99999999"` is rejected before any arithmetic).
MAX_EXPONENT = 30

UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": TiB,
}
UNIT_NAMES = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
#: A size or rate written without a unit and below this is refused: `16` meant `'16GiB'`, not 16 bytes. Write the
#: unit, `B` included (`'512KiB'`, `'4096B'`), for a size that small.
BARE_MINIMUM = MiB
_SIZE = re.compile(r"^\s*([+-]?)(\d+(?:\.\d*)?|\.\d+)(?:[eE]([+-]?\d+))?\s*([A-Za-z]*)\s*$")


class SizeError(ValueError):
    """A size that does not parse, is negative or is too large; `reason` says which in a few words."""

    def __init__(self, text: object, reason: str) -> None:
        super().__init__(f"{text!r} is {reason}")
        self.text = text
        self.reason = reason


def parse_size(text: str) -> int:
    """Bytes in `text`: `"20GiB"`, `"12 GB"`, `"1.5GiB"`, `"512MiB"`, `"1024"`, `"24e9"`.

    Units are case-insensitive; `KB`/`MB`/`GB`/`TB` are powers of 1000, `KiB`/`MiB`/`GiB`/`TiB` powers of 1024.
    Fractions of a byte are dropped; the arithmetic is exact. Runs in constant time whatever the input.

    Raises:
        `SizeError` (a `ValueError`): not a size, negative, or larger than `MAX_BYTES`.
    """
    text = str(text)
    if len(text) > MAX_TEXT:
        raise SizeError(text[:MAX_TEXT] + "...", f"longer than {MAX_TEXT} characters, not a size")
    match = _SIZE.match(text)
    if match is None:
        raise SizeError(text, f"not a number of bytes or a number with a unit ({UNIT_NAMES})")
    sign, mantissa, exponent, unit = match.groups()
    if unit.lower() not in UNITS:
        raise SizeError(text, f"not a size: unknown unit {unit!r}{_unit_hint(text, unit)} (valid units: {UNIT_NAMES})")
    exponent = int(exponent or 0)
    if abs(exponent) > MAX_EXPONENT:
        raise SizeError(text, "too large" if exponent > 0 else "too small to be a size")
    value = Fraction(mantissa) * Fraction(10) ** exponent * UNITS[unit.lower()]
    if sign == "-" and value != 0:
        raise SizeError(text, "negative")
    if value > MAX_BYTES:
        raise SizeError(text, f"too large (more than {format_size(MAX_BYTES)})")
    return int(value)


def _unit_hint(text: str, unit: str) -> str:
    """`: did you mean '16GiB'?` for a unit written as a prefix alone (`16G`, `16Gi`), else `""`."""
    first = unit[:1].lower()
    if unit.lower() not in ("k", "m", "g", "t", "ki", "mi", "gi", "ti"):
        return ""
    number = text.strip()[: len(text.strip()) - len(unit)].strip()
    return f": did you mean '{number}{first.upper() if first != 'k' else 'K'}iB'?"


def check_unit(value: object, argument: str, *, per: str = "", texts_only: bool = False) -> None:
    """Refuse a bare number (an `int`, or a `str` with no unit) above 0 and below `BARE_MINIMUM`: it is bytes, and
    almost surely a unit left out (`--vram 16`, `memory_budget="100"`).

    Args:
        value (`int`, `float` or `str`): What the user wrote.
        argument (`str`): Its name, for the message.
        per (`str`, *optional*): `"/s"` for a rate (the suggestion is then `'12GB/s'`).
        texts_only (`bool`, *optional*): Check only a `str` (an `int` argument of the Python API is bytes, as
            documented: the tiny test pipelines are budgeted in a few hundred KiB).

    Raises:
        `SizeError` (a `ValueError`) whose message names `argument` and suggests the unit: "`16`: did you mean
        `'16GiB'`?".
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float, str))
        or texts_only
        and not isinstance(value, str)
    ):
        return
    text = str(value).strip()
    if len(text) > MAX_TEXT:
        return  # `parse_size` refuses it
    match = _SIZE.match(text)
    if match is None or match.group(4) or isinstance(value, float) and not value.is_integer():
        return  # not a number, or a unit is written: `parse_size` decides
    try:
        nbytes = parse_size(text)
    except SizeError:
        return
    if 0 < nbytes < BARE_MINIMUM:
        shown = str(int(value)) if isinstance(value, float) else text
        raise SizeError(
            value,
            f"a number of bytes{per} without a unit, under {format_size(BARE_MINIMUM)}{per} (`{argument}`: `{shown}`: "
            f"did you mean `'{shown}{'GB' if per else 'GiB'}{per}'`? Write the unit; `'{shown}B{per}'` for so few bytes)",
        )


def format_size(nbytes: Optional[float]) -> str:
    """`nbytes` in binary units with three significant digits (`"1.50 KiB"`, `"23.8 GiB"`, `"512 B"`);
    `"unlimited"` for `None`."""
    if nbytes is None:
        return "unlimited"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{int(value)} B"
            return f"{value:.3g} {unit}" if abs(value) >= 100 else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"  # pragma: no cover - the loop returns at TiB
