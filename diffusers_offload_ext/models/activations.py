"""A call's activations estimated before any download: the device bytes a shipped model's denoiser forward and its
VAE decode need beyond their weights, for a height, width and frame count, from the shipped activation data
(`data/activations.json`) and one GPU measurement that calibrates it. No torch.

The formula, per component (`estimate`):

    bytes = (fixed + per_unit * units) * gpu_ratio

- `units`: the denoiser's latent tokens (`latent_tokens`: one per 16x16 pixels for FLUX.1, SD3 and Wan, per 8x8 for
  the SDXL UNet, and per 4 frames after the first for Wan), or the VAE's output pixels per frame (Wan's VAE decodes
  four frames at a time: its part per pixel holds them, and the decoded video, kept twice while it grows, adds
  `2 * frames * 3 * height * width` elements in the VAE's dtype).
- `fixed`, `per_unit`: fitted through two small sizes counted on the simulated accelerator (every storage the
  forward makes on the device; `python -m diffusers_offload_ext.testing.record_activations`), the denoiser with one
  block of each kind at its real width, in the pipeline's batch (2 where classifier-free guidance is batched).
- `gpu_ratio`: what CUDA's allocator counted over the simulator's count for FLUX.1-dev at 512x512 on an H200
  (`docs/benchmarks-gpu.md`, run 1, `max_memory_allocated` less the weights: 201 MB in the transformer's phase of
  stock offload, 693 MB in the call without offload, where the VAE decode is the peak; convolution workspaces are
  the VAE's extra). Used for every model: the others were not measured on a GPU.

The plan's reserve is the largest component's estimate with the runtime's margin (`residency.reserve.reserve_for`),
labelled estimated; `--activations` replaces it with a measured figure.
"""

from __future__ import annotations

import functools
import json
import math
import os
from typing import Mapping, Optional

from .errors import PlanError
from .recorded import DATA_DIR
from .specs import load_spec

FORMAT = "diffusers-offload-activations"
VERSION = 1
ACTIVATIONS_PATH = os.path.join(DATA_DIR, "activations.json")
#: CUDA's count over the simulator's, measured once (FLUX.1-dev, 512x512, H200; see the module docstring).
GPU_RATIO = {"denoiser": round(201_151_872 / 162_048_004, 2), "vae": round(693_302_738 / 402_653_184, 2)}
GPU_SOURCE = (
    "docs/benchmarks-gpu.md, run 1: FLUX.1-dev at 512x512 on an H200 allocated 201 MB beyond the weights in the "
    "transformer's phase and 693 MB in the VAE decode, against 162 MB and 403 MB counted on the simulated accelerator"
)
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
#: Largest height, width and frame count accepted (a 16K frame; ten minutes of video at 24 frames a second).
MAX_SIDE, MAX_FRAMES = 16_384, 14_401


@functools.lru_cache(maxsize=1)
def activation_data() -> dict:
    with open(ACTIVATIONS_PATH, encoding="utf-8") as f:
        data = json.load(f)
    if data.get("format") != FORMAT or data.get("version") != VERSION:
        raise PlanError(f"{ACTIVATIONS_PATH} is not {FORMAT} version {VERSION}.")
    return data


def latent_tokens(model: str, height: int, width: int, frames: int = 1) -> int:
    """The denoiser's input positions for a call of `height` x `width` (and `frames`) of shipped model `model`."""
    token = load_spec(model).get("latent_token") or {}
    pixels, per = int(token.get("pixels", 16)), token.get("frames")
    latent_frames = (max(frames, 1) - 1) // int(per) + 1 if per else 1
    return latent_frames * math.ceil(height / pixels) * math.ceil(width / pixels)


def entry_of(model: str) -> Optional[dict]:
    """The activation data of shipped model `model` (`None` for a model without any, such as a spec file's)."""
    models = activation_data()["models"]
    entry = models.get(model)
    return models.get(entry["same_as"]) if entry and "same_as" in entry else entry


def estimate(model: str, height: int, width: int, frames: int = 1) -> Optional[dict]:
    """Estimated activations of one call of `model`, per component part (`denoiser`, `vae`), in bytes, and the
    largest; `None` when the model has no activation data."""
    entry = entry_of(model)
    if entry is None:
        return None
    denoiser, vae = entry["denoiser"], entry["vae"]
    tokens = latent_tokens(model, height, width, frames)
    parts = {
        denoiser["component"]: (denoiser["fixed_bytes"] + denoiser["bytes_per_token"] * tokens)
        * GPU_RATIO["denoiser"],
        "vae": (vae["fixed_bytes"] + vae["bytes_per_pixel"] * height * width) * GPU_RATIO["vae"]
        + (2 * frames * 3 * height * width * ITEMSIZE[vae["dtype"]] if vae["video"] else 0),
    }
    parts = {name: int(nbytes) for name, nbytes in parts.items()}
    largest = max(parts, key=parts.get)
    return {"parts": parts, "largest": largest, "bytes": parts[largest], "tokens": tokens}


def call_defaults(spec: Mapping) -> dict:
    """The steps, height, width and frames a call of the model gets when it passes none, and where they come from."""
    call = dict(spec.get("call") or {})
    return {
        "steps": int(call.get("steps", 28)),
        "height": call.get("height"),
        "width": call.get("width"),
        "frames": call.get("frames"),
        "source": call.get("source", "the planner's defaults"),
    }
