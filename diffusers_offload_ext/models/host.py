"""What a plan says of host memory (`diffusers-offload plan --ram`): whether the weights fit the host, which components
are page-locked and which stay file-backed (in their safetensors files, read through the page cache), the page-locked
bytes, and the disk reads per image priced at a disk rate (ASSUMED unless given).

The model, stated in the result: the pipeline is loaded file-backed (`doe.load_file_backed`, or `from_pretrained`
with the checkpoint's own dtype: no anonymous weights) and offloaded with `host_memory_budget="auto"` and
`pin_memory=True`; the budget is the RAM less the runtime's margin (`host/memory.py`). Each call reads from the host
each component it onloads, once per onload in the call trace, and a component that streams its blocks reads its
kept blocks once (none when they stay on the device between calls) and its streamed blocks at every forward. The
page-locking room (the budget less the staging ring) goes to the components that read the most per byte, as the
runtime's page-locked store spends it (on the components onloaded most), whole components that fit; the others stay
file-backed, read through the page cache that the rest of the budget leaves (the margin is not counted), least
recently used: what they read per image comes from the disk once per image when it does not all fit, and their
streamed blocks every forward when those alone do not fit either; nothing after the first image when it all fits.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Sequence

from ..host.memory import margin, ring_bytes

#: Assumed, not measured: a PCIe NVMe drive reading large files (SATA SSDs read about 0.5 GB/s, hard disks 0.15).
DEFAULT_DISK_BANDWIDTH = "2GB/s"


def reads_per_call(components: Mapping[str, dict], call: Sequence[str], streaming: Mapping[str, dict]) -> Dict:
    """What each component reads from the host per call: `{"once": bytes read once per call, "cycle": bytes read
    again at every forward, "forwards": n}`: its weights at each onload in `call` (consecutive uses of a component
    are one onload), or, streaming (`streaming[name]` from block residency), its kept blocks once (none when they
    stay between generations) and its streamed blocks at every forward."""
    onloads: Dict[str, int] = {}
    previous = None
    for name in call:
        if name != previous:
            onloads[name] = onloads.get(name, 0) + 1
        previous = name
    reads = {}
    for name, component in components.items():
        stream = streaming.get(name) or {}
        if stream.get("available"):
            kept = 0 if stream.get("kept_between_generations") else stream["kept_bytes"]
            forwards = stream["forwards_per_generation"]
            reads[name] = {"once": kept, "cycle": stream["streamed_bytes_per_forward"], "forwards": forwards}
        else:
            reads[name] = {"once": component["nbytes"] * onloads.get(name, 0), "cycle": 0, "forwards": 0}
    return reads


def _total(read: dict) -> int:
    return read["once"] + read["cycle"] * read["forwards"]


def disk_reads(reads: Mapping[str, dict], files: Sequence[str], cache: int) -> int:
    """Bytes read from the disk per image (steady) for the file-backed components `files` through a page cache of
    `cache` bytes (least recently used): none when all they read fits it; their streamed blocks once per call, when
    those alone fit; else every byte they read."""
    once = sum(reads[n]["once"] for n in files)
    cycle = sum(reads[n]["cycle"] for n in files)
    if once + cycle <= cache:
        return 0
    if cycle <= cache:
        return once + cycle
    return sum(_total(reads[n]) for n in files)


def host_plan(
    components: Mapping[str, dict],
    call: Sequence[str],
    streaming: Mapping[str, dict],
    ram: int,
    disk_rate: int,
    *,
    ram_given: bool,
    disk_given: bool,
) -> dict:
    """The `host` entry of a plan (sizes in bytes; see the module docstring)."""
    budget = ram - margin(ram)
    weights = sum(c["nbytes"] for c in components.values())
    reads = reads_per_call(components, call, streaming)
    ring = ring_bytes(budget) if weights > budget else 0
    room = max(0, budget - ring)
    order = sorted(components, key=lambda n: (-_total(reads[n]) / max(components[n]["nbytes"], 1), n))
    locked: List[str] = []
    for name in order:
        if components[name]["nbytes"] <= room - sum(components[n]["nbytes"] for n in locked):
            locked.append(name)
    file_backed = [n for n in components if n not in locked]
    locked_bytes = sum(components[n]["nbytes"] for n in locked) + ring
    cache = max(0, budget - locked_bytes)
    disk = disk_reads(reads, file_backed, cache)
    return {
        "ram_bytes": ram,
        "ram_source": "--ram" if ram_given else "this machine's",
        "budget_bytes": budget,
        "margin_bytes": ram - budget,
        "weights_bytes": weights,
        "fits": weights <= budget,
        "page_locked": locked,
        "file_backed": file_backed,
        "page_locked_bytes": locked_bytes,
        "staging_bytes": ring,
        "page_cache_bytes": cache,
        "reads_per_image": {n: _total(r) for n, r in reads.items()},
        "file_reads_per_image_bytes": sum(_total(reads[n]) for n in file_backed),
        "disk_reads_per_image_bytes": disk,
        "first_image_disk_bytes": max(disk, sum(components[n]["nbytes"] for n in file_backed)),
        "disk_bytes_per_s": disk_rate,
        "disk_rate_source": "given" if disk_given else "ASSUMED",
        "disk_seconds_per_image": disk / disk_rate,
        "call": 'host_memory_budget="auto", pin_memory=True',
        "model": __doc__.split("\n\n")[1].replace("\n", " ").split(": ", 1)[1],
    }


def host_entry(result: dict, call: Sequence[str], parsed: tuple) -> dict:
    """`host_plan` for a plan's `result` (its components and block residency) and `parse_host`'s `parsed`."""
    ram, ram_given, rate, rate_given = parsed
    streaming = result["block_residency"].get("streaming") or {}
    return host_plan(result["components"], call, streaming, ram, rate, ram_given=ram_given, disk_given=rate_given)


def host_line(host: dict, gib) -> str:
    """The plan's one-screen words for `host` (`gib`: bytes to GiB text)."""
    head = (
        f"Host: {gib(host['ram_bytes'])} GiB of RAM ({host['ram_source']}), host budget "
        f"{gib(host['budget_bytes'])} GiB: the weights ({gib(host['weights_bytes'])} GiB) "
    )
    if host["fits"]:
        return head + "fit; no disk reads after loading."
    text = head + (
        f"do not fit; {gib(host['page_locked_bytes'])} GiB page-locked, in their files: "
        f"{', '.join(host['file_backed']) or 'none'}. "
    )
    if host["disk_reads_per_image_bytes"] == 0:
        first = gib(host["first_image_disk_bytes"])
        return text + f"They stay in the page cache: {first} GiB read from disk once, none per image after."
    rate = ("an ASSUMED " if host["disk_rate_source"] == "ASSUMED" else "a given ") + _rate(host["disk_bytes_per_s"])
    return text + (
        f"Disk reads {gib(host['disk_reads_per_image_bytes'])} GiB per image, {host['disk_seconds_per_image']:.1f} s "
        f"at {rate} (--disk-bandwidth)."
    )


def _rate(rate: float) -> str:
    from .bounds import format_rate

    return format_rate(rate)


def parse_host(ram=None, disk_bandwidth=None) -> tuple:
    """`(ram bytes, ram given, disk bytes per second, disk rate given)` from `--ram` (default: this machine's memory,
    the smaller of physical memory and the cgroup's limit) and `--disk-bandwidth` (default: `DEFAULT_DISK_BANDWIDTH`,
    assumed); `PlanError` names a bad one."""
    from ..host.memory import read_host
    from .bounds import parse_bytes, parse_rate
    from .errors import PlanError

    ram_bytes = read_host().size if ram is None else parse_bytes(ram, argument="--ram")
    if not ram_bytes:
        raise PlanError("this machine's memory cannot be read: give --ram (e.g. 32GiB).", "--ram")
    rate = parse_rate(
        DEFAULT_DISK_BANDWIDTH if disk_bandwidth is None else disk_bandwidth, argument="--disk-bandwidth"
    )
    return ram_bytes, ram is not None, rate, disk_bandwidth is not None
