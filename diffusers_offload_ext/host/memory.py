"""What the host has: its physical memory, the memory limit of the process's cgroup (v2 `memory.max`, v1
`memory.limit_in_bytes`), the memory available now (`MemAvailable`), and from them the automatic host budget and what
it sets aside (its margin, the staging ring's bytes); and the process's own resident memory by kind (`RssAnon`,
`RssFile`), as `/proc/self/status` says it. No torch here: the planner reads it too.

Everything is read from files under a `root` (`/` on the machine; a folder of fakes in the tests), bounded in size,
and a file that is missing or unreadable means "unknown" (no limit, nothing available beyond physical memory).
"""

from __future__ import annotations

import os
from typing import Dict, NamedTuple, Optional

from ..constants import GiB, MiB

#: Of the host's memory, what the automatic budget leaves to everything else: an eighth, between these bounds.
MARGIN_SHARE, MARGIN_MIN, MARGIN_MAX = 8, 1 * GiB, 4 * GiB
#: The staging ring (`staging.py`): its buffers, and the bounds of each buffer's size.
SLOTS, SLOT_MIN, SLOT_MAX = 3, 1 * MiB, 64 * MiB
#: A cgroup "limit" at or above this is no limit (v1 writes 2**63 rounded down to a page).
_UNLIMITED = 1 << 60
_MAX_READ = 1 << 16  # bytes read from one of these files at most


class HostMemory(NamedTuple):
    """The host's memory as read now.

    Args:
        total (`int`): Physical memory (`MemTotal`).
        available (`int`): Memory the kernel can give without swapping (`MemAvailable`).
        limit (`int` or `None`): The process's cgroup memory limit (the lowest along its path), `None` when none.
        used (`int` or `None`): What that cgroup uses now (`memory.current`, v1 `memory.usage_in_bytes`).
    """

    total: int
    available: int
    limit: Optional[int] = None
    used: Optional[int] = None

    @property
    def size(self) -> int:
        """The most memory this process can have: the smaller of physical memory and the cgroup limit."""
        return min(self.total, self.limit) if self.limit is not None else self.total

    @property
    def free(self) -> int:
        """Memory this process could take now: what is available, and within the cgroup what its limit leaves."""
        if self.limit is None or self.used is None:
            return self.available
        return max(0, min(self.available, self.limit - self.used))


def margin(size: int) -> int:
    """What the automatic host budget leaves free of a host of `size` bytes: an eighth, at least 1 GiB, at most 4 GiB
    (never more than half the host)."""
    return min(max(size // MARGIN_SHARE, MARGIN_MIN), MARGIN_MAX, size // 2)


def automatic_budget(host: HostMemory, held: int) -> int:
    """The automatic host budget: what the process could take now plus what the pipeline already `held` (its
    anonymous and page-locked host bytes, which `MemAvailable` no longer counts), within the host's size, less the
    margin."""
    return max(0, min(host.size, host.free + held) - margin(host.size))


def ring_bytes(budget: int) -> int:
    """Bytes of the staging ring under a host budget of `budget` bytes: `SLOTS` buffers of a thirty-second of the
    budget each, within 1 MiB and 64 MiB."""
    return SLOTS * min(max(budget // 32 // MiB * MiB, SLOT_MIN), SLOT_MAX)


def _read(path: str) -> Optional[str]:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read(_MAX_READ)
    except OSError:
        return None


def _number(text: Optional[str]) -> Optional[int]:
    text = (text or "").strip()
    return int(text) if text.isdigit() else None


def meminfo(root: str = "/") -> Dict[str, int]:
    """`/proc/meminfo` in bytes (`{"MemTotal": ..., "MemAvailable": ...}`)."""
    found = {}
    for line in (_read(os.path.join(root, "proc/meminfo")) or "").splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            found[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return found


def _cgroup_paths(root: str):
    """`(version, path)` of the process's memory cgroup, from `/proc/self/cgroup`."""
    for line in (_read(os.path.join(root, "proc/self/cgroup")) or "").splitlines():
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":
            yield 2, path
        elif "memory" in controllers.split(","):
            yield 1, path


def cgroup_limit(root: str = "/"):
    """`(limit, used)` of the process's memory cgroup: the lowest limit along its path (v2 `memory.max`, v1
    `memory.limit_in_bytes`) and the usage of the cgroup that sets it; `(None, None)` where there is none."""
    best = (None, None)
    for version, path in _cgroup_paths(root):
        base = os.path.join(root, "sys/fs/cgroup") if version == 2 else os.path.join(root, "sys/fs/cgroup/memory")
        names = (
            ("memory.max", "memory.current") if version == 2 else ("memory.limit_in_bytes", "memory.usage_in_bytes")
        )
        parts = [p for p in path.strip("/").split("/") if p and p != ".."]
        for depth in range(len(parts), -1, -1):
            folder = os.path.join(base, *parts[:depth])
            limit = _number(_read(os.path.join(folder, names[0])))
            if limit is not None and limit < _UNLIMITED and (best[0] is None or limit < best[0]):
                best = (limit, _number(_read(os.path.join(folder, names[1]))))
    return best


def read_host(root: str = "/") -> HostMemory:
    """The host's memory now (`HostMemory`). Where `/proc/meminfo` cannot be read, physical memory from `sysconf`
    stands for both its total and what is available."""
    info = meminfo(root)
    total = info.get("MemTotal")
    if total is None:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    limit, used = cgroup_limit(root)
    return HostMemory(total, info.get("MemAvailable", total), limit, used)


def process_memory() -> Dict[str, int]:
    """This process's resident memory by kind, in bytes, from `/proc/self/status`: `RssAnon` (anonymous),
    `RssFile` (pages of mapped files), `RssShmem`, `VmRSS` (their sum). Empty where there is no `/proc`."""
    found = {}
    for line in (_read("/proc/self/status") or "").splitlines():
        key, _, rest = line.partition(":")
        if key.startswith(("Rss", "VmRSS", "VmHWM")):
            parts = rest.split()
            if parts and parts[0].isdigit():
                found[key] = int(parts[0]) * 1024
    return found
