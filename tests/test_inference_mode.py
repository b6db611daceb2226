"""Pipelines called under `torch.inference_mode()`, as servers call them (issue 20): every option runs, with images
equal to the same call under `torch.no_grad()` without offload, on the plain CPU and the simulated accelerator, and an
edit made to the weights under inference mode is never lost by an eviction without a copy."""

import pytest
import torch
from harness import max_abs_diff

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: the residency options")

import diffusers_offload_ext as doe  # noqa: E402
from diffusers_offload_ext.blocks.find import block_sizes  # noqa: E402
from diffusers_offload_ext.testing import tiny  # noqa: E402

pytestmark = [pytest.mark.plugin_only, pytest.mark.usefixtures("installed")]
NAME = "flux"
STREAMS = "streams"  # replaced by a budget below the transformer (its blocks stream)

OPTIONS = {
    "defaults": {},
    "exclude": {"exclude_from_offload": ["transformer"]},
    "keep-during": {"keep_on_device_during_generation": True},
    "keep-between": {"keep_on_device_between_generations": True},
    "budget-fits": {"memory_budget": "1GiB"},
    "zero-copy": {"zero_copy_eviction": True},
    "zero-copy-keep-during": {"zero_copy_eviction": True, "keep_on_device_during_generation": True},
    "prefetch": {"keep_on_device_between_generations": True, "prefetch": True},
    "budget-streams": {"memory_budget": STREAMS, "keep_on_device_between_generations": True},
    "budget-streams-prefetch": {"memory_budget": STREAMS, "prefetch": True},
}


def build(weights="ordinary"):
    """The tiny FLUX pipeline with a deeper transformer, so that a budget below it has blocks to stream; with
    `weights="inference"` built under `torch.inference_mode()`, as a server that loads inside it does: its weights
    are inference tensors (no version counter, no in-place edit outside inference mode)."""
    from test_block_streaming import deep_flux

    if weights == "inference":
        with torch.inference_mode():
            return deep_flux()
    return deep_flux()


WEIGHTS = ["ordinary", "inference"]


@pytest.fixture(scope="module")
def reference():
    with torch.no_grad():
        return tiny.run(build(), NAME)


def resolved(pipe, options):
    if options.get("memory_budget") != STREAMS:
        return options
    return {**options, "memory_budget": int(sum(block_sizes(pipe.transformer).values()) * 0.8)}


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("option", OPTIONS, ids=str)
def test_every_option_runs_under_inference_mode_with_the_image_of_no_offload(accelerator, reference, option, weights):
    pipe = build(weights)
    options = resolved(pipe, OPTIONS[option])
    pipe.enable_model_cpu_offload(device="cpu", **options)
    for _ in range(3):
        with torch.inference_mode():
            image = tiny.run(pipe, NAME)
        assert max_abs_diff(image, reference) == 0.0
    if option.startswith("budget-streams"):
        streamed = [r for r in doe.transfer_ledger(pipe).records if r.block is not None]
        assert streamed, "the transformer did not stream"
        if weights == "ordinary":  # version counters seen: an unchanged block is dropped, never copied back
            assert {r.kind for r in streamed if r.direction == "offload"} == {"drop"}
    doe.release(pipe)
    if accelerator is not None:  # an excluded component stays on the device, as in stock
        offloaded = {n: m for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
        if option == "exclude":
            offloaded.pop("transformer")
        assert all(accelerator.where(m) == "host" for m in offloaded.values())


EDITED = {"kept": "proj_out", "streamed": "single_transformer_blocks.3.proj_out"}


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("where", ["kept", "streamed"])
@pytest.mark.parametrize("zero_copy", [False, True], ids=["copy", "zero-copy"])
def test_an_edit_made_under_inference_mode_survives_the_eviction(accelerator, zero_copy, where, weights):
    pipe = build(weights)
    budget = "1GiB" if where == "kept" else int(sum(block_sizes(pipe.transformer).values()) * 0.8)
    pipe.enable_model_cpu_offload(
        device="cpu", memory_budget=budget, keep_on_device_between_generations=True, zero_copy_eviction=zero_copy
    )
    layer = pipe.transformer.get_submodule(EDITED[where])
    edited = []

    def edit(p, step, timestep, kwargs):  # an in-place edit of the weight, made inside inference mode
        if step == 0:
            layer.weight.mul_(2)
            edited.append(layer.weight.detach().to("cpu").clone())
        return kwargs

    with torch.inference_mode():
        pipe(**tiny.call_kwargs(NAME, pipe=pipe), callback_on_step_end=edit)
    doe.release(pipe)
    assert torch.equal(layer.weight.detach().to("cpu"), edited[0])
