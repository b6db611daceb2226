"""Out-of-memory recovery and the learnt activations through `transfer/memory.py`'s readings: on a real CUDA device
when there is one (`tools/gpu_check.sh` runs this file; it has not run on a GPU yet), and everywhere on the simulated
accelerator with a capacity, whose counts back the same readings (`testing/device_memory.py`). One test body, so that
the GPU check runs what the CPU suite proves: an error injected in the transformer is recovered with the image of no
offload, the first call of the shape is measured (each component's activations, the automatic budget's reserve from
them), and the next call of the shape leaves the allocator's peak alone."""

import contextlib

import pytest
import torch
from harness import max_abs_diff
from simulated_accelerator import SimulatedAccelerator

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: out-of-memory recovery")

import diffusers_offload_ext as doe  # noqa: E402
from diffusers_offload_ext.residency import reserve as reserve_module  # noqa: E402
from diffusers_offload_ext.testing.device_memory import out_of_memory, simulated_memory  # noqa: E402
from diffusers_offload_ext.transfer import memory  # noqa: E402

pytestmark = [pytest.mark.plugin_only, pytest.mark.usefixtures("installed")]
#: A tensor made before the second call: the peak read after it is at least this when the call did not reset it.
SPIKE = 16 << 20


@contextlib.contextmanager
def execution_device(kind):
    if kind == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
        yield torch.device("cuda", torch.cuda.current_device())
        return
    with SimulatedAccelerator(capacity=64 << 20) as sim, simulated_memory(sim):
        yield sim.device


@pytest.mark.parametrize("kind", ["simulated", "cuda"])
def test_a_recovery_and_what_the_first_call_of_a_shape_teaches_read_through_the_device_readings(kind, monkeypatch):
    from test_out_of_memory import call, deep_flux, forced

    monkeypatch.setattr(reserve_module, "MARGIN_FLOOR", 16 << 10)  # the tiny pipeline's activations are small
    with execution_device(kind) as device:
        pipe = deep_flux()
        pipe.to(device)
        reference = call(pipe, 32)
        pipe.to("cpu")
        pipe.enable_model_cpu_offload(
            device=device, memory_reserve=1 << 20, keep_on_device_between_generations=True, zero_copy_eviction=False
        )
        with out_of_memory(pipe.transformer.x_embedder) as injected:
            first = call(pipe, 32)
        spike = torch.empty(SPIKE, dtype=torch.uint8, device=device)
        del spike
        second = call(pipe, 32)
        peak = memory.peak_bytes(device)
        status = doe.offload_status(pipe)
    tolerance = 1e-3 if kind == "cuda" else 0.0
    assert max_abs_diff(first, reference) <= tolerance and max_abs_diff(second, reference) <= tolerance
    (learnt,) = status.learnt
    assert injected.raised and learnt.recoveries == 1 and forced(pipe)
    assert set(learnt.activations) == {"text_encoder", "text_encoder_2", "transformer", "vae"}
    assert min(learnt.activations.values()) > 0, learnt.activations
    # The reserve in force since the second call: the least any component needs, and a margin.
    assert status.reserve == learnt.reserve == min(reserve_module.reserve_for(a) for a in learnt.activations.values())
    assert peak >= SPIKE  # the second call was not measured: the peak was not reset
