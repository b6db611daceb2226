"""The simulated accelerator with tensor subclasses (issue 20, item 7): a wrapper subclass weight (`tests/subclass.py`,
built as torchao's and optimum-quanto's are) moves with its module, its inner tensors are on the device with it, and
what the simulator caught before it still catches: a layer on host weights with device inputs raises, and so does a
weight on the device whose inner tensors stayed on the host. The real libraries: `tests/test_quantized.py`."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import simulated_accelerator as sa  # noqa: E402
from subclass import Int8Rows, quantize_linears  # noqa: E402

MIXING = "Expected all tensors to be on the same device, but found at least two devices"


@pytest.fixture
def sim():
    with sa.SimulatedAccelerator() as simulator:
        yield simulator


def layer():
    torch.manual_seed(0)
    return quantize_linears(torch.nn.Linear(64, 16))


def test_a_wrapper_weight_moves_with_its_module_and_computes_as_on_the_host(sim):
    module, x = layer(), torch.randn(2, 64)
    expected = module(x)
    module.to(sim.device)  # Module._apply swaps wrapper parameters (torch.utils.swap_tensors)
    weight = module.weight
    assert isinstance(weight, Int8Rows) and weight.device == sim.device
    assert sim.is_on_device(weight.qdata) and sim.is_on_device(weight.scale)
    assert sim.h2d_bytes == 64 * 16 + 16 * 4 + 16 * 4  # int8 rows, scales, bias: not the dequantized size
    assert torch.equal(module(x.to(sim.device)).cpu(), expected)
    module.to("cpu")
    assert module.weight.device.type == "cpu" and not sim.is_on_device(module.weight.qdata)
    assert torch.equal(module(x), expected)


def test_a_wrapper_weight_left_on_the_host_still_raises(sim):
    module = layer()
    with pytest.raises(RuntimeError, match=MIXING):
        module(torch.randn(2, 64).to(sim.device))


def test_a_wrapper_on_the_device_with_an_inner_tensor_on_the_host_raises(sim):
    module = layer().to(sim.device)
    module.weight.scale = module.weight.scale.cpu()  # quantization state left behind, as a partial move would
    with pytest.raises(RuntimeError, match=MIXING):
        module(torch.randn(2, 64).to(sim.device))


def test_swapping_tensors_outside_the_simulator_is_torch_s_own():
    original = torch.utils.swap_tensors
    with sa.SimulatedAccelerator():
        assert torch.utils.swap_tensors is not original
    assert torch.utils.swap_tensors is original


def test_a_wrapper_moved_either_way_has_inner_tensors_of_its_own(sim):
    host = Int8Rows.quantize(torch.randn(4, 8))
    device = host.to(sim.device)  # torch runs it on the host, where the inner `.to()` copies nothing
    assert device.qdata is not host.qdata and device.qdata.data_ptr() != host.qdata.data_ptr()
    assert sim.is_on_device(device.qdata) and not sim.is_on_device(host.qdata)
    back = device.to("cpu")
    assert type(back) is Int8Rows and not sim.is_on_device(back.scale) and sim.is_on_device(device.scale)
    assert torch.equal(back.qdata, host.qdata) and back.qdata.data_ptr() != device.qdata.data_ptr()
