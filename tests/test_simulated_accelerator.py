"""The simulated accelerator (diffusers_offload_ext/testing/simulated_accelerator.py): under it the CPU behaves like a
separate device, so that a layer left on the host crashes a CPU test as it crashes on CUDA. Its own semantics first,
then on the tiny pipelines with stock diffusers: placement that works on CUDA works, placement that crashes crashes."""

from __future__ import annotations

import copy
import gc
import inspect
import os
import sys
import weakref

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import simulated_accelerator as sa  # noqa: E402
import tiny_pipelines as tiny  # noqa: E402

HOST = torch.device("cpu")
MIXING = "Expected all tensors to be on the same device, but found at least two devices"
PIPELINES = ("flux", "sd15", "sdxl")


@pytest.fixture
def sim():
    with sa.SimulatedAccelerator() as simulator:
        yield simulator


def _dev(sim, *shape, dtype=torch.float32):
    """A tensor on the simulated device, and the counters cleared."""
    tensor = torch.arange(float(torch.Size(shape).numel()), dtype=dtype).reshape(shape).to(sim.device)
    sim.reset_counters()
    return tensor


# ------------------------------------------------------------------------------------------------------ moves


def test_to_device_is_a_tagged_copy_and_to_device_again_is_the_same_tensor(sim):
    x = torch.ones(4)
    d = x.to(sim.device)
    assert d is not x and d.data_ptr() != x.data_ptr()
    assert (d.device, x.device) == (sim.device, HOST)
    d.add_(1)  # a copy: the host tensor is unchanged
    assert x.tolist() == [1.0] * 4
    for target in (sim.device, "cpu:0", torch.device("cpu", 0)):
        assert d.to(target) is d
    assert d.to(sim.device, torch.float32) is d
    assert len(sim.copies) == 1


def test_to_host_is_an_untagged_copy_and_host_to_host_is_what_torch_returns(sim):
    d = _dev(sim, 4)
    for h in (d.to("cpu"), d.cpu(), d.to(HOST), d.to(torch.ones(1))):
        assert h.device == HOST and h.data_ptr() != d.data_ptr() and not sim.is_on_device(h)
    x = torch.ones(3)
    assert x.cpu() is x and x.to("cpu") is x
    assert d.device == sim.device


def test_to_other_tensor_follows_its_device(sim):
    d, x = _dev(sim, 3), torch.ones(3, dtype=torch.float64)
    moved = x.to(d)
    assert moved.device == sim.device and moved.dtype == torch.float32
    assert d.to(x).device == HOST and d.to(x).dtype == torch.float64
    assert [c.direction for c in sim.copies] == ["h2d", "d2h", "d2h"]


def test_dtype_conversions_keep_the_place(sim):
    d, x = _dev(sim, 3), torch.ones(3)
    for convert in (torch.Tensor.half, torch.Tensor.double, torch.Tensor.bfloat16, torch.Tensor.float):
        assert convert(d).device == sim.device and convert(x).device == HOST
    assert d.to(torch.float16).device == sim.device and d.type(torch.float64).device == sim.device
    assert d.to(dtype=torch.float16).device == sim.device
    assert sim.copies == ()  # no bus crossed


def test_counters_exact_bytes_and_reset(sim):
    d = torch.ones(10).to(sim.device)  # 40 bytes
    torch.ones(3, dtype=torch.float16).to(sim.device)  # 6 bytes
    d.to(sim.device)  # already there: nothing
    d.cpu()  # 40 bytes back
    torch.ones(2, dtype=torch.float64).to(sim.device, torch.float16)  # arrives as 2 halves: 4 bytes
    assert (sim.h2d_bytes, sim.d2h_bytes, sim.h2d_count, sim.d2h_count) == (50, 40, 3, 1)
    assert sim.copies == (
        ("h2d", 40, False, "to"),
        ("h2d", 6, False, "to"),
        ("d2h", 40, False, "cpu"),
        ("h2d", 4, False, "to"),
    )
    with pytest.raises(AttributeError):
        sim.h2d_bytes = 0  # read-only
    sim.reset_counters()
    assert (sim.h2d_bytes, sim.d2h_bytes, sim.h2d_count, sim.d2h_count, sim.copies) == (0, 0, 0, 0, ())


def test_copy_between_devices_is_allowed_and_counted(sim):
    d, x = _dev(sim, 4), torch.full((4,), 7.0)
    d.copy_(x)
    assert d.device == sim.device and d.tolist() == [7.0] * 4
    x.copy_(d * 2)
    assert x.device == HOST and x.tolist() == [14.0] * 4
    assert [(c.direction, c.nbytes, c.op) for c in sim.copies] == [("h2d", 16, "copy_"), ("d2h", 16, "copy_")]


