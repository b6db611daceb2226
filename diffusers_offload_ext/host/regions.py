"""Which host memory a tensor lies in, read from the kernel: a mapping of a regular file (file-backed: the kernel may
drop its pages and read them again from the file) or anonymous memory (`/proc/self/maps`), and how many bytes of each
file mapping were written since it was made (copied on write: anonymous now, `Anonymous:` in `/proc/self/smaps`).

A weight loaded from safetensors by diffusers or transformers is a slice of a private (copy-on-write) mapping of its
file; a weight anywhere else (converted, copied back from a device, made by code) is anonymous. Where `/proc` cannot
be read (not Linux), every tensor counts as anonymous: nothing is taken for file-backed that was not seen so.
"""

from __future__ import annotations

import bisect
from typing import Dict, Iterable, List, NamedTuple, Optional

_MAX_MAPS = 1 << 24  # bytes of /proc/self/maps or smaps read at most


class Region(NamedTuple):
    """One file mapping: `[start, end)`, the file's `path`."""

    start: int
    end: int
    path: str


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(_MAX_MAPS)
    except OSError:
        return ""


def _header(line: str) -> Optional[tuple]:
    """`(start, end, path or None)` of a maps/smaps header line, `None` for any other line."""
    fields = line.split(None, 5)
    if len(fields) < 5 or "-" not in fields[0] or ":" not in fields[3]:
        return None
    try:
        start, end = (int(x, 16) for x in fields[0].split("-"))
        inode = int(fields[4])
    except ValueError:
        return None
    path = fields[5].strip() if len(fields) == 6 else ""
    regular = inode != 0 and path.startswith("/") and not path.startswith("/dev/") and not path.endswith("(deleted)")
    return start, end, path if regular else None


class Regions:
    """The process's file mappings, read once (`Regions.read()`); a tensor's kind is then a binary search.

    Args:
        regions (`List[Region]`): The file mappings, sorted by start.
    """

    def __init__(self, regions: Iterable[Region] = ()) -> None:
        self.regions: List[Region] = sorted(regions)
        self._starts = [r.start for r in self.regions]

    @classmethod
    def read(cls, text: Optional[str] = None) -> "Regions":
        """The file mappings of this process now (from `text`, a `/proc/self/maps`, when given)."""
        found = []
        for line in (_read("/proc/self/maps") if text is None else text).splitlines():
            header = _header(line)
            if header is not None and header[2] is not None:
                found.append(Region(*header))
        return cls(found)

    def region_of(self, pointer: int) -> Optional[Region]:
        """The file mapping `pointer` lies in, or `None` (anonymous memory, or unknown)."""
        index = bisect.bisect_right(self._starts, pointer) - 1
        if index >= 0 and pointer < self.regions[index].end:
            return self.regions[index]
        return None

    def file_of(self, pointer: int) -> Optional[str]:
        """The file `pointer`'s memory is a mapping of, or `None`."""
        region = self.region_of(pointer)
        return region.path if region is not None else None


def readable() -> bool:
    """Whether this system says which memory is a mapping of which file (Linux's `/proc/self/maps`)."""
    return bool(_read("/proc/self/maps"))


def written_bytes(starts: Iterable[int], text: Optional[str] = None) -> Dict[int, int]:
    """Bytes written (copied on write, so anonymous now) in each file mapping that starts at one of `starts`, from
    `/proc/self/smaps` (or `text`)."""
    wanted, found, current = set(starts), {}, None
    if not wanted:
        return found
    for line in (_read("/proc/self/smaps") if text is None else text).splitlines():
        header = _header(line)
        if header is not None:
            current = header[0] if header[0] in wanted else None
        elif current is not None and line.startswith("Anonymous:"):
            parts = line.split()
            found[current] = int(parts[1]) * 1024 if len(parts) > 1 and parts[1].isdigit() else 0
    return found
