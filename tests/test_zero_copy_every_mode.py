"""`zero_copy_eviction=True` outside the residency manager: the defaults, `exclude_from_offload` and
`keep_on_device_during_generation` make exactly the moves they make today, only an unchanged component's eviction
drops its device copy instead of copying it back; a change made on the device is still copied back. Run on the
simulated accelerator, where device copies are distinct tensors and the bytes that cross are counted."""

import pytest
import torch
from simulated_accelerator import SimulatedAccelerator

pytest.importorskip(
    "diffusers_offload_ext", reason="plugin-only: eviction without copies is not in the upstream patch"
)

import diffusers_offload_ext as doe  # noqa: E402
from diffusers_offload_ext.testing import tiny  # noqa: E402

pytestmark = pytest.mark.plugin_only
TOLERANCE = 1e-3


def denoiser(pipe):
    return "transformer" if "transformer" in pipe.components else "unet"


MODES = {
    "defaults": lambda pipe: {},
    "exclude": lambda pipe: {"exclude_from_offload": [denoiser(pipe)]},
    "keep": lambda pipe: {"keep_on_device_during_generation": True},
}


def generate(name, mode, zero_copy, callback=None):
    """One offloaded call on the simulator: (image, ledger records, bytes copied device-to-host)."""
    pipe = tiny.build(name)
    with SimulatedAccelerator() as sim:
        options = MODES[mode](pipe)
        if zero_copy is not None:
            options["zero_copy_eviction"] = zero_copy
        pipe.enable_model_cpu_offload(device="cpu", **options)
        doe.transfer_ledger(pipe).clear()
        before = sim.d2h_bytes
        kwargs = tiny.call_kwargs(name, pipe=pipe)
        if callback is not None:
            kwargs.update(callback_on_step_end=callback)
        image = pipe(**kwargs).images.cpu()
        d2h = sim.d2h_bytes - before
    return pipe, image, doe.transfer_ledger(pipe).records, d2h


@pytest.fixture(scope="module")
def reference():
    return {name: tiny.run(tiny.build(name), name) for name in ("sd15", "flux")}


@pytest.mark.usefixtures("installed")
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", ["sd15", "flux"])
def test_same_moves_without_the_copies(name, mode, reference):
    _, copied_image, copied, copied_d2h = generate(name, mode, zero_copy=False)
    _, image, dropped, d2h = generate(name, mode, zero_copy=True)
    # which component moves when: unchanged
    assert [(r.component, r.direction, r.call_index) for r in dropped] == [
        (r.component, r.direction, r.call_index) for r in copied
    ]
    offloads = [r for r in dropped if r.direction == "offload"]
    assert offloads and {r.kind for r in offloads} == {"drop"}
    assert {r.kind for r in copied if r.direction == "offload"} == {"copy"}
    # exactly the evictions' bytes no longer cross back
    assert copied_d2h - d2h == sum(r.nbytes for r in copied if r.direction == "offload")
    assert (image - reference[name]).abs().max() <= TOLERANCE
    assert (copied_image - reference[name]).abs().max() <= TOLERANCE


@pytest.mark.usefixtures("installed")
@pytest.mark.parametrize("mode", sorted(MODES))
def test_not_set_means_drops_on_an_accelerator_in_every_mode(mode):
    """Issue 31: on an accelerator (here the simulated one) `zero_copy_eviction` not set drops, in every mode."""
    _, _, records, d2h = generate("sd15", mode, zero_copy=None)
    _, _, explicit, explicit_d2h = generate("sd15", mode, zero_copy=True)
    assert {r.kind for r in records if r.direction == "offload"} == {"drop"}
    moves = [(r.component, r.direction, r.nbytes, r.call_index, r.kind) for r in records]
    assert moves == [(r.component, r.direction, r.nbytes, r.call_index, r.kind) for r in explicit]
    assert d2h == explicit_d2h  # the image alone crosses


@pytest.mark.usefixtures("installed")
@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_change_made_on_the_device_is_copied_back(mode):
    """A step callback edits, in place, the first weight of a component that is on the device at step 0 and evicted
    later (the UNet; with the UNet excluded, the VAE, which a preview decode puts on the device: the text encoder
    left when the excluded UNet started): that eviction copies, and the host holds the edited weight."""
    edited = "vae" if mode == "exclude" else "unet"
    seen = []

    def edit(pipe, step, timestep, kwargs):
        if step == 0:
            if edited == "vae":
                tiny.preview_callback("sd15")(pipe, step, timestep, kwargs)
            weight = next(getattr(pipe, edited).parameters())
            seen.append(weight.device)
            with torch.no_grad():
                weight.add_(1.0)
        return kwargs

    original = next(getattr(tiny.build("sd15"), edited).parameters()).detach().clone()
    pipe, _, records, _ = generate("sd15", mode, zero_copy=True, callback=edit)
    assert seen == [torch.device("cpu", 0)]  # the edit was made on the (simulated) device
    assert [r.kind for r in records if r.component == edited and r.direction == "offload"] == ["copy"]
    others = {r.kind for r in records if r.component != edited and r.direction == "offload"}
    assert others == {"drop"}
    weight = next(getattr(pipe, edited).parameters())
    assert weight.device == torch.device("cpu")
    torch.testing.assert_close(weight.detach(), original + 1.0)
