"""Tiny, offline, deterministic diffusers pipelines for the test suite, the demo and the model-data recorder.

Every pipeline is assembled from randomly initialised components (40k-150k
parameters per pipeline in all), so building one takes a few tens of milliseconds
on a CPU (the first build in a process also pays for imports, ~1-2 s) and a call
(2-3 denoising steps on a 16x16 or 32x32 image) about 20-50 ms with one thread.
Nothing is downloaded: tokenizers are built in memory (or from files written to a
temporary directory that is removed again right away).

Public API (the rest of the suite imports these names):

* ``PIPELINES``: the names known here.
* ``available(name)``: ``(True, "")`` or ``(False, reason)`` for the installed diffusers.
* ``build(name)``: a fresh float32 pipeline on the CPU, no offload enabled.
* ``call_kwargs(name, seed=0, preview=False, pipe=None)``: kwargs for ``pipe(**kw)``.
* ``preview_callback(name)``: a ``callback_on_step_end`` that decodes the current
  latents with ``pipe.vae`` every step ("live preview") and records the decoded shape
  in ``pipe._tiny_previews``.
* ``run(pipe, name, seed=0, preview=False)``: calls the pipeline and returns the images
  as a float32 CPU tensor (``(B, C, H, W)``; ``(B, F, C, H, W)`` for Wan videos).
* ``STEPS_RUN[name]``: denoising steps (= preview callbacks) one call runs.
* ``expected_shape(name)``: the shape ``run`` returns for a pipeline from ``build``.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable

import torch

import diffusers

try:
    from .tiny_models import _BUILDERS, _MAX_SEQUENCE_LENGTH, _WAN_BOUNDARY_RATIO, _init_params
except ImportError:  # loaded by path, outside the package (`tests/tiny_pipelines.py` loads its parts first)
    from _tiny_models import _BUILDERS, _MAX_SEQUENCE_LENGTH, _WAN_BOUNDARY_RATIO, _init_params

PIPELINES: tuple[str, ...] = (
    "sd15",
    "sdxl",
    "sd3",
    "flux",
    "flux_img2img",
    "wan21",
    "wan22",
    "sd_controlnet",
)

PROMPT = "a photo of a red cat riding a horse on mars"

# Image sizes (height, width) and step counts used by ``call_kwargs``.
_SIZE = {
    "sd15": (32, 32),
    "sdxl": (32, 32),
    "sd3": (32, 32),
    "flux": (32, 32),
    "flux_img2img": (32, 32),
    "wan21": (16, 16),
    "wan22": (16, 16),
    "sd_controlnet": (32, 32),
}
_STEPS = {
    "sd15": 2,
    "sdxl": 2,
    "sd3": 2,
    "flux": 2,
    # 4 scheduled steps at strength 0.5: the last 2 of them run (the input image matters).
    "flux_img2img": 4,
    "wan21": 2,
    # 3 steps with boundary_ratio 0.875 (boundary t=875): timesteps ~(1000, 751, 9)
    # with shift 3, so `transformer` runs step 0 and `transformer_2` steps 1 and 2.
    "wan22": 3,
    "sd_controlnet": 2,
}
# Denoising steps that actually run (= callback_on_step_end calls) per call.
STEPS_RUN = {name: steps for name, steps in _STEPS.items()}
STEPS_RUN["flux_img2img"] = 2
_IMG2IMG_STRENGTH = 0.5
_WAN_FRAMES = 5

# --------------------------------------------------------------------------------------
# availability
# --------------------------------------------------------------------------------------

_CLASSES = {
    "sd15": ("StableDiffusionPipeline", "UNet2DConditionModel", "AutoencoderKL"),
    "sdxl": ("StableDiffusionXLPipeline", "UNet2DConditionModel", "AutoencoderKL"),
    "sd3": ("StableDiffusion3Pipeline", "SD3Transformer2DModel", "AutoencoderKL"),
    "flux": ("FluxPipeline", "FluxTransformer2DModel", "AutoencoderKL"),
    "flux_img2img": ("FluxImg2ImgPipeline", "FluxTransformer2DModel", "AutoencoderKL"),
    "wan21": ("WanPipeline", "WanTransformer3DModel", "AutoencoderKLWan"),
    "wan22": ("WanPipeline", "WanTransformer3DModel", "AutoencoderKLWan"),
    "sd_controlnet": (
        "StableDiffusionControlNetPipeline",
        "ControlNetModel",
        "UNet2DConditionModel",
    ),
}


def available(name: str) -> tuple[bool, str]:
    """Whether pipeline ``name`` can be built with the installed diffusers/transformers."""
    if name not in PIPELINES:
        raise KeyError(f"unknown tiny pipeline {name!r}; known: {PIPELINES}")
    version = diffusers.__version__
    missing = [c for c in _CLASSES[name] if not hasattr(diffusers, c)]
    if missing:
        return False, (
            f"{name}: diffusers {version} lacks {', '.join(missing)}"
            + (" (WanPipeline needs diffusers>=0.33)" if name.startswith("wan") else "")
        )
    if name.startswith("wan"):
        import transformers

        if not hasattr(transformers, "UMT5EncoderModel"):
            version = transformers.__version__
            return False, f"{name}: transformers {version} lacks UMT5EncoderModel"
    if name == "wan22":
        params = _init_params(diffusers.WanPipeline)
        if "transformer_2" not in params or "boundary_ratio" not in params:
            return False, (
                f"wan22: WanPipeline in diffusers {version} has no "
                "transformer_2/boundary_ratio (Wan 2.2 two-expert denoising needs a "
                "newer diffusers)"
            )
    return True, ""


def _require(name: str) -> None:
    ok, reason = available(name)
    if not ok:
        raise RuntimeError(reason)


def build(name: str):
    """A fresh tiny pipeline: float32, all on the CPU, no offload, eval mode.

    Weights depend only on ``name`` (``torch.manual_seed`` before each component); the
    caller's global torch RNG state is left as it was."""
    _require(name)
    with torch.random.fork_rng(devices=[]):
        return _BUILDERS[name]()


