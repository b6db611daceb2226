"""Wrapper subclass weights (`tests/subclass.py`'s `Int8Rows`, built as torchao's and optimum-quanto's are: inner
tensors named by `__tensor_flatten__`) without a quantization library (issue 20, items 3 and 4): their blocks stream
through the ring, an unchanged component is evicted without a copy, and an edit of an inner tensor on the device is
never lost. The same with the real libraries: `tests/test_quantized.py`."""

import pytest
import torch
from harness import max_abs_diff
from subclass import Int8Rows, quantize_linears

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: block streaming and zero-copy eviction")

import diffusers_offload_ext as doe  # noqa: E402
from diffusers_offload_ext.blocks.find import block_sizes  # noqa: E402
from diffusers_offload_ext.storages import tensor_parts  # noqa: E402
from diffusers_offload_ext.testing import tiny  # noqa: E402

pytestmark = [pytest.mark.plugin_only, pytest.mark.usefixtures("installed")]
NAME = "flux"


def quantized_deep_flux():
    from test_block_streaming import deep_flux

    pipe = deep_flux()
    quantize_linears(pipe.transformer, min_features=32)
    return pipe


def first_wrapper(module):
    return next(m for m in module.modules() if isinstance(getattr(m, "weight", None), Int8Rows))


def host_parts(module):
    return [part for tensor in [*module.parameters(), *module.buffers()] for part in tensor_parts(tensor)]


def test_wrapper_weights_stream_through_the_ring_with_the_images_of_no_offload(accelerator):
    reference = tiny.run(quantized_deep_flux(), NAME)
    pipe = quantized_deep_flux()
    sizes = block_sizes(pipe.transformer)
    wrapped = [m for m in pipe.transformer.modules() if isinstance(getattr(m, "weight", None), Int8Rows)]
    pipe.enable_model_cpu_offload(device="cpu", memory_budget=int(sum(sizes.values()) * 0.8))
    images = [tiny.run(pipe, NAME) for _ in range(2)]
    streamed = [r for r in doe.transfer_ledger(pipe).records if r.block is not None and r.component == "transformer"]
    assert streamed and all(r.nbytes == sizes[r.block] for r in streamed)  # the inner tensors' bytes
    assert all(max_abs_diff(image, reference) == 0.0 for image in images)
    assert all(isinstance(m.weight, Int8Rows) for m in wrapped)  # still the host's own wrappers
    if accelerator is not None:  # every inner tensor home after the calls
        assert not [part for part in host_parts(pipe.transformer) if accelerator.is_on_device(part)]


def test_an_edit_of_an_inner_tensor_of_a_streamed_block_is_copied_back(accelerator):
    pipe = quantized_deep_flux()
    block = pipe.transformer.single_transformer_blocks[-1]
    layer, edited = first_wrapper(block), []

    def edit(module, args, output):
        if not edited:
            with torch.no_grad():
                layer.weight.scale.mul_(2)
            edited.append(layer.weight.scale.detach().cpu().clone())

    block.register_forward_hook(edit)
    budget = int(sum(block_sizes(pipe.transformer).values()) * 0.8)
    pipe.enable_model_cpu_offload(device="cpu", memory_budget=budget)
    tiny.run(pipe, NAME)
    status_blocks = [r.block for r in doe.transfer_ledger(pipe).records if r.block is not None]
    assert "single_transformer_blocks.3" in status_blocks  # it streamed (or was kept: both must keep the edit)
    assert torch.equal(layer.weight.scale.detach().cpu(), edited[0])


def test_an_unchanged_wrapper_component_is_dropped_and_an_edit_of_its_scale_is_kept(accelerator):
    from test_storage_bytes import quantized_flux

    pipe = quantized_flux()
    before = [t.clone() for t in host_parts(pipe.transformer)]
    pipe.enable_model_cpu_offload(device="cpu", zero_copy_eviction=True)
    tiny.run(pipe, NAME)
    offloads = [r for r in doe.transfer_ledger(pipe).records if r.direction == "offload"]
    assert {r.kind for r in offloads if r.component == "transformer"} == {"drop"}
    assert all(torch.equal(a, b) for a, b in zip(host_parts(pipe.transformer), before))

    layer, edited = first_wrapper(pipe.transformer), []

    def edit(p, step, timestep, kwargs):
        if step == 0:
            with torch.no_grad():
                layer.weight.scale.add_(1)
            edited.append(layer.weight.scale.detach().cpu().clone())
        return kwargs

    pipe(**tiny.call_kwargs(NAME, pipe=pipe), callback_on_step_end=edit)
    last = [r for r in doe.transfer_ledger(pipe).records if r.component == "transformer"][-1]
    assert (last.direction, last.kind) == ("offload", "copy")
    assert torch.equal(layer.weight.scale.detach().cpu(), edited[0])
    if accelerator is not None:
        assert not [part for part in host_parts(pipe.transformer) if accelerator.is_on_device(part)]
