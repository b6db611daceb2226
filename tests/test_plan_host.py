"""`diffusers-offload plan --ram`: FLUX.1-dev's 31.4 GiB of bf16 weights at 16, 32 and 64 GiB of RAM, against hand
computations from the plan's own component sizes and block plan: whether they fit, which components are page-locked
and which stay in their files, the disk reads per image at the stated disk rate; the default RAM is this machine's;
bad input names its argument."""

import json

import pytest

doe = pytest.importorskip("diffusers_offload_ext")

from diffusers_offload_ext import cli  # noqa: E402
from diffusers_offload_ext.host import memory  # noqa: E402
from diffusers_offload_ext.models import plan  # noqa: E402

pytestmark = pytest.mark.plugin_only
GiB = 1 << 30


@pytest.fixture(scope="module")
def plans():
    return {ram: plan("flux-dev", vram="24GiB", ram=f"{ram}GiB", disk_bandwidth="2GB/s") for ram in (16, 32, 64)}


def sizes(result):
    return {name: c["nbytes"] for name, c in result["components"].items()}


def test_64_gib_hold_every_weight_page_locked_and_nothing_is_read_from_disk(plans):
    host = plans[64]["host"]
    assert host["budget_bytes"] == 60 * GiB  # less the runtime's margin, 4 GiB at most
    assert host["fits"] and host["file_backed"] == [] and host["disk_reads_per_image_bytes"] == 0
    assert host["page_locked_bytes"] == sum(sizes(plans[64]).values())  # no staging ring: nothing to stage


def test_32_gib_leave_t5_in_its_file_and_read_it_from_disk_every_image(plans):
    result = plans[32]
    host, size = result["host"], sizes(result)
    assert not host["fits"] and host["budget_bytes"] == 28 * GiB
    assert host["file_backed"] == ["text_encoder_2"]  # 8.9 GiB, read once per image
    ring = 3 * 64 * (1 << 20)
    assert host["staging_bytes"] == ring
    assert host["page_locked_bytes"] == sum(size.values()) - size["text_encoder_2"] + ring
    assert host["page_cache_bytes"] == 28 * GiB - host["page_locked_bytes"] < size["text_encoder_2"]
    assert host["disk_reads_per_image_bytes"] == size["text_encoder_2"]  # larger than the page cache left
    assert host["disk_seconds_per_image"] == pytest.approx(size["text_encoder_2"] / 2e9)


def test_16_gib_leave_the_transformer_in_its_file(plans):
    result = plans[16]
    host, size = result["host"], sizes(result)
    assert host["budget_bytes"] == 14 * GiB and host["file_backed"] == ["transformer"]
    assert sorted(host["page_locked"]) == ["text_encoder", "text_encoder_2", "vae"]
    stream = result["block_residency"]["streaming"]["transformer"]
    kept = 0 if stream["kept_between_generations"] else stream["kept_bytes"]
    cycle = stream["streamed_bytes_per_forward"]
    assert host["reads_per_image"]["transformer"] == kept + cycle * stream["forwards_per_generation"]
    cache = host["page_cache_bytes"]
    expected = (
        0 if kept + cycle <= cache else kept + cycle if cycle <= cache else host["reads_per_image"]["transformer"]
    )
    assert host["disk_reads_per_image_bytes"] == expected > 0
    assert size["transformer"] > host["budget_bytes"]


def test_the_screen_says_it_in_a_few_lines_and_json_has_it_all(capsys):
    code = cli.main(["plan", "--model", "flux-dev", "--ram", "32GiB"])
    out = capsys.readouterr().out
    assert code == 0
    said = out[out.index("Host: 32 GiB RAM (--ram)") :].split("\n\n")[0].splitlines()
    assert len(said) <= 2 and "text_encoder_2" in said[-1] and "ASSUMED" in said[-1]  # two lines on the screen
    assert cli.main(["plan", "--model", "flux-dev", "--ram", "32GiB", "--details"]) == 0
    details = capsys.readouterr().out
    assert "Host memory (--ram; GiB):" in details and "Model: the pipeline is loaded file-backed" in details
    assert cli.main(["plan", "--model", "flux-dev", "--ram", "64GiB", "--json"]) == 0
    host = json.loads(capsys.readouterr().out)["host"]
    assert host["ram_source"] == "--ram" and host["fits"] and host["disk_rate_source"] == "ASSUMED"


def test_the_default_ram_is_this_machines(monkeypatch):
    monkeypatch.setattr(memory, "read_host", lambda root="/": memory.HostMemory(24 * GiB, 20 * GiB, 20 * GiB, 1))
    host = plan("flux-dev", vram="24GiB")["host"]
    assert host["ram_bytes"] == 20 * GiB and host["ram_source"] == "this machine's"


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--ram", "16"], "--ram: '16' is a number of bytes without a unit"),
        (["--ram", "lots"], "--ram: 'lots' is not a number"),
        (["--disk-bandwidth", "fast"], "--disk-bandwidth: 'fast' is not a rate"),
    ],
)
def test_bad_input_names_its_argument(capsys, argv, said):
    assert cli.main(["plan", "--model", "flux-dev", *argv]) != 0
    assert said in capsys.readouterr().err