# ---------------------------------------------------------------------------------------------- what it says


def test_device_reporting(sim):
    d, x = _dev(sim, 2, 2), torch.ones(2)
    assert d.device == sim.device == torch.device("cpu", 0) and x.device == HOST
    assert (d.get_device(), x.get_device()) == (0, -1)
    assert sim.is_on_device(d) and not sim.is_on_device(x)
    # results of ops follow their inputs, views included
    for result in (d + 1, d.t(), d[0], d.view(4), d.sum(), *d.chunk(2), d.data):
        assert result.device == sim.device
    assert (x + 1).device == HOST
    meta = d.to("meta")  # another device altogether: what torch says
    assert meta.device.type == "meta" and not sim.is_on_device(meta)


def test_numpy_needs_a_host_copy(sim):
    d = _dev(sim, 3)
    with pytest.raises(TypeError, match="Tensor.cpu"):
        d.numpy()
    assert d.cpu().numpy().tolist() == [0.0, 1.0, 2.0]


def test_factories_with_device_and_like_functions(sim):
    d, x = _dev(sim, 2), torch.ones(2)
    on_device = [
        torch.zeros(3, device=sim.device),
        torch.arange(3, device="cpu:0"),
        torch.tensor([1.0], device=torch.device("cpu", 0)),
        torch.zeros_like(d),
        torch.randn_like(d),
        d.new_zeros(2),
        d.new_tensor([1.0, 2.0]),
        x.new_ones(2, device=sim.device),
    ]
    on_host = [torch.zeros(3), torch.zeros(3, device="cpu"), torch.zeros_like(x), torch.zeros_like(d, device="cpu")]
    assert [t.device for t in on_device] == [sim.device] * len(on_device)
    assert [t.device for t in on_host] == [HOST] * len(on_host)
    moved = torch.as_tensor(x, device=sim.device)  # torch would hand back x itself
    assert moved.device == sim.device and moved.data_ptr() != x.data_ptr() and x.device == HOST


def test_parameter_of_a_device_tensor_is_on_the_device(sim):
    assert torch.nn.Parameter(_dev(sim, 2)).device == sim.device
    assert torch.nn.Parameter(torch.ones(2)).device == HOST


def test_type_as_deepcopy_and_view_as_follow_their_source(sim):
    d, x = _dev(sim, 2), torch.ones(2, dtype=torch.float64)
    assert x.type_as(d).device == sim.device and d.type_as(x).device == HOST  # type_as moves, as on CUDA
    host_copy, device_copy = copy.deepcopy([x, d])  # the memo holds both: no mixing
    assert d.view_as(x).device == sim.device and x.expand_as(d).device == HOST  # only the other's size is used
    assert (host_copy.device, device_copy.device) == (HOST, sim.device)


def test_tags_are_weak_and_per_object(sim):
    d = _dev(sim, 3)
    ref = weakref.ref(d)
    del d
    gc.collect()
    assert ref() is None  # the simulator keeps nothing alive
    assert not any(sim.is_on_device(torch.ones(3)) for _ in range(100))  # nor tags whatever reuses the address
    d = _dev(sim, 3)
    alias = torch.Tensor(d.untyped_storage())  # another object over the same storage, made without a torch call
    assert sim.is_on_device(d) and not sim.is_on_device(alias)


# ----------------------------------------------------------------------------------------------------- modules


def _module():
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    module.eval()
    module.register_buffer("scale", torch.full((3,), 2.0), persistent=False)
    return module


def test_module_to_round_trip_keeps_parameter_objects_with_new_storage(sim):
    module = _module()
    params = list(module.parameters())
    before = {id(p): (p.data_ptr(), p.detach().clone()) for p in params}
    assert sim.where(module) == "host"
    module.to(sim.device)
    assert list(module.parameters()) == params  # the same Parameter objects (identity)
    assert all(p.data_ptr() != before[id(p)][0] for p in params)  # holding new storage
    assert sim.where(module) == "device" and {p.device for p in params} == {sim.device}
    assert {b.device for b in module.buffers()} == {sim.device}  # running stats and the plain buffer
    nbytes = sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
    assert sim.h2d_bytes == nbytes and sum(c.is_parameter for c in sim.copies) == len(params)
    sim.reset_counters()
    module.to(sim.device)  # already there: nothing moves
    assert sim.copies == () and sim.where(module) == "device"
    module.to("cpu")
    assert list(module.parameters()) == params and sim.where(module) == "host" and sim.d2h_bytes == nbytes
    assert all(torch.equal(p.detach(), before[id(p)][1]) for p in params)


