"""Block streaming on a real CUDA device (skipped elsewhere; CI has no GPU): images equal to no offload with the
copies made at once, from page-locked memory (`pin_memory=True`) and on the copy stream (`prefetch=True`), with the
weights as built or loaded from safetensors files, the measured peak of allocated memory within the budget plus the
activations, and no CUDA error left behind. `tools/gpu_check.sh` runs it; what has run is in docs/benchmarks-gpu.md
(the first version of this file passed on an H200; this one, with page-locking, prefetch, safetensors weights
and kept blocks between calls, has not run on a GPU yet)."""

import pytest
import torch
from harness import max_abs_diff

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: block streaming")

import diffusers_offload_ext as doe  # noqa: E402
from diffusers_offload_ext.blocks.find import block_sizes  # noqa: E402
from diffusers_offload_ext.testing import tiny  # noqa: E402

pytestmark = [
    pytest.mark.plugin_only,
    pytest.mark.usefixtures("installed"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
NAME = "flux"
TOLERANCE = 1e-3


def deep_flux():
    from test_block_streaming import deep_flux as build

    return build()


def peak_during(run):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = run()
    torch.cuda.synchronize()
    return result, torch.cuda.max_memory_allocated() - before


OPTIONS = {
    "sync": {},
    "prefetch": {"prefetch": True},  # pin_memory not set: only page-locked memory is prefetched
    "pinned": {"pin_memory": True},
    "pinned-prefetch": {"pin_memory": True, "prefetch": True},
}


def loaded(source, tmp_path):
    """The deep tiny FLUX pipeline as built, or saved with `save_pretrained` and loaded back from its safetensors
    files (weights in file mappings, as real checkpoints are: page-locking must handle them)."""
    pipe = deep_flux()
    if source == "built":
        return pipe
    pipe.save_pretrained(tmp_path / "pipe", safe_serialization=True)
    loaded = type(pipe).from_pretrained(tmp_path / "pipe")
    loaded.set_progress_bar_config(disable=True)
    return loaded


@pytest.mark.parametrize("source", ["built", "safetensors"])
@pytest.mark.parametrize("option", OPTIONS, ids=str)
def test_streaming_on_cuda_gives_the_images_of_no_offload_within_the_budget_plus_activations(option, source, tmp_path):
    options = OPTIONS[option]
    pipe = loaded(source, tmp_path)
    weights = sum(doe.module_nbytes(m) for m in pipe.components.values() if isinstance(m, torch.nn.Module))
    pipe.to("cuda")
    reference, resident_peak = peak_during(lambda: tiny.run(pipe, NAME))
    activations = max(resident_peak, 0)  # everything resident: the peak above the weights is the activations
    pipe.to("cpu")
    budget = int(sum(block_sizes(pipe.transformer).values()) * 0.8)
    pipe.enable_model_cpu_offload(device="cuda", memory_budget=budget, **options)
    tiny.run(pipe, NAME)  # the first call learns the order
    image, peak = peak_during(lambda: tiny.run(pipe, NAME))
    assert max_abs_diff(image, reference) <= TOLERANCE
    assert [r for r in doe.transfer_ledger(pipe).records if r.block is not None]
    # Allocations round each tensor up to 512 bytes: a margin of that per tensor of the pipeline.
    tensors = sum(
        len(list(m.parameters())) + len(list(m.buffers()))
        for m in pipe.components.values()
        if isinstance(m, torch.nn.Module)
    )
    print(
        f"{option}/{source}: peak {peak} bytes with streaming, budget {budget}, activations {activations}, weights {weights}"
    )
    if options.get("pin_memory"):
        assert doe.offload_status(pipe).pinned_bytes > 0
    doe.release(pipe)
    assert torch.ones(4, device="cuda").sum().item() == 4  # no CUDA error left behind by page-locking
    assert peak <= budget + activations + 512 * tensors


@pytest.mark.parametrize("option", ["sync", "pinned-prefetch"])
def test_kept_blocks_stay_on_cuda_between_calls(option):
    """Issue 22, kept blocks between calls, on a real device: with `keep_on_device_between_generations=True` the
    third call copies only the streamed blocks, its images are those of no offload, the kept blocks are on the
    device between calls, and a release sends everything home with no CUDA error left behind."""
    pipe = deep_flux()
    pipe.to("cuda")
    reference = tiny.run(pipe, NAME)
    pipe.to("cpu")
    budget = int(sum(block_sizes(pipe.transformer).values()) * 0.8)
    pipe.enable_model_cpu_offload(
        device="cuda",
        memory_budget=budget,
        exclude_from_offload=["vae", "text_encoder", "text_encoder_2"],
        keep_on_device_between_generations=True,
        **OPTIONS[option],
    )
    images = [tiny.run(pipe, NAME) for _ in range(3)]
    assert all(max_abs_diff(image, reference) <= TOLERANCE for image in images)
    status = doe.offload_status(pipe).components["transformer"]
    assert status.resident and status.blocks is not None and status.where == "mixed"
    third = [r for r in doe.transfer_ledger(pipe).records if r.call_index == 2 and r.direction == "onload"]
    assert {r.block for r in third} == set(status.blocks.streamed)
    assert sum(r.nbytes for r in third) == tiny.STEPS_RUN[NAME] * status.blocks.bytes_per_pass
    doe.release(pipe)
    assert all(p.device.type == "cpu" for p in pipe.transformer.parameters())
    assert torch.ones(4, device="cuda").sum().item() == 4  # no CUDA error left behind
