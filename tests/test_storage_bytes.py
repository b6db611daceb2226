"""Bytes from the real storages (issue 20, item 1), without a quantization library: `doe.module_nbytes`, block sizes,
the ledger and `offload_status` count the storages behind a component's tensors, through a wrapper subclass
(`tests/subclass.py`, as torchao and optimum-quanto weights are) and the quantization state a parameter carries as
attributes (as bitsandbytes' `quant_state` is), each storage once. The same against the real libraries:
`tests/test_quantized.py`."""

import types

import pytest
import torch
from harness import max_abs_diff
from subclass import Int8Rows, quantize_linears, true_bytes

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: byte counts")

import diffusers_offload_ext as doe  # noqa: E402
from diffusers_offload_ext.blocks.find import block_sizes  # noqa: E402
from diffusers_offload_ext.testing import tiny  # noqa: E402

pytestmark = pytest.mark.plugin_only
NAME = "flux"


class StatefulParameter(torch.nn.Parameter):
    """A parameter carrying more tensors as attributes, the way bitsandbytes' `Params4bit.quant_state` does."""


def test_plain_tensors_count_their_elements_and_tied_weights_once():
    first, second = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    second.weight = first.weight
    model = torch.nn.Sequential(first, second)
    assert doe.module_nbytes(model) == (32 + 4 + 4) * 4


def test_views_count_what_they_use_of_a_storage():
    storage = torch.zeros(100)
    module = torch.nn.Module()
    module.register_buffer("head", storage[:10])
    assert doe.module_nbytes(module) == 10 * 4  # a slice moves its own bytes, not its storage's
    module.register_buffer("tail", storage[10:])
    assert doe.module_nbytes(module) == 100 * 4  # two views that split a storage: the storage, once
    module.register_buffer("again", storage[:10])
    assert doe.module_nbytes(module) == 100 * 4  # a second view of the same bytes adds nothing


def test_a_wrapper_subclass_counts_its_inner_tensors_not_its_dequantized_size():
    layer = quantize_linears(torch.nn.Linear(64, 32))
    assert isinstance(layer.weight, Int8Rows)
    assert layer.weight.numel() * layer.weight.element_size() == 64 * 32 * 4  # what a naive count says
    assert doe.module_nbytes(layer) == 64 * 32 + 32 * 4 + 32 * 4  # int8 rows, float32 scales, the bias


def test_quantization_state_held_as_attributes_counts_and_a_back_reference_is_not_followed():
    layer = torch.nn.Linear(16, 4, bias=False)
    weight = StatefulParameter(torch.zeros(32, dtype=torch.uint8), requires_grad=False)
    nested = types.SimpleNamespace(absmax=torch.zeros(2, dtype=torch.uint8), code=torch.zeros(256))
    weight.quant_state = types.SimpleNamespace(absmax=torch.zeros(4), code=torch.zeros(16), state2=nested)
    weight.module = torch.nn.Linear(1000, 1000)  # Params4bit keeps its layer: never walked into
    layer.weight = weight
    assert doe.module_nbytes(layer) == 32 + 4 * 4 + 16 * 4 + 2 + 256 * 4


def test_blocks_on_meta_have_the_sizes_of_the_real_ones():
    pipe = tiny.build(NAME)
    with torch.device("meta"):
        meta = type(pipe.transformer).from_config(pipe.transformer.config)
    assert block_sizes(meta) == block_sizes(pipe.transformer)
    assert sum(block_sizes(meta).values()) == doe.module_nbytes(pipe.transformer)


def quantized_flux():
    pipe = tiny.build(NAME)
    quantize_linears(pipe.transformer, min_features=32)
    return pipe


@pytest.mark.usefixtures("installed")
def test_ledger_status_and_blocks_count_the_storages_of_a_quantized_component(accelerator):
    reference = tiny.run(quantized_flux(), NAME)
    pipe = quantized_flux()
    expected = true_bytes(pipe.transformer)
    assert expected < 0.5 * sum(t.numel() * t.element_size() for t in pipe.transformer.parameters())
    assert doe.module_nbytes(pipe.transformer) == expected
    assert sum(block_sizes(pipe.transformer).values()) == expected
    pipe.enable_model_cpu_offload(device="cpu")
    assert max_abs_diff(tiny.run(pipe, NAME), reference) == 0.0
    assert doe.offload_status(pipe).components["transformer"].nbytes == expected
    moves = [r for r in doe.transfer_ledger(pipe).records if r.component == "transformer"]
    assert [r.direction for r in moves] == ["onload", "offload"]
    assert all(r.nbytes == expected for r in moves)
    if accelerator is not None:
        assert accelerator.where(pipe.transformer) == "host"
        accelerator.reset_counters()
        pipe.transformer.to(accelerator.device)  # what crosses the simulated bus: the inner tensors' bytes
        assert accelerator.h2d_bytes == expected