def test_module_to_a_tensor_and_where(sim):
    module = _module()
    torch.nn.Module.to(module, _dev(sim, 1))
    assert sim.where(module) == "device"
    module[1].to("cpu")
    assert (sim.where(module), sim.where(module[0]), sim.where(module[1])) == ("mixed", "device", "host")
    assert sim.where(torch.nn.ReLU()) == "empty"


# ------------------------------------------------------------------------------------------------------ mixing


def test_linear_with_host_weight_and_device_input_raises(sim):
    layer = torch.nn.Linear(4, 3)
    with pytest.raises(RuntimeError, match=MIXING + r".*linear"):
        layer(_dev(sim, 2, 4))
    layer.to(sim.device)
    assert layer(_dev(sim, 2, 4)).device == sim.device
    with pytest.raises(RuntimeError, match=MIXING):
        layer(torch.ones(2, 4))


def test_host_scalars_mix_with_device_tensors_but_nothing_else_does(sim):
    d = _dev(sim, 3)
    assert (d * torch.tensor(2.0)).device == sim.device  # a 0-dim host tensor: CUDA allows it
    assert torch.where(d > 0, d, torch.tensor(0.0)).device == sim.device
    for mixing in (
        lambda: d + torch.ones(3),
        lambda: torch.cat([d, torch.ones(3)]),
        lambda: torch.ones(3).add_(d),
        lambda: torch.ones(3) * torch.tensor(2.0, device=sim.device),  # a device scalar with a host tensor: no
    ):
        with pytest.raises(RuntimeError, match=MIXING):
            mixing()


def test_in_place_ops_keep_their_place(sim):
    d, x = _dev(sim, 3), torch.ones(3)
    assert d.mul_(torch.tensor(3.0)) is d and d.device == sim.device
    assert x.add_(torch.tensor(1.0)) is x and x.device == HOST


def test_indexing_with_host_indices_is_allowed_and_device_indices_into_host_are_not(sim):
    d, x = _dev(sim, 4), torch.arange(4.0)
    assert d[torch.tensor([0, 2])].tolist() == [0.0, 2.0] and d[torch.tensor([0, 2])].device == sim.device
    assert d[torch.tensor([True, False, True, False])].device == sim.device
    assert x[torch.tensor(1, device=sim.device)].item() == 1.0  # a 0-dim index is an integer
    with pytest.raises(RuntimeError, match=MIXING):
        x[torch.tensor([0, 1], device=sim.device)]
    d[torch.tensor([0])] = torch.tensor(9.0)
    d.index_put_((torch.tensor([1]),), torch.tensor(8.0))
    assert d.tolist()[:2] == [9.0, 8.0] and d.device == sim.device
    with pytest.raises(RuntimeError, match=MIXING):
        d.index_put_((torch.tensor([1]),), torch.ones(1))


def test_nesting_raises_and_the_outer_one_keeps_working(sim):
    with pytest.raises(RuntimeError, match="cannot be nested"):
        with sa.SimulatedAccelerator():
            pass
    assert _dev(sim, 2).device == sim.device


def test_exit_restores_torch():
    with sa.SimulatedAccelerator() as simulator:
        d = torch.ones(2).to(simulator.device)
        assert d.device == simulator.device
    assert "_make_subclass" not in torch.Tensor.__dict__
    assert d.device == HOST and (d + torch.ones(2)).device == HOST  # no simulation outside
    with sa.SimulatedAccelerator():  # can be entered again
        pass


# -------------------------------------------------------------------------------------------- tiny pipelines


def _pipeline(name):
    ok, reason = tiny.available(name)
    if not ok:
        pytest.skip(reason)
    return tiny.build(name)


def _modules(pipe):
    return {k: v for k, v in pipe.components.items() if isinstance(v, torch.nn.Module)}


def _close(image, reference):
    assert image.device == HOST and image.shape == reference.shape
    assert (image - reference).abs().max().item() <= 1e-3


@pytest.mark.parametrize("name", PIPELINES)
def test_pipeline_moved_to_the_device_gives_the_cpu_image(name):
    pipe = _pipeline(name)
    reference = tiny.run(pipe, name)
    with sa.SimulatedAccelerator() as sim:
        pipe.to(sim.device)
        assert set(map(sim.where, _modules(pipe).values())) == {"device"}
        image = tiny.run(pipe, name)
        assert sim.d2h_bytes > 0 and sim.is_on_device(pipe.vae.decoder.conv_out.weight)
    _close(image, reference)


