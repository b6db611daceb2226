"""The shipped activation data the planner estimates a call's activations from (`models/activations.py`): its
measured points lie on its lines, a fresh count on the simulated accelerator at a third size falls on them, and the
estimate is the documented formula (issue 34, point 3)."""

import pytest

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: the planner")

from diffusers_offload_ext.models.activations import GPU_RATIO, activation_data, entry_of, estimate  # noqa: E402
from diffusers_offload_ext.models.specs import load_spec, shipped_models  # noqa: E402
from diffusers_offload_ext.testing import record_activations  # noqa: E402

pytestmark = pytest.mark.plugin_only


def test_every_shipped_model_has_activation_data_whose_points_lie_on_its_lines():
    for model in shipped_models():
        entry = entry_of(model)
        assert entry is not None, model
        denoiser, vae = entry["denoiser"], entry["vae"]
        assert denoiser["component"] in load_spec(model)["components"]
        for units, nbytes in denoiser["measured"]:
            assert denoiser["fixed_bytes"] + denoiser["bytes_per_token"] * units == pytest.approx(nbytes, rel=1e-3)
        for units, nbytes in vae["measured"]:
            assert vae["fixed_bytes"] + vae["bytes_per_pixel"] * units == pytest.approx(nbytes, rel=1e-3)
    assert set(activation_data()["models"]) == set(shipped_models())


def test_a_fresh_count_at_a_third_size_falls_on_the_shipped_line():
    """FLUX.1's VAE decode at 64x64 (the data was counted at 128x128 and 256x256): the simulator's count now equals
    the line's prediction, so the data is what the recorder measures (and a changed decoder shows here)."""
    import torch

    vae_entry = load_spec("flux-dev")["components"]["vae"]
    vae = record_activations._build(vae_entry, shrink=False)
    latents = {"z": torch.randn(1, 16, 8, 8, dtype=torch.bfloat16)}
    counted = record_activations._peak(vae, latents, lambda m, i: m.decode(i["z"]))
    line = entry_of("flux-dev")["vae"]
    assert counted == pytest.approx(line["fixed_bytes"] + line["bytes_per_pixel"] * 64 * 64, rel=0.02)


def test_the_estimate_is_the_documented_formula():
    entry = entry_of("wan2.1-t2v-14b")
    found = estimate("wan2.1-t2v-14b", 480, 832, 81)
    tokens = 21 * 30 * 52  # (81 - 1) / 4 + 1 latent frames of 480/16 x 832/16 tokens
    denoiser = entry["denoiser"]
    assert found["tokens"] == tokens
    assert found["parts"]["transformer"] == int(
        (denoiser["fixed_bytes"] + denoiser["bytes_per_token"] * tokens) * GPU_RATIO["denoiser"]
    )
    vae = entry["vae"]
    decoded = 2 * 81 * 3 * 480 * 832 * 4  # the float32 video, twice while it grows
    assert found["parts"]["vae"] == int(
        (vae["fixed_bytes"] + vae["bytes_per_pixel"] * 480 * 832) * GPU_RATIO["vae"] + decoded
    )
    assert found["largest"] == "vae" and found["bytes"] == found["parts"]["vae"]
    # The calibration: CUDA counted more than the simulator, for both parts, on FLUX.1-dev at 512x512.
    assert 1 < GPU_RATIO["denoiser"] < GPU_RATIO["vae"] < 2
