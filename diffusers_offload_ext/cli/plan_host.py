"""`diffusers-offload plan`'s host memory (`--ram`, `--disk-bandwidth`): its line on the one screen, and with
`--details` each component's place (page-locked or in its files), its reads per image, and the model behind them."""

from __future__ import annotations

from typing import List

from ..models.bounds import format_rate
from ..models.host import host_line
from . import output


def short(host: dict, columns: int) -> List[str]:
    """The one screen's words: whether the weights fit the RAM, what stays in its files, the disk reads per image
    (two lines at 80 columns)."""
    ram = f"Host: {output.gib(host['ram_bytes'], 0)} GiB RAM ({host['ram_source']}): "
    weights = output.gib(host["weights_bytes"])
    if host["fits"]:
        return output.wrap(ram + f"the {weights} GiB of weights fit; no disk reads after loading.", columns, "  ")
    disk = host["disk_reads_per_image_bytes"]
    reads = (
        f"{output.gib(disk)} GiB from disk per image, {host['disk_seconds_per_image']:.1f} s "
        f"({host['disk_rate_source']} {format_rate(host['disk_bytes_per_s'])})"
        if disk
        else f"read from disk once ({output.gib(host['first_image_disk_bytes'])} GiB)"
    )
    text = f"{weights} GiB of weights do not fit; in their files: {', '.join(host['file_backed'])}, {reads}."
    return output.wrap(ram + text, columns, "  ")


def details(host: dict, columns: int) -> List[str]:
    """`--details`: the host memory in full, a row per component, and the model it assumes."""
    lines = output.heading("Host memory (--ram; GiB):", columns)
    rows = [
        [
            name,
            "page-locked" if name in host["page_locked"] else "its files",
            output.gib(reads),
        ]
        for name, reads in host["reads_per_image"].items()
    ]
    lines += output.table(["component", "held in", "read per image"], rows, columns, [False, False, True])
    lines += output.wrap(host_line(host, output.gib), columns, "  ")
    lines += output.wrap(
        f"Page-locked {output.gib(host['page_locked_bytes'])} GiB (the staging ring's "
        f"{output.gib(host['staging_bytes'])} included), page cache left {output.gib(host['page_cache_bytes'])} GiB, "
        f"margin {output.gib(host['margin_bytes'])} GiB. The call: {host['call']}.",
        columns,
        "  ",
    )
    return lines + output.wrap(f"Model: {host['model']}", columns, "  ")