# --------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------


def _input_image(height: int, width: int, seed: int = 1234) -> torch.Tensor:
    """A fixed smooth RGB image in [0, 1], shape (1, 3, H, W)."""
    g = torch.Generator("cpu").manual_seed(seed)
    coarse = torch.rand(1, 3, max(height // 4, 1), max(width // 4, 1), generator=g)
    return torch.nn.functional.interpolate(coarse, size=(height, width), mode="bilinear", align_corners=False)


def call_kwargs(name: str, *, seed: int = 0, preview: bool = False, pipe: Any = None) -> dict:
    """Keyword arguments for ``pipe(**kw)``.

    ``pipe`` is optional; when it is a ``DiffusionPipeline``, its class must be the one
    ``build(name)`` makes (a subclass is fine) and keyword arguments its ``__call__``
    does not accept are rejected early with a clear error. Other objects (wrappers)
    are not checked."""
    if name not in PIPELINES:
        raise KeyError(f"unknown tiny pipeline {name!r}; known: {PIPELINES}")
    height, width = _SIZE[name]
    kw: dict[str, Any] = dict(
        prompt=PROMPT,
        num_inference_steps=_STEPS[name],
        height=height,
        width=width,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type="pt",
    )
    if name in ("sd3", "flux", "flux_img2img", "wan21", "wan22"):
        kw["max_sequence_length"] = _MAX_SEQUENCE_LENGTH
    if name == "flux_img2img":
        kw["image"] = _input_image(height, width)
        kw["strength"] = _IMG2IMG_STRENGTH
    if name == "sd_controlnet":
        kw["image"] = _input_image(height, width, seed=4321)
    if name in ("wan21", "wan22"):
        kw["num_frames"] = _WAN_FRAMES
        kw["negative_prompt"] = "blurry bad quality"
    if preview:
        kw["callback_on_step_end"] = preview_callback(name)
        kw["callback_on_step_end_tensor_inputs"] = ["latents"]
    if isinstance(pipe, diffusers.DiffusionPipeline):
        expected = getattr(diffusers, _CLASSES[name][0])
        if not isinstance(pipe, expected):
            raise TypeError(f"{name}: expected a {expected.__name__}, got {type(pipe).__name__}")
        params = inspect.signature(type(pipe).__call__).parameters
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            unknown = sorted(k for k in kw if k not in params)
            if unknown:
                raise TypeError(f"{type(pipe).__name__}.__call__ lacks {unknown}")
    return kw


# --------------------------------------------------------------------------------------
# live preview
# --------------------------------------------------------------------------------------


def _vae_input_device(vae: torch.nn.Module, latents: torch.Tensor) -> torch.device:
    """Where the VAE wants its inputs: an offload hook's execution device if one is
    attached, else where the latents already are (the pipeline's execution device)."""
    for module in vae.modules():
        device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
        if device is not None:
            return torch.device(device)
    return latents.device


def _unpack_flux(latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(B, (h/2)*(w/2), C*4) packed tokens -> (B, C, h, w) latent image."""
    b, n, c4 = latents.shape
    h2, w2 = height // 2, width // 2
    if h2 * w2 != n:  # not the default size: assume a square latent
        side = math.isqrt(n)
        if side * side != n:
            raise ValueError(f"cannot unpack {n} Flux tokens into a latent image")
        h2 = w2 = side
    x = latents.reshape(b, h2, w2, c4 // 4, 2, 2)
    x = x.permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c4 // 4, h2 * 2, w2 * 2)


def _denormalize(name: str, pipe, latents: torch.Tensor) -> torch.Tensor:
    cfg = pipe.vae.config
    if name in ("wan21", "wan22"):
        shape = (1, cfg.z_dim, 1, 1, 1)
        mean = torch.tensor(cfg.latents_mean).view(shape).to(latents)
        std = torch.tensor(cfg.latents_std).view(shape).to(latents)
        return latents * std + mean
    if name in ("flux", "flux_img2img"):
        h, w = _SIZE[name]
        scale = 2 ** (len(cfg.block_out_channels) - 1)
        latents = _unpack_flux(latents, h // scale, w // scale)
    latents = latents / cfg.scaling_factor
    shift = getattr(cfg, "shift_factor", None)
    if shift is not None and name in ("sd3", "flux", "flux_img2img"):
        latents = latents + shift
    return latents


def preview_callback(name: str) -> Callable:
    """A ``callback_on_step_end`` that decodes the step's latents with ``pipe.vae``
    (as a UI's live preview does), appends the decoded tensor's shape to
    ``pipe._tiny_previews`` and returns ``callback_kwargs`` unchanged.

    The newest decoded tensor itself (raw VAE output, CPU float32) is kept in
    ``pipe._tiny_last_preview``."""
    if name not in PIPELINES:
        raise KeyError(f"unknown tiny pipeline {name!r}; known: {PIPELINES}")

    def _preview(pipe, step, timestep, callback_kwargs):
        latents = callback_kwargs["latents"]
        with torch.no_grad():
            z = _denormalize(name, pipe, latents.detach())
            z = z.to(device=_vae_input_device(pipe.vae, z), dtype=pipe.vae.dtype)
            image = pipe.vae.decode(z, return_dict=False)[0]
        previews = getattr(pipe, "_tiny_previews", None)
        if previews is None:
            previews = []
            pipe._tiny_previews = previews
        previews.append(tuple(image.shape))
        # The newest decoded preview (raw VAE output in [-1, 1], on the CPU).
        pipe._tiny_last_preview = image.detach().to("cpu", torch.float32)
        return callback_kwargs

    _preview.__name__ = f"tiny_preview_{name}"
    return _preview


# --------------------------------------------------------------------------------------
# running
# --------------------------------------------------------------------------------------


def expected_shape(name: str) -> tuple[int, ...]:
    """Shape of ``run(build(name), name)``."""
    height, width = _SIZE[name]
    if name in ("wan21", "wan22"):
        return (1, _WAN_FRAMES, 3, height, width)
    return (1, 3, height, width)


def run(pipe, name: str, *, seed: int = 0, preview: bool = False) -> torch.Tensor:
    """Call ``pipe`` with ``call_kwargs(name, ...)``; return its images (or video frames)
    as a float32 CPU tensor."""
    out = pipe(**call_kwargs(name, seed=seed, preview=preview, pipe=pipe))
    images = getattr(out, "frames", None)
    if images is None:
        images = out.images if hasattr(out, "images") else out[0]
    if isinstance(images, (list, tuple)):
        images = torch.stack([torch.as_tensor(i) for i in images])
    images = torch.as_tensor(images)
    return images.detach().to(device="cpu", dtype=torch.float32)
