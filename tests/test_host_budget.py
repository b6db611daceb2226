"""`host_memory_budget` on whole pipelines saved with `save_pretrained` and loaded with `from_pretrained`: images equal
to no offload's, weights left in their files (read from the kernel's maps), anonymous weights re-mapped when over the
budget, file-backed weights copied to the device through a page-locked staging ring (on the simulated accelerator,
through the fake of page-locking and of CUDA's streams), a changed weight counted as anonymous and said once, host
bytes by kind in `offload_status` and the trace, the page-locked store's cap, and bad input refused before anything
changes."""

import sys

import pytest
import torch
from simulated_accelerator import SimulatedAccelerator

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: host budgets are not in the upstream patch")

import diffusers  # noqa: E402

import diffusers_offload_ext as doe  # noqa: E402
from diffusers_offload_ext.constants import GiB, MiB  # noqa: E402
from diffusers_offload_ext.host import memory  # noqa: E402
from diffusers_offload_ext.host.regions import Regions  # noqa: E402
from diffusers_offload_ext.testing import tiny  # noqa: E402
from diffusers_offload_ext.testing.copy_stream import fake_cuda  # noqa: E402
from diffusers_offload_ext.testing.page_locking import fake_page_locking  # noqa: E402
from harness import diffusers_logs  # noqa: E402

pytestmark = [
    pytest.mark.plugin_only,
    pytest.mark.usefixtures("installed"),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc, Linux only"),
]
NAME = "flux"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("flux")
    tiny.build(NAME).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def reference(saved):
    return tiny.run(load(saved), NAME)


