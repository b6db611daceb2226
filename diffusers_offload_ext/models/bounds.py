"""Bounds on every count, size and rate the planner accepts, and their parsers: each runs in constant time and
rejects bad input with a `PlanError` naming the argument."""

from __future__ import annotations

import re
from typing import Optional, Tuple, Union

from ..units import SizeError, check_unit, format_size, parse_size
from .errors import PlanError

#: Most denoising steps per generation (real pipelines use 1 to about 100).
MAX_STEPS = 1_000
#: Most generations (pipeline calls in a row) a plan covers.
MAX_GENERATIONS = 10_000
#: Generations replayed call by call; beyond, the per-call bytes are extrapolated from their period.
REPLAYED_GENERATIONS = 12
_DIGITS = re.compile(r"[0-9]{1,12}")


def parse_count(value: Union[int, str], *, argument: str, maximum: int) -> int:
    """A whole number from 1 to `maximum` in `value` (an `int` or its decimal digits).

    Raises:
        `PlanError`: anything else, naming `argument`.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        count = value
    elif isinstance(value, str) and _DIGITS.fullmatch(value.strip()):
        count = int(value.strip())
    else:
        shown = value[:40] + "..." if isinstance(value, str) and len(value) > 40 else value
        raise PlanError(f"{argument} must be a whole number from 1 to {maximum:,}, got {shown!r}.", argument)
    if not 1 <= count <= maximum:
        raise PlanError(f"{argument} must be a whole number from 1 to {maximum:,}, got {count:,}.", argument)
    return count


def parse_bytes(value: Union[int, str], *, argument: str, allow_zero: bool = False) -> int:
    """Bytes in `value` (`"24GiB"`, `"80GB"`, `"24e9"` or an `int`), bounded by `units.MAX_BYTES`.

    Raises:
        `PlanError`: not a size, negative, too large, zero when `allow_zero` is false, or a number without a unit
            under 1 MiB (`--vram 16`: did you mean `16GiB`?).
    """
    try:
        check_unit(value, argument)
        nbytes = parse_size(str(value))
    except SizeError as error:
        raise PlanError(
            f"{argument}: {error.text!r} is {error.reason}. Write a number and a unit such as 24GiB, 80GB or 512MiB "
            "(KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB powers of 1024).",
            argument,
        ) from None
    if nbytes == 0 and not allow_zero:
        raise PlanError(f"{argument} must be more than 0 bytes, got {value!r}.", argument)
    return nbytes


_DECIMAL_CARD = re.compile(r"^\s*([0-9.]+)\s*GB\s*$", re.IGNORECASE)


def parse_card(value: Union[int, str], *, argument: str = "--vram") -> Tuple[int, Optional[str]]:
    """A card's memory in `value`, and a note when it was read the way cards are sold: `"8GB"` is 8 GiB, since
    cards sold as 8 GB have 8 GiB (8 x 2^30 bytes: an RTX 4060's 8,188 MiB, an A100 80GB's 81,920 MiB); `"8e9"` is
    8 x 10^9 bytes.

    Raises:
        `PlanError`: as `parse_bytes`.
    """
    match = _DECIMAL_CARD.match(str(value)) if isinstance(value, str) else None
    if match is None:
        return parse_bytes(value, argument=argument), None
    number = match.group(1)
    note = (
        f"{argument} {value.strip()} read as {number} GiB: cards sold as {number} GB have {number} GiB (write "
        f"{number}e9 for {number} x 10^9 bytes)"
    )
    return parse_bytes(f"{number}GiB", argument=argument), note


def parse_rate(value: Union[int, float, str], *, argument: str) -> int:
    """Bytes per second in `value`: `"12GB/s"`, `"25GiB/s"`, `"12e9"` (bytes per second).

    Raises:
        `PlanError`: not a positive rate, or a number without a unit under 1 MiB/s (`12`), naming `argument`.
    """
    text = str(value).strip()
    body = text[:-2] if text.lower().endswith("/s") else text
    try:
        check_unit(body, argument, per="/s")
    except SizeError as error:
        raise PlanError(f"{argument}: {error.text!r} is {error.reason}.", argument) from None
    try:
        rate = parse_size(body)
    except SizeError:
        rate = 0
    if rate <= 0:
        raise PlanError(
            f"{argument}: {text[:64]!r} is not a rate. Write bytes per second such as 12GB/s or 25GiB/s.", argument
        )
    return rate


def format_rate(rate: float) -> str:
    """`rate` bytes per second in binary units (`"11.2 GiB/s"`)."""
    return f"{format_size(rate)}/s"


#: Most seconds `--step-seconds` accepts for one denoiser forward.
MAX_STEP_SECONDS = 3600.0


def parse_seconds(value: Union[int, float, str, None], *, argument: str) -> Optional[float]:
    """Seconds in `value` (`"0.08"`, `0.08`), above 0 and at most `MAX_STEP_SECONDS`; `None` stays `None`.

    Raises:
        `PlanError`: anything else, naming `argument`.
    """
    if value is None:
        return None
    text = str(value).strip()
    try:
        number = float(text) if len(text) <= 32 else float("nan")
    except ValueError:
        number = float("nan")
    if not 0 < number <= MAX_STEP_SECONDS:  # also rejects nan
        raise PlanError(
            f"`{argument}` must be seconds above 0 and at most {MAX_STEP_SECONDS:g}, got {text[:40]!r}: give the "
            "seconds one denoiser forward takes on the card without offload, such as 0.08.",
            argument,
        )
    return number
