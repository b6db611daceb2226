"""What the CLI writes: plain-text tables and paragraphs that fit the terminal width (`COLUMNS`, 80 when piped), GiB
for every size, one JSON document for `--json`, one-line errors, and no import-time warnings of transformers; and
checks of output paths. The only module that prints."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import textwrap
from typing import List, Optional, Sequence

from ..constants import GiB

#: Width when stdout is not a terminal and `COLUMNS` is not set.
PIPED_WIDTH = 80
MIN_WIDTH, MAX_WIDTH = 40, 400
PROG = "diffusers-offload"


class OutputPathError(ValueError):
    """An output file cannot be written there (missing folder, not writable); exit code 2."""


def width() -> int:
    """Columns to fit: `COLUMNS` when set, the terminal's width on a terminal, else 80."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit():
        return min(max(int(columns), MIN_WIDTH), MAX_WIDTH)
    if sys.stdout.isatty():
        return min(max(shutil.get_terminal_size((PIPED_WIDTH, 24)).columns, MIN_WIDTH), MAX_WIDTH)
    return PIPED_WIDTH


def gib(nbytes: Optional[float], digits: int = 2) -> str:
    """`nbytes` in GiB (`"22.17"`); `"-"` for `None`."""
    return "-" if nbytes is None else f"{nbytes / GiB:,.{digits}f}"


def wrap(text: str, columns: int, indent: str = "", first: str = "") -> List[str]:
    """`text` as lines of at most `columns` characters, the first starting with `first`, the others with
    `indent`."""
    return textwrap.wrap(text, columns, initial_indent=first, subsequent_indent=indent, break_on_hyphens=False) or [
        first.rstrip()
    ]


def wrap_call(call: str, columns: int, first: str, indent: str) -> List[str]:
    """A Python call wrapped after its opening parenthesis and its commas (never inside a string)."""
    head, paren, rest = call.partition("(")
    parts = [head + paren] + [p + ", " for p in rest.split(", ")] if rest else [call]
    parts[-1] = parts[-1].rstrip(", ") if rest else parts[-1]
    lines, line = [], first + parts[0]
    if len(line) > columns and first.strip():
        lines, line = [first.rstrip()], indent + parts[0]
    for part in parts[1:]:
        if len(line) + len(part.rstrip()) <= columns or line.strip() == "":
            line += part
        else:
            lines.append(line.rstrip())
            line = indent + part
    return lines + [line.rstrip()]


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], columns: int, right: Sequence[bool]) -> List[str]:
    """Rows under headers when they fit in `columns`; otherwise each row as a block of `header: value` lines."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    if sum(widths) + 2 * (len(widths) - 1) <= columns:
        lines = []
        for row in [headers, *rows]:
            cells = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(row, widths, right)]
            lines.append("  ".join(cells).rstrip())
        return lines
    lines = []
    label = max(len(h) for h in headers[1:])
    for row in rows:
        lines.append(row[0])
        for header, cell in zip(headers[1:], row[1:]):
            lines.extend(wrap(cell, columns, " " * (label + 4), f"  {header.ljust(label)}: "))
    return lines


def hanging(columns: int, wide: int) -> str:
    """The indent of continuation lines: `wide` spaces on wide terminals, two on narrow ones."""
    return " " * (wide if columns >= 70 else 2)


def heading(text: str, columns: int) -> List[str]:
    """A blank line, then `text` wrapped."""
    return [""] + wrap(text, columns, "  ")


def write(lines: Sequence[str]) -> None:
    sys.stdout.write("\n".join(lines) + "\n")


def emit_json(data) -> None:
    """`data` as one JSON document on stdout."""
    sys.stdout.write(json.dumps(data, indent=1, default=str) + "\n")


def error(message: str, code: int, as_json: bool, argument: Optional[str] = None, kind: str = "error") -> int:
    """One line on stderr (and with `--json` one JSON document on stdout); returns `code`."""
    first_line = " ".join(message.split())
    sys.stderr.write(f"{PROG}: {kind}: {first_line}\n")
    if as_json:
        emit_json({"error": first_line, "exit_code": code, "argument": argument})
    return code


def check_output_path(path: str, argument: str) -> str:
    """`path` when a file can be written there.

    Raises:
        `OutputPathError`: its folder is missing or not writable, or it is a folder.
    """
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise OutputPathError(f"{argument} {path}: the folder {folder} does not exist.")
    if os.path.isdir(path):
        raise OutputPathError(f"{argument} {path}: is a folder; give a file name.")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise OutputPathError(f"{argument} {path}: not writable.")
    return path


@contextlib.contextmanager
def quiet_transformers():
    """transformers' warnings at import (a missing torchvision, when diffusers' pipelines are imported to read their
    methods) silenced while the report is made: they are about transformers, not offload, and would open the
    report. Without transformers, nothing to do."""
    try:
        from transformers.utils import logging as transformers_logging
    except ImportError:
        yield
        return
    before = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(before)
