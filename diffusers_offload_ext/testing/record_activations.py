"""Regenerate the activation data the planner estimates a call's activations from (`models/data/activations.json`):
the device bytes a shipped model's denoiser forward and VAE decode allocate beyond their weights, counted on the
simulated accelerator (every storage made on the device, `SimulatedAccelerator(capacity=...)`) at two small sizes, as
a fixed part and a part per latent token or per output pixel. Needs torch, diffusers (>= 0.33 for Wan) and a few GiB
of host memory; about five minutes on two cores.

    python -m diffusers_offload_ext.testing.record_activations            # rewrite the data
    python -m diffusers_offload_ext.testing.record_activations --check    # compare only; exit 1 when it differs

A denoiser is built with one block of each kind (`num_layers=1`, `num_single_layers=1`: under `torch.no_grad()` the
blocks run one after another, so more of them add nothing at the peak) with random weights; the SDXL UNet whole.
Latent tokens are the denoiser's input positions (`models.activations.latent_tokens`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, Tuple

from ..models.activations import ACTIVATIONS_PATH, FORMAT, VERSION, latent_tokens
from ..models.specs import load_spec

#: The two sizes each part is measured at: (height, width, frames).
SIZES = {"image": ((256, 256, 1), (512, 512, 1)), "video": ((128, 128, 81), (256, 256, 81))}
VAE_SIZES = {"image": ((128, 128, 1), (256, 256, 1)), "video": ((64, 64, 5), (128, 128, 5))}
#: What the simulator counts is fitted as bytes = fixed + per_unit * units; the shipped models measured, and the
#: denoiser batch their pipelines run (classifier-free guidance in one batch: SDXL, SD3; FLUX.1 is guidance-distilled
#: and Wan runs the unconditional forward apart).
MODELS = {
    "flux-dev": ("transformer", 1),
    "sd3.5-large": ("transformer", 2),
    "sdxl": ("unet", 2),
    "wan2.1-t2v-14b": ("transformer", 1),
}
#: Models that share another's architecture (and so its activations).
SAME_AS = {"flux-schnell": "flux-dev", "wan2.2-t2v-a14b": "wan2.1-t2v-14b"}


def _build(entry: dict, shrink: bool):
    import diffusers
    import torch

    config = {k: v for k, v in entry["config"].items() if not k.startswith("_")}
    if shrink:
        config.update({k: 1 for k in ("num_layers", "num_single_layers") if k in config})
    with torch.device("meta"):
        module = getattr(diffusers, entry["class"]).from_config(config)
    module = module.to_empty(device="cpu").to(getattr(torch, entry["dtype"])).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tensor in module.state_dict().values():
            if tensor.is_floating_point():
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.02)
    return module


def _inputs(model: str, entry: dict, batch: int, height: int, width: int, frames: int) -> dict:
    import torch

    dtype = getattr(torch, entry["dtype"])
    config = entry["config"]
    latent = (height // 8, width // 8)

    def noise(*shape):
        return torch.randn(*shape, dtype=dtype)

    if entry["class"] == "FluxTransformer2DModel":
        n = latent[0] // 2 * (latent[1] // 2)
        return dict(hidden_states=noise(batch, n, config["in_channels"]), encoder_hidden_states=noise(batch, 512, 4096),
                    pooled_projections=noise(batch, 768), timestep=torch.ones(batch), img_ids=torch.zeros(n, 3),
                    txt_ids=torch.zeros(512, 3), guidance=torch.full((batch,), 3.5))  # fmt: skip
    if entry["class"] == "SD3Transformer2DModel":
        return dict(hidden_states=noise(batch, 16, *latent), encoder_hidden_states=noise(batch, 333, 4096),
                    pooled_projections=noise(batch, 2048), timestep=torch.ones(batch))  # fmt: skip
    if entry["class"] == "UNet2DConditionModel":
        added = {"text_embeds": noise(batch, 1280), "time_ids": torch.zeros(batch, 6, dtype=dtype)}
        return dict(sample=noise(batch, 4, *latent), timestep=torch.ones(batch),
                    encoder_hidden_states=noise(batch, 77, 2048), added_cond_kwargs=added)  # fmt: skip
    if entry["class"] == "WanTransformer3DModel":
        return dict(hidden_states=noise(batch, 16, (frames - 1) // 4 + 1, *latent), timestep=torch.ones(batch),
                    encoder_hidden_states=noise(batch, 512, 4096))  # fmt: skip
    raise ValueError(f"no inputs for {entry['class']} of {model}")


def _peak(module, inputs: dict, run) -> int:
    """Device bytes allocated beyond the weights and inputs while `run(module, inputs)` runs on the simulator."""
    import torch

    from .simulated_accelerator import SimulatedAccelerator

    with SimulatedAccelerator(capacity=1 << 50) as sim, torch.no_grad():
        module.to(sim.device)
        moved = {k: _to(v, sim.device) for k, v in inputs.items()}
        before = sim.allocated_bytes
        sim.reset_peak()
        run(module, moved)
        peak = sim.peak_bytes - before
        module.to("cpu")
    return peak


def _to(value, device):
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value.to(device)


def _fit(points) -> Tuple[int, int]:
    """`(fixed, per_unit)` of the line through two `(units, bytes)` points (neither below 0)."""
    (u0, b0), (u1, b1) = points
    per_unit = max((b1 - b0) / (u1 - u0), 0.0)
    return max(int(round(b0 - per_unit * u0)), 0), int(round(per_unit))


def measure(model: str) -> dict:
    """The activation entry of `model`: its denoiser per latent token and its VAE decode per output pixel."""
    import torch

    spec = load_spec(model)
    denoiser, batch = MODELS[model]
    kind = "video" if spec["components"]["vae"]["class"] == "AutoencoderKLWan" else "image"
    entry = spec["components"][denoiser]
    module = _build(entry, shrink=entry["class"] != "UNet2DConditionModel")
    points = []
    for height, width, frames in SIZES[kind]:
        inputs = _inputs(model, entry, batch, height, width, frames)
        points.append((latent_tokens(model, height, width, frames), _peak(module, inputs, lambda m, i: m(**i))))
    del module
    fixed, per_token = _fit(points)
    vae_entry = spec["components"]["vae"]
    vae = _build(vae_entry, shrink=False)
    dtype = getattr(torch, vae_entry["dtype"])
    channels = vae_entry["config"].get("z_dim") or vae_entry["config"]["latent_channels"]
    vae_points = []
    for height, width, frames in VAE_SIZES[kind]:
        shape = (1, channels, (frames - 1) // 4 + 1) if kind == "video" else (1, channels)
        latents = {"z": torch.randn(*shape, height // 8, width // 8, dtype=dtype)}
        vae_points.append((height * width, _peak(vae, latents, lambda m, i: m.decode(i["z"]))))
    vae_fixed, per_pixel = _fit(vae_points)
    return {
        "denoiser": {"component": denoiser, "batch": batch, "fixed_bytes": fixed, "bytes_per_token": per_token,
                     "measured": [list(p) for p in points]},
        "vae": {"fixed_bytes": vae_fixed, "bytes_per_pixel": per_pixel, "video": kind == "video",
                "dtype": vae_entry["dtype"], "measured": [list(p) for p in vae_points]},
    }  # fmt: skip


def record() -> Dict[str, dict]:
    from importlib.metadata import version

    import torch

    threads = torch.get_num_threads()
    models = {}
    for model in MODELS:
        print(f"measuring {model}", file=sys.stderr)
        models[model] = measure(model)
    torch.set_num_threads(threads)
    for model, same in SAME_AS.items():
        models[model] = {"same_as": same}
    return {
        "format": FORMAT,
        "version": VERSION,
        "recorded_with": {p: version(p) for p in ("torch", "diffusers")},
        "models": models,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the shipped data; write nothing")
    args = parser.parse_args(argv)
    data = record()
    if args.check:
        with open(ACTIVATIONS_PATH, encoding="utf-8") as f:
            shipped = json.load(f)
        same = shipped["models"] == data["models"]
        print("activation data: " + ("unchanged" if same else "differs"))
        return 0 if same else 1
    with open(ACTIVATIONS_PATH, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    print(f"wrote {os.path.relpath(ACTIVATIONS_PATH)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