def load(folder, **kwargs):
    pipe = diffusers.FluxPipeline.from_pretrained(folder, **kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def file_backed(module) -> bool:
    found = Regions.read()
    return all(found.file_of(t.data_ptr()) for t in [*module.parameters()] if t.device.type == "cpu")


def anonymous_copies(module) -> None:
    """Every weight of `module` in anonymous memory (as after an eviction that copied, or a conversion)."""
    for tensor in module.parameters():
        tensor.data = tensor.data.clone()


# -- the budget at work --------------------------------------------------------------------------------------------
def test_images_equal_no_offloads_and_the_weights_stay_in_their_files(accelerator, saved, reference):
    pipe = load(saved)
    device = accelerator.device if accelerator is not None else "cpu:0"
    pipe.enable_model_cpu_offload(device=device, host_memory_budget="4MiB")
    for _ in range(2):
        assert torch.equal(tiny.run(pipe, NAME), reference)
    assert all(file_backed(getattr(pipe, n)) for n in ("transformer", "vae", "text_encoder", "text_encoder_2"))
    records = doe.transfer_ledger(pipe).records
    assert {r.kind for r in records if r.direction == "offload"} == {"drop"}  # never copied into anonymous memory
    status = doe.offload_status(pipe)
    assert status.host_budget == 4 * MiB
    assert status.host_bytes.file_backed >= sum(c.nbytes for c in status.components.values()) * 0.99
    assert status.host_bytes.counted <= 4 * MiB
    assert status.components["transformer"].host.file_backed == status.components["transformer"].nbytes
    assert "host_memory_budget='4.00MiB'" in str(status) and "file-backed" in str(status)


def test_anonymous_weights_over_the_budget_are_remapped_onto_their_files(saved, reference, caplog):
    pipe = load(saved)
    anonymous_copies(pipe.transformer)
    assert not file_backed(pipe.transformer)
    transformer = sum(t.numel() * t.element_size() for t in pipe.transformer.parameters())
    with diffusers_logs(caplog, "INFO"):
        pipe.enable_model_cpu_offload(device="cpu:0", host_memory_budget=transformer // 2)
    assert file_backed(pipe.transformer)
    assert any("re-mapped onto their safetensors files" in r.getMessage() and "`transformer`" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    assert torch.equal(tiny.run(pipe, NAME), reference)


def test_within_the_budget_anonymous_weights_stay_as_they_are(saved):
    pipe = load(saved)
    anonymous_copies(pipe.vae)
    pipe.enable_model_cpu_offload(device="cpu:0", host_memory_budget="1GiB")
    assert not file_backed(pipe.vae)  # nothing needed re-mapping
    assert doe.offload_status(pipe).components["vae"].host.anonymous > 0


def test_file_backed_weights_reach_the_device_through_the_staging_ring(saved, reference):
    pipe = load(saved)
    tensors = sum(len([*getattr(pipe, n).parameters()]) for n in ("transformer", "vae", "text_encoder_2"))
    with fake_page_locking() as (fake, store), SimulatedAccelerator() as sim, fake_cuda() as cuda:
        # The weights themselves stay in their files (not page-locked in place, as the default would within the
        # room the budget leaves), so that the staging ring carries them.
        pipe.enable_model_cpu_offload(device=sim.device, host_memory_budget="64MiB", pin_memory=False)
        image = tiny.run(pipe, NAME)
        waits = list(cuda.waits)  # what held the host: the call's inputs and outputs only
        status = doe.offload_status(pipe)
        ring = status.host_bytes.page_locked
        h2d = [c for c in sim.copies if c.direction == "h2d" and c.op == "copy_"]
        pipe.enable_model_cpu_offload(host_memory_budget="off")
        tiny.run(pipe, NAME)
        without = cuda.waits[len(waits) :]
    assert torch.equal(image, reference)
    assert ring == 3 * 2 * MiB and all(fake.locked(p, n) for p, n in fake.registered.items())
    assert sum(c.nbytes for c in h2d) >= sum(c.nbytes for c in status.components.values()) * 0.99
    assert set(waits) <= set(without) and len(without) - len(waits) >= tensors  # pageable: one wait per weight


def test_a_changed_weight_stops_being_file_backed_and_it_is_said_once(saved, caplog):
    pipe = load(saved)
    pipe.enable_model_cpu_offload(device="cpu:0", host_memory_budget="64MiB")
    tiny.run(pipe, NAME)
    before = doe.offload_status(pipe).components["transformer"].host
    weight = pipe.transformer.proj_out.weight
    with torch.no_grad():
        weight.data.add_(1)  # written in place: the kernel copies the written pages
    pipe.transformer.x_embedder.weight.data = pipe.transformer.x_embedder.weight.data.clone()  # assigned
    with diffusers_logs(caplog, "INFO"):
        tiny.run(pipe, NAME)
        tiny.run(pipe, NAME)
    after = doe.offload_status(pipe).components["transformer"].host
    moved = after.anonymous - before.anonymous
    assert moved >= weight.numel() * 4 + pipe.transformer.x_embedder.weight.numel() * 4
    assert after.file_backed == before.file_backed - moved
    said = [r.getMessage() for r in caplog.records if "stopped being file-backed" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("`transformer`")


def test_the_trace_shows_host_bytes_by_kind_at_each_calls_end(saved):
    pipe = load(saved)
    pipe.enable_model_cpu_offload(device="cpu:0", host_memory_budget="64MiB")
    with doe.trace(pipe) as trace:
        tiny.run(pipe, NAME)
    host = trace.calls[0].host
    assert host["budget"] == 64 * MiB and host["file_backed"] > 0
    assert set(host) == {"budget", "page_locked", "anonymous", "file_backed"}
    assert doe.Trace.from_dict(trace.to_dict()).calls[0].host == host


def test_page_locking_stays_within_the_room_the_budget_leaves(saved, reference):
    pipe = load(saved)
    anonymous_copies(pipe.vae)  # counted: it leaves less room to page-lock file-backed weights
    vae = sum(t.numel() * t.element_size() for t in pipe.vae.parameters())
    budget = 3 * MiB + vae + 200 * 1024  # the ring (three buffers of 1 MiB), the VAE, and 200 KiB to page-lock
    with fake_page_locking() as (fake, store), SimulatedAccelerator() as sim:
        pipe.enable_model_cpu_offload(device=sim.device, host_memory_budget=budget, pin_memory=True)
        for _ in range(2):
            assert torch.equal(tiny.run(pipe, NAME), reference)
        status = doe.offload_status(pipe)
    assert status.host_bytes.counted <= budget
    assert status.components["transformer"].host.file_backed > 0  # over the room: it stays in its files
    assert store.pinned_bytes <= budget - vae  # the VAE's anonymous memory was page-locked in place: it counts once


# -- nothing without one -------------------------------------------------------------------------------------------
def test_without_a_host_budget_nothing_is_measured_and_evictions_copy(saved, reference):
    pipe = load(saved)
    pipe.enable_model_cpu_offload(device="cpu:0")
    assert torch.equal(tiny.run(pipe, NAME), reference)
    status = doe.offload_status(pipe)
    assert status.host_budget is None and status.host_bytes is None
    assert all(c.host is None for c in status.components.values())
    assert {r.kind for r in doe.transfer_ledger(pipe).records if r.direction == "offload"} == {"copy"}


# -- bad input, refused before anything changes ----------------------------------------------------------------------
def _unchanged(pipe, weights):
    assert not doe.offload_status(pipe).enabled
    assert all(a is b for a, b in zip(pipe.transformer.parameters(), weights))


def test_a_budget_above_the_hosts_memory_is_refused(saved, monkeypatch):
    pipe = load(saved)
    weights = list(pipe.transformer.parameters())
    monkeypatch.setattr(memory, "read_host", lambda root="/": memory.HostMemory(8 * GiB, 6 * GiB, 4 * GiB, 1 * GiB))
    with pytest.raises(
        ValueError, match=r"`host_memory_budget`='5.00 GiB' is more than this host's memory \(4.00 GiB"
    ):
        pipe.enable_model_cpu_offload(device="cpu:0", host_memory_budget="5GiB")
    _unchanged(pipe, weights)


def test_a_budget_below_what_must_stay_in_ram_is_refused(saved):
    pipe = load(saved, torch_dtype=torch.float64)  # converted on loading: anonymous, and no file holds those bytes
    weights = list(pipe.transformer.parameters())
    data = [w.data_ptr() for w in weights]
    with pytest.raises(ValueError, match=r"below what must stay in RAM: .*`transformer`: .*converted on loading"):
        pipe.enable_model_cpu_offload(device="cpu:0", host_memory_budget=512 * 1024)
    _unchanged(pipe, weights)
    assert [w.data_ptr() for w in weights] == data


@pytest.mark.parametrize(
    "value, error, match",
    [
        ("lots", ValueError, "`host_memory_budget`='lots' is not a number"),
        (True, ValueError, "must be a size in bytes, not a bool"),
        (1.5, TypeError, "must be an int"),
        ("100", ValueError, "did you mean `'100GiB'`"),
        (-4096, ValueError, "must not be negative"),
    ],
)
def test_bad_values_are_refused(saved, value, error, match):
    pipe = load(saved)
    with pytest.raises(error, match=match):
        pipe.enable_model_cpu_offload(device="cpu:0", host_memory_budget=value)
    assert not doe.offload_status(pipe).enabled


def test_zero_copy_eviction_false_is_refused_with_a_host_budget(saved):
    pipe = load(saved)
    with pytest.raises(ValueError, match="`zero_copy_eviction=False` is in force"):
        pipe.enable_model_cpu_offload(device="cpu:0", host_memory_budget="1GiB", zero_copy_eviction=False)
    pipe.enable_model_cpu_offload(device="cpu:0", zero_copy_eviction=False)
    with pytest.raises(ValueError, match="`zero_copy_eviction=False` is in force"):
        pipe.enable_model_cpu_offload(host_memory_budget="1GiB")
    assert doe.offload_status(pipe).options["host_budget"] is None


@pytest.fixture(scope="module")
def saved_deep(tmp_path_factory):
    """The tiny FLUX pipeline with a transformer of 3 + 6 blocks (it can stream in two thirds of its bytes)."""
    folder = tmp_path_factory.mktemp("flux-deep")
    pipe = tiny.build(NAME)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        config = dict(pipe.transformer.config, num_layers=3, num_single_layers=6)
        pipe.transformer = diffusers.FluxTransformer2DModel.from_config(config).eval()
    pipe.save_pretrained(folder)
    return str(folder), tiny.run(pipe, NAME)


def test_streamed_blocks_of_file_backed_weights_pass_through_the_staging_ring(saved_deep):
    saved, reference = saved_deep
    pipe = load(saved)
    budget = doe.module_nbytes(pipe.transformer) * 2 // 3  # the transformer streams its blocks
    with fake_page_locking(), SimulatedAccelerator() as sim, fake_cuda() as cuda:
        pipe.enable_model_cpu_offload(  # pageable weights: the staging ring carries them (see above)
            device=sim.device, memory_budget=budget, host_memory_budget="64MiB", pin_memory=False
        )
        image = tiny.run(pipe, NAME)
        streamed = doe.offload_status(pipe).components["transformer"].blocks
        waits = list(cuda.waits)
        pipe.enable_model_cpu_offload(host_memory_budget="off")
        tiny.run(pipe, NAME)
        without = cuda.waits[len(waits) :]
    assert torch.equal(image, reference)
    assert streamed is None  # streamed in the call, stopped at its end
    moved = [r for r in doe.transfer_ledger(pipe).records if r.block is not None and r.call_index == 0]
    copies = [w for w in waits if w.startswith("h2d copy_")]  # a streamed block's tensor copied into the ring
    assert moved and copies == [] and len([w for w in without if w.startswith("h2d copy_")]) >= len(moved) // 2


def test_without_procs_maps_a_host_budget_is_refused(saved, monkeypatch):
    from diffusers_offload_ext.host import regions

    pipe = load(saved)
    monkeypatch.setattr(regions, "_read", lambda path: "")
    with pytest.raises(ValueError, match=r"reads which host memory each weight lies in from Linux's /proc/self/maps"):
        pipe.enable_model_cpu_offload(device="cpu:0", host_memory_budget="1GiB")
    assert not doe.offload_status(pipe).enabled


def test_a_fused_lora_makes_the_fused_weights_anonymous_said_once(saved, reference, caplog):
    pytest.importorskip("peft", reason="LoRA layers need peft (in the test extra)")
    from peft import LoraConfig
    from peft.tuners.tuners_utils import BaseTunerLayer

    pipe = load(saved)
    pipe.enable_model_cpu_offload(device="cpu:0", host_memory_budget="64MiB")
    tiny.run(pipe, NAME)
    before = doe.offload_status(pipe).components["transformer"].host
    pipe.transformer.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_k"]))
    with torch.no_grad():
        for name, parameter in pipe.transformer.named_parameters():
            if "lora_B" in name:
                parameter.fill_(0.05)
    fused = 0
    for module in pipe.transformer.modules():
        if isinstance(module, BaseTunerLayer):
            module.merge()  # what fuse_lora does: base_layer.weight.data += delta, in place
            fused += module.base_layer.weight.numel() * 4
    with diffusers_logs(caplog, "INFO"):
        image = tiny.run(pipe, NAME)
        tiny.run(pipe, NAME)
    after = doe.offload_status(pipe).components["transformer"].host
    assert not torch.equal(image, reference)  # the fused LoRA changed the image
    assert after.file_backed <= before.file_backed - fused and after.anonymous >= before.anonymous + fused
    said = [r.getMessage() for r in caplog.records if "stopped being file-backed" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("`transformer`")
