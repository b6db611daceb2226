"""Host memory, the parts: what the host has (meminfo and the cgroup's limit, read from a folder of fakes), which
kind of memory a tensor lies in (the kernel's maps, read for real), safetensors headers checked against their files,
anonymous weights re-mapped onto their files only where the bytes agree, `load_file_backed`, and the issue's
measurement at a small scale: a transformer saved with `save_pretrained` and loaded with `from_pretrained`, offloaded
with a host budget, in a fresh process so that its anonymous memory (`RssAnon`) is that run's alone."""

import json
import os
import struct
import sys

import pytest
import torch

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: host budgets are not in the upstream patch")

from diffusers_offload_ext.constants import GiB, MiB  # noqa: E402
from diffusers_offload_ext.host import files, memory, regions, remap  # noqa: E402
from diffusers_offload_ext.testing import host_rss, tiny  # noqa: E402

pytestmark = pytest.mark.plugin_only
LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc, Linux only")


# -- what the host has --------------------------------------------------------------------------------------------
def _write(root, path, text):
    target = root / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)


def test_the_host_is_its_memory_and_the_lowest_cgroup_limit_on_its_path(tmp_path):
    _write(tmp_path, "proc/meminfo", "MemTotal:       33554432 kB\nMemFree: 1 kB\nMemAvailable:   25165824 kB\n")
    _write(tmp_path, "proc/self/cgroup", "0::/outer/inner\n")
    _write(tmp_path, "sys/fs/cgroup/outer/memory.max", f"{16 * GiB}\n")
    _write(tmp_path, "sys/fs/cgroup/outer/memory.current", f"{4 * GiB}\n")
    _write(tmp_path, "sys/fs/cgroup/outer/inner/memory.max", "max\n")
    host = memory.read_host(str(tmp_path))
    assert host == memory.HostMemory(32 * GiB, 24 * GiB, 16 * GiB, 4 * GiB)
    assert host.size == 16 * GiB and host.free == 12 * GiB  # the limit, less what the cgroup uses
    assert memory.margin(host.size) == 2 * GiB  # an eighth
    assert memory.automatic_budget(host, held=3 * GiB) == 13 * GiB  # free + held - margin


def test_a_v1_cgroup_and_no_cgroup_at_all(tmp_path):
    _write(tmp_path, "proc/meminfo", "MemTotal: 8388608 kB\nMemAvailable: 4194304 kB\n")
    _write(tmp_path, "proc/self/cgroup", "5:cpu:/a\n4:memory:/a\n")
    _write(tmp_path, "sys/fs/cgroup/memory/a/memory.limit_in_bytes", f"{6 * GiB}\n")
    _write(tmp_path, "sys/fs/cgroup/memory/a/memory.usage_in_bytes", f"{5 * GiB}\n")
    _write(tmp_path, "sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n")  # v1's "no limit"
    host = memory.read_host(str(tmp_path))
    assert (host.size, host.free) == (6 * GiB, 1 * GiB)
    assert memory.margin(host.size) == 1 * GiB  # at least 1 GiB
    os.remove(tmp_path / "proc/self/cgroup")
    assert memory.read_host(str(tmp_path)) == memory.HostMemory(8 * GiB, 4 * GiB, None, None)


# -- which kind of memory ------------------------------------------------------------------------------------------
def _save(path, tensors):
    from safetensors.torch import save_file

    save_file(tensors, str(path))
    return str(path)


@LINUX
def test_a_view_of_a_file_mapping_is_file_backed_and_its_written_pages_are_counted(tmp_path):
    path = _save(tmp_path / "w.safetensors", {"w": torch.arange(262144, dtype=torch.float32)})
    stored = files.read_header(path)["w"]
    view = remap.view_of(remap.mapping(path), stored)
    anonymous = torch.arange(262144, dtype=torch.float32)
    found = regions.Regions.read()
    assert found.file_of(view.data_ptr()) == os.path.realpath(path)
    assert found.file_of(anonymous.data_ptr()) is None
    start = found.region_of(view.data_ptr()).start
    assert regions.written_bytes([start]) == {start: 0}
    view[:4096].add_(1)  # 16 KiB written: the kernel copies those pages
    assert 16384 <= regions.written_bytes([start])[start] <= 16384 + 2 * 4096
    assert view[0] == 1 and torch.equal(view[4096:], anonymous[4096:])
    assert remap.view_of(remap.mapping(path), stored)[0] == 0  # the file itself is untouched


def test_maps_and_smaps_lines_are_parsed_by_their_fields():
    maps = (
        "7f00a000-7f00c000 rw-p 00000000 fe:00 1234    /models/a b.safetensors\n"
        "7f00c000-7f00d000 rw-p 00000000 00:00 0 \n"
        "7f00d000-7f00e000 r--p 00000000 fe:00 99    /gone.safetensors (deleted)\n"
        "7f00e000-7f00f000 rw-s 00000000 00:05 7    /dev/zero\n"
    )
    found = regions.Regions.read(maps)
    assert found.file_of(0x7F00B000) == "/models/a b.safetensors"
    assert [found.file_of(p) for p in (0x7F00C800, 0x7F00D800, 0x7F00E800, 0x7F00F000)] == [None] * 4
    smaps = maps.splitlines()[0] + "\nSize: 8 kB\nAnonymous:             4 kB\nVmFlags: rd wr\n"
    assert regions.written_bytes([0x7F00A000], smaps) == {0x7F00A000: 4096}


