"""Block streaming on a real CUDA device (skipped elsewhere; CI has no GPU): images equal to no offload with the
copies made at once and on the copy stream (`prefetch=True`), and the measured peak of allocated memory within the
budget plus the activations. Not run in this project's sessions so far (see docs/residency.md)."""

import pytest
import torch
from harness import max_abs_diff

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: block streaming")

import diffusers_offload_ext as doe  # noqa: E402
from diffusers_offload_ext.blocks import block_sizes  # noqa: E402
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


@pytest.mark.parametrize("prefetch", [False, True])
def test_streaming_on_cuda_gives_the_images_of_no_offload_within_the_budget_plus_activations(prefetch):
    pipe = deep_flux()
    weights = sum(doe.module_nbytes(m) for m in pipe.components.values() if isinstance(m, torch.nn.Module))
    pipe.to("cuda")
    reference, resident_peak = peak_during(lambda: tiny.run(pipe, NAME))
    activations = max(resident_peak, 0)  # everything resident: the peak above the weights is the activations
    pipe.to("cpu")
    budget = int(sum(block_sizes(pipe.transformer).values()) * 0.8)
    pipe.enable_model_cpu_offload(device="cuda", memory_budget=budget, prefetch=prefetch)
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
    print(f"peak {peak} bytes with streaming, budget {budget}, activations {activations}, weights {weights}")
    assert peak <= budget + activations + 512 * tensors
