"""What the docs left unclear, made true (issue 34, point 9): a combined pipeline enabled with no option remembers
its device; a trace loaded from its JSON equals the trace; `offload_status(pipe).chain` is the chain that evicts (an
excluded component in it); `doe.trace` of stock offload on the simulated accelerator replays its moves there."""

import pytest
import torch

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: the adapter, the trace and offload_status")

import diffusers_offload_ext as doe  # noqa: E402
import toy  # noqa: E402
from diffusers_offload_ext.observe.trace import Trace  # noqa: E402

pytestmark = pytest.mark.plugin_only


@pytest.mark.usefixtures("installed")
def test_a_combined_pipeline_enabled_without_options_remembers_its_device():
    from diffusers_offload_ext.testing import tiny_combined

    pipe = tiny_combined.build_kandinsky22_img2img_combined()
    pipe.enable_model_cpu_offload(device="cpu")  # its own method: each sub-pipeline offloaded as stock does
    assert doe.offload_status(pipe).enabled is False  # not armed by the extension (the docs say so)
    # An option later, without `device`: the device set before, as for every other pipeline (not "requires an
    # accelerator" on a machine without one).
    pipe.enable_model_cpu_offload(keep_on_device_during_generation=True)
    status = doe.offload_status(pipe)
    assert status.enabled and status.device == "cpu:0"


@pytest.mark.usefixtures("installed")
def test_a_trace_loaded_from_its_json_equals_the_trace(tmp_path):
    pipe = toy.build()
    pipe.enable_model_cpu_offload(device="cpu", keep_on_device_during_generation=True)
    with doe.trace(pipe) as recorded:
        pipe(["text_encoder", "transformer", "vae"])
    path = tmp_path / "trace.json"
    recorded.to_json(str(path))
    loaded = Trace.load(str(path))
    assert loaded == recorded and not (loaded != recorded)
    with doe.trace(pipe) as other:
        pipe(["text_encoder", "vae"])
    assert other != recorded and recorded != "a trace"


@pytest.mark.usefixtures("installed", "accelerator")
def test_the_status_chain_holds_an_excluded_component_that_still_evicts():
    pipe = toy.build()
    pipe.enable_model_cpu_offload(device="cpu", exclude_from_offload=["transformer"])
    assert doe.offload_status(pipe).chain == ("text_encoder", "text_encoder_2", "transformer", "vae")
    pipe(["text_encoder", "text_encoder_2", "transformer"])
    # The excluded transformer evicted its predecessor when it ran, as its place in the chain says.
    assert ("text_encoder_2", "room for transformer") in [
        (r.component, r.cause) for r in doe.transfer_ledger(pipe).records if r.direction == "offload"
    ]


def test_stock_offload_traced_on_the_simulated_accelerator_is_seen_there_not_replayed():
    """On the simulated accelerator `cpu:0` is a device apart from the host: stock's moves are real there, and the
    trace sees them as on CUDA (not replayed from its chain policy as on the plain CPU)."""
    from simulated_accelerator import SimulatedAccelerator

    with SimulatedAccelerator() as sim:
        pipe = toy.build()
        pipe.enable_model_cpu_offload(device="cpu")  # stock diffusers (not installed)
        before = sim.h2d_bytes
        with doe.trace(pipe) as recorded:
            pipe(["text_encoder", "transformer", "vae"])
        crossed = sim.h2d_bytes - before
    assert not recorded.replayed and recorded.device == "cpu:0"
    onloads = [r for r in recorded.records if r.direction == "onload"]
    assert [r.component for r in onloads][:3] == ["text_encoder", "transformer", "vae"]
    assert all(r.dst == "cpu:0" and r.src == "cpu" for r in onloads)
    assert [r.nbytes for r in onloads][:3] == [doe.module_nbytes(getattr(pipe, r.component)) for r in onloads[:3]]
    assert sum(r.nbytes for r in onloads[:3]) <= crossed  # they crossed the simulated bus
    # On the plain CPU the same calls are replayed, and say so.
    pipe = toy.build()
    pipe.enable_model_cpu_offload(device="cpu")
    with doe.trace(pipe) as replayed:
        pipe(["text_encoder", "transformer", "vae"])
    assert replayed.replayed and replayed.device == "cpu"
