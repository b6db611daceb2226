"""Block streaming under `torch.compile` (issue 22, item 7): the streamer's hooks are excluded from tracing
(`torch.compiler.disable`), so a compiled transformer runs them as they are, at the blocks' boundaries, and Dynamo never
traces into them (they swap parameters' `.data`, read version counters and data pointers). On the CPU with
`backend="eager"` (Dynamo's tracing and graph breaks, no code generation); CUDA graphs are not tested here."""

import pytest
import torch
from harness import max_abs_diff

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: block streaming")

import diffusers_offload_ext as doe  # noqa: E402
from diffusers_offload_ext.blocks.find import block_sizes  # noqa: E402
from diffusers_offload_ext.testing import tiny  # noqa: E402

pytestmark = [pytest.mark.plugin_only, pytest.mark.usefixtures("installed")]


def test_a_compiled_transformer_streams_with_the_images_of_no_offload_and_breaks_only_at_disabled_hooks():
    from torch._dynamo.utils import counters
    from test_block_streaming import deep_flux

    reference = tiny.run(deep_flux(), "flux")
    pipe = deep_flux()
    budget = int(sum(block_sizes(pipe.transformer).values()) * 0.8)
    torch._dynamo.reset()
    counters.clear()
    try:
        pipe.transformer.compile(backend="eager")
        pipe.enable_model_cpu_offload(device="cpu", memory_budget=budget)
        images = [tiny.run(pipe, "flux") for _ in range(3)]
        breaks, captured = dict(counters["graph_break"]), counters["stats"]["calls_captured"]
    finally:
        torch._dynamo.reset()
    assert [r for r in doe.transfer_ledger(pipe).records if r.block is not None]  # it streamed
    assert all(max_abs_diff(image, reference) == 0.0 for image in images)
    assert captured > 0  # the blocks' own code was compiled
    assert any("BlockStreamer" in reason for reason in breaks)  # our hooks are where the graphs end
    # Every break is at a function excluded from tracing: none inside the hooks' code.
    assert all("torch.compiler.disable" in reason for reason in breaks), list(breaks)