# -- headers, checked -----------------------------------------------------------------------------------------------
def test_a_header_is_checked_against_the_file(tmp_path):
    path = _save(tmp_path / "ok.safetensors", {"a": torch.ones(3, 2, dtype=torch.bfloat16), "b": torch.zeros(5)})
    header = files.read_header(path)
    assert header["a"].dtype == torch.bfloat16 and header["a"].shape == (3, 2)
    assert header["a"].end - header["a"].start == 12 and header["b"].end - header["b"].start == 20
    raw = open(path, "rb").read()
    (length,) = struct.unpack("<Q", raw[:8])
    body = json.loads(raw[8 : 8 + length])

    def variant(name, change):
        data = json.loads(json.dumps(body))
        change(data)
        text = json.dumps(data).encode()
        (tmp_path / name).write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length :])
        return files.read_header(str(tmp_path / name))

    assert set(variant("short.safetensors", lambda d: d["b"].update(shape=[4]))) == {"a"}  # 16 bytes are not 20
    assert set(variant("past.safetensors", lambda d: d["b"].update(data_offsets=[12, 10**9]))) == {"a"}
    assert set(variant("dtype.safetensors", lambda d: d["b"].update(dtype="F4X"))) == {"a"}
    (tmp_path / "huge.safetensors").write_bytes(struct.pack("<Q", 10**12) + b"{}")
    (tmp_path / "text.safetensors").write_bytes(b"not a checkpoint")
    assert files.read_header(str(tmp_path / "huge.safetensors")) == {}
    assert files.read_header(str(tmp_path / "text.safetensors")) == {}


# -- re-mapping ----------------------------------------------------------------------------------------------------
class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 64)
        self.b.weight = self.a.weight  # tied
        self.register_buffer("scale", torch.full((64,), 2.0))


@LINUX
def test_only_weights_whose_bytes_agree_are_remapped(tmp_path):
    model = _Model()
    _save(
        tmp_path / "model.safetensors", {k: v.contiguous() for k, v in model.state_dict().items() if k != "b.weight"}
    )
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.b.bias.add_(1)  # changed since it was saved: it must stay as it is
    done = remap.remap(model, str(tmp_path), regions.Regions.read())
    found = regions.Regions.read()
    assert found.file_of(model.a.weight.data_ptr()) and model.b.weight is model.a.weight
    assert found.file_of(model.a.bias.data_ptr()) and found.file_of(model.scale.data_ptr())
    assert found.file_of(model.b.bias.data_ptr()) is None
    assert done.mapped == (64 * 64 + 64 + 64) * 4 and done.reasons == {
        "other bytes than the checkpoint's (changed, or converted on loading)": 64 * 4
    }
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key] + (1 if key == "b.bias" else 0))


def test_nothing_is_remapped_without_a_match(tmp_path):
    model = _Model()
    _save(tmp_path / "model.safetensors", {"a.weight": model.a.weight.detach().double().contiguous()})
    prepared = remap.prepare(model, str(tmp_path), regions.Regions.read())
    assert prepared.mapped == 0 and prepared.assignments == []
    assert prepared.reasons == {
        "in the checkpoint's files with another dtype or shape (converted on loading)": 64 * 64 * 4,  # as float64
        "not in the checkpoint's files": (64 + 64 + 64) * 4,  # the two biases, the buffer
    }


# -- loading -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("flux")
    tiny.build("flux").save_pretrained(folder)
    return str(folder)


@LINUX
def test_load_file_backed_leaves_every_weight_in_its_file(saved):
    import diffusers_offload_ext as doe

    pipe = doe.load_file_backed(saved)
    found = regions.Regions.read()
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        tensors = list(getattr(pipe, name).parameters())
        assert all(found.file_of(t.data_ptr()) for t in tensors), name
    assert torch.equal(tiny.run(pipe, "flux"), tiny.run(tiny.build("flux"), "flux"))


def test_load_file_backed_refuses_a_converting_dtype_before_loading(saved, tmp_path):
    import diffusers_offload_ext as doe

    with pytest.raises(ValueError, match=r"`torch_dtype`=torch.float16 would convert the weights of .*'transformer'"):
        doe.load_file_backed(saved, torch_dtype=torch.float16)
    with pytest.raises(ValueError, match="not a local pipeline folder"):
        doe.load_file_backed(str(tmp_path))


# -- the measurement, small ---------------------------------------------------------------------------------
@LINUX
def test_a_host_budget_keeps_anonymous_memory_within_it_over_two_calls(tmp_path):
    """0 double and 2 single blocks of width 768: a 78 MiB transformer. With an 8 MiB host budget the two calls
    grow anonymous memory by at most the budget + 48 MiB, with no offload's images; the same pipeline offloaded
    without one then grows it by the transformer's weights at its next call (what the budget saves)."""
    weights = host_rss.build(str(tmp_path), 0, 2)
    import diffusers

    reference = tiny.run(diffusers.FluxPipeline.from_pretrained(str(tmp_path)), "flux")
    found = host_rss.measure(str(tmp_path), "from_pretrained", "8MiB")
    assert all(torch.equal(image, reference) for image in found["images"])
    assert found["calls_peak"] - found["before"] <= 8 * MiB + 48 * MiB
    assert found["without"] - found["called"] >= weights * 0.9


@LINUX
def test_load_file_backed_keeps_a_bfloat16_checkpoint_in_bfloat16_and_in_its_file(tmp_path):
    import diffusers

    import diffusers_offload_ext as doe

    tiny.build("flux").to(torch.bfloat16).save_pretrained(tmp_path)
    pipe = doe.load_file_backed(str(tmp_path))
    plain = diffusers.FluxPipeline.from_pretrained(str(tmp_path))  # float32 by default: converted, anonymous
    found = regions.Regions.read()
    assert all(t.dtype == torch.bfloat16 and found.file_of(t.data_ptr()) for t in pipe.transformer.parameters())
    assert not any(found.file_of(t.data_ptr()) for t in plain.transformer.parameters())