@pytest.mark.parametrize("name", PIPELINES)
def test_stock_model_offload_works_as_on_cuda(name):
    pipe = _pipeline(name)
    reference = tiny.run(pipe, name)
    denoiser = "transformer" if "transformer" in pipe.components else "unet"
    during = []

    def record(pipe, step, timestep, kwargs):
        during.append({k: sim.where(m) for k, m in _modules(pipe).items()})
        return kwargs

    with sa.SimulatedAccelerator() as sim:
        pipe.enable_model_cpu_offload(device="cpu")
        assert pipe._execution_device == sim.device
        sim.reset_counters()
        kwargs = tiny.call_kwargs(name, pipe=pipe)
        images = pipe(**kwargs, callback_on_step_end=record).images
        assert sim.is_on_device(images)
        image = images.cpu()
        # The chain evicted the text encoders when the denoiser came in; the VAE is not in yet.
        expected = {k: "device" if k == denoiser else "host" for k in _modules(pipe)}
        assert during == [expected] * tiny.STEPS_RUN[name]
        assert set(map(sim.where, _modules(pipe).values())) == {"host"}  # all offloaded after the call
        # Every model was moved in exactly once: its parameters, no more.
        moved = sum(c.nbytes for c in sim.copies if c.is_parameter and c.direction == "h2d")
        assert moved == sum(p.numel() * p.element_size() for m in _modules(pipe).values() for p in m.parameters())
        pipe.vae.to("cpu")
        again = tiny.run(pipe, name)  # the VAE's hook moves it back
    _close(image, reference)
    _close(again, reference)


@pytest.mark.parametrize("name", PIPELINES)
def test_stock_hook_recovers_a_denoiser_evicted_mid_call(name):
    """A denoiser moved to the host by a step callback is moved back by its hook (the plugin's reads the weights;
    the patch keeps accelerate's own `CpuOffload`, which does too)."""
    pipe = _pipeline(name)
    reference = tiny.run(pipe, name)
    denoiser = "transformer" if "transformer" in pipe.components else "unet"

    def evict(pipe, step, timestep, kwargs):
        getattr(pipe, denoiser).to("cpu")
        return kwargs

    with sa.SimulatedAccelerator() as sim:
        pipe.enable_model_cpu_offload(device="cpu")
        image = pipe(**tiny.call_kwargs(name, pipe=pipe), callback_on_step_end=evict).images.cpu()
        assert sim.copies  # the simulator was in the loop
    _close(image, reference)


def _moves_latents_to_the_vae(pipe):
    """Newer diffusers (0.42 for Flux and SDXL) move the latents to the VAE's device before decoding: a VAE placed
    apart from the rest is supported there, on CUDA as under the simulator."""
    return "get_module_execution_device(self.vae)" in inspect.getsource(type(pipe).__call__)


@pytest.mark.parametrize("name", PIPELINES)
def test_vae_left_on_the_host_raises_unless_the_pipeline_moves_the_latents(name):
    pipe = _pipeline(name)
    reference = tiny.run(pipe, name)
    with sa.SimulatedAccelerator() as sim:
        pipe.to(sim.device)
        pipe.vae.to("cpu")
        if not _moves_latents_to_the_vae(pipe):
            with pytest.raises(RuntimeError, match=MIXING):  # where depends on the version: the text encoder or VAE
                tiny.run(pipe, name)
            pipe.vae.to(sim.device)  # the control: placed right, it runs
            assert tiny.run(pipe, name).shape == tiny.expected_shape(name)
            return
        sim.reset_counters()
        image = tiny.run(pipe, name)
        kwargs = tiny.call_kwargs(name)
        height, width = kwargs["height"] // pipe.vae_scale_factor, kwargs["width"] // pipe.vae_scale_factor
    _close(image, reference)
    latents = 4 * pipe.vae.config.latent_channels * height * width  # float32 (1, C, h, w)
    assert ("d2h", latents) in [(c.direction, c.nbytes) for c in sim.copies]  # the pipeline brought them over


def _first_layer(pipe):
    """The denoiser and the name of its input layer."""
    if "transformer" in pipe.components:
        return pipe.transformer, "x_embedder"
    return pipe.unet, "conv_in"


@pytest.mark.parametrize("name", PIPELINES)
def test_replaced_submodule_left_on_the_host_raises(name):
    pipe = _pipeline(name)
    with sa.SimulatedAccelerator() as sim:
        pipe.to(sim.device)
        denoiser, layer = _first_layer(pipe)
        replacement = copy.deepcopy(getattr(denoiser, layer)).to("cpu")  # a fresh layer, built on the host
        setattr(denoiser, layer, replacement)
        assert sim.where(denoiser) == "mixed" and sim.where(replacement) == "host"
        with pytest.raises(RuntimeError, match=MIXING):
            tiny.run(pipe, name)
        replacement.to(sim.device)
        assert sim.where(denoiser) == "device"
        assert tiny.run(pipe, name).shape == tiny.expected_shape(name)
