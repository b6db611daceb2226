"""Self-test of tests/tiny_pipelines.py: the tiny pipelines build, run offline,
are deterministic, run every component, and the live-preview callback works."""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tiny_pipelines as tp  # noqa: E402

# What run() must return; kept separate from tp.expected_shape so that both are checked.
EXPECTED_SHAPES = {
    "sd15": (1, 3, 32, 32),
    "sdxl": (1, 3, 32, 32),
    "sd3": (1, 3, 32, 32),
    "flux": (1, 3, 32, 32),
    "flux_img2img": (1, 3, 32, 32),
    "wan21": (1, 5, 3, 16, 16),
    "wan22": (1, 5, 3, 16, 16),
    "sd_controlnet": (1, 3, 32, 32),
}

# Denoising models of each pipeline (called at every step).
DENOISERS = {
    "sd15": ("unet",),
    "sdxl": ("unet",),
    "sd3": ("transformer",),
    "flux": ("transformer",),
    "flux_img2img": ("transformer",),
    "wan21": ("transformer",),
    "wan22": ("transformer", "transformer_2"),
    "sd_controlnet": ("unet", "controlnet"),
}

TEXT_ENCODERS = {
    "sd15": ("text_encoder",),
    "sdxl": ("text_encoder", "text_encoder_2"),
    "sd3": ("text_encoder", "text_encoder_2", "text_encoder_3"),
    "flux": ("text_encoder", "text_encoder_2"),
    "flux_img2img": ("text_encoder", "text_encoder_2"),
    "wan21": ("text_encoder",),
    "wan22": ("text_encoder",),
    "sd_controlnet": ("text_encoder",),
}

# Flux on CPU may differ slightly from run to run; the others are exact in practice.
ATOL = 1e-3


def _skip_unless_available(name):
    ok, reason = tp.available(name)
    if not ok:
        pytest.skip(reason)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny tensors: one intra-op thread is faster and far steadier on a loaded
    # 2-core machine than torch's default (2 threads spin-waiting on each other).
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@contextlib.contextmanager
def trace_calls(pipe, name):
    """Record, in order, which component ran: text encoders and denoisers (forward
    pre-hooks; consecutive repeats folded into one) and every ``vae.encode`` /
    ``vae.decode`` call (not folded). ``add`` lets callbacks insert markers."""
    events: list[str] = []

    def add(label, fold=True):
        if not (fold and events and events[-1] == label):
            events.append(label)

    handles = [
        getattr(pipe, comp).register_forward_pre_hook(lambda *_a, _l=comp: add(_l))
        for comp in TEXT_ENCODERS[name] + DENOISERS[name]
    ]
    vae = pipe.vae
    for method in ("encode", "decode"):
        original = getattr(vae, method)

        def wrapper(*args, _orig=original, _label="vae." + method, **kwargs):
            add(_label, fold=False)
            return _orig(*args, **kwargs)

        setattr(vae, method, wrapper)  # instance attribute shadows the method
    try:
        yield events, add
    finally:
        for handle in handles:
            handle.remove()
        for method in ("encode", "decode"):
            vae.__dict__.pop(method, None)


def _step_marker(add, inner=None):
    def callback(pipe, step, timestep, callback_kwargs):
        add(f"end{step}")
        if inner is not None:
            return inner(pipe, step, timestep, callback_kwargs)
        return callback_kwargs

    return callback


@pytest.mark.parametrize("name", tp.PIPELINES)
def test_build_components(name):
    _skip_unless_available(name)
    pipe = tp.build(name)
    assert type(pipe).__name__ == tp._CLASSES[name][0]
    for comp in TEXT_ENCODERS[name] + DENOISERS[name] + ("vae",):
        module = getattr(pipe, comp)
        assert isinstance(module, torch.nn.Module), comp
        params = list(module.parameters())
        assert params, f"{comp} has no parameters"
        assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in params)
        assert not module.training, f"{comp} is in training mode"
        assert getattr(module, "_hf_hook", None) is None, f"{comp} has an offload hook"
    for optional in ("image_encoder", "feature_extractor", "safety_checker"):
        assert getattr(pipe, optional, None) is None
    if name == "sd_controlnet":
        assert "controlnet" not in type(pipe).model_cpu_offload_seq
    if name == "wan22":
        assert pipe.config.boundary_ratio == pytest.approx(tp._WAN_BOUNDARY_RATIO)
    if name == "wan21" and hasattr(pipe, "transformer_2"):
        assert pipe.transformer_2 is None


@pytest.mark.parametrize("name", tp.PIPELINES)
def test_deterministic(name):
    _skip_unless_available(name)
    first = tp.run(tp.build(name), name)
    second = tp.run(tp.build(name), name)
    max_diff = (first - second).abs().max().item()
    print(f"{name}: max diff between two builds/runs = {max_diff:.3g}")
    assert torch.allclose(first, second, atol=ATOL), max_diff
    # The seed reaches the noise: another seed gives another image.
    other = tp.run(tp.build(name), name, seed=1)
    assert (first - other).abs().max().item() > 10 * ATOL


@pytest.mark.parametrize("name", tp.PIPELINES)
def test_output_shape(name):
    _skip_unless_available(name)
    image = tp.run(tp.build(name), name)
    assert isinstance(image, torch.Tensor)
    assert image.dtype == torch.float32 and image.device.type == "cpu"
    assert tuple(image.shape) == EXPECTED_SHAPES[name] == tp.expected_shape(name)
    assert torch.isfinite(image).all()
    assert image.min() >= 0.0 and image.max() <= 1.0
    assert image.std() > 1e-3, "degenerate (constant) image"


@pytest.mark.parametrize("name", tp.PIPELINES)
def test_preview_callback(name):
    _skip_unless_available(name)
    pipe = tp.build(name)
    plain = tp.run(pipe, name)
    assert getattr(pipe, "_tiny_previews", None) in (None, [])
    with_preview = tp.run(pipe, name, preview=True)
    steps = tp.STEPS_RUN[name]
    assert len(pipe._tiny_previews) == steps
    if name.startswith("wan"):
        # the VAE decodes video as (B, C, F, H, W)
        b, f, c, h, w = EXPECTED_SHAPES[name]
        decoded = (b, c, f, h, w)
    else:
        decoded = EXPECTED_SHAPES[name]
    assert pipe._tiny_previews == [decoded] * steps
    max_diff = (plain - with_preview).abs().max().item()
    print(f"{name}: max diff plain vs preview = {max_diff:.3g}")
    assert torch.allclose(plain, with_preview, atol=ATOL), max_diff
    # The last preview decodes the final latents: it is the final image, before
    # post-processing (the unpacking and scaling match the pipeline's own).
    last = (pipe._tiny_last_preview / 2 + 0.5).clamp(0, 1)
    if name.startswith("wan"):
        last = last.permute(0, 2, 1, 3, 4)
    assert torch.allclose(last, with_preview, atol=ATOL)
    # A second preview run appends again.
    tp.run(pipe, name, preview=True)
    assert len(pipe._tiny_previews) == 2 * steps


@pytest.mark.parametrize("name", tp.PIPELINES)
def test_component_trace(name):
    """Every text encoder runs before denoising, the denoiser(s) at every step, the
    VAE decoder at the end (and, with previews, after every step); Flux img2img
    encodes its input image before denoising."""
    _skip_unless_available(name)
    pipe = tp.build(name)
    for preview in (False, True):
        kw = tp.call_kwargs(name, preview=preview, pipe=pipe)
        with trace_calls(pipe, name) as (events, add):
            kw["callback_on_step_end"] = _step_marker(add, kw.get("callback_on_step_end"))
            kw["callback_on_step_end_tensor_inputs"] = ["latents"]
            pipe(**kw)
        print(f"{name} preview={preview}: {' '.join(events)}")
        steps = tp.STEPS_RUN[name]
        ends = [events.index(f"end{i}") for i in range(steps)]
        assert ends == sorted(ends) and f"end{steps}" not in events
        first_denoise = min(events.index(d) for d in DENOISERS[name] if d in events)
        for enc in TEXT_ENCODERS[name]:
            assert enc in events[:first_denoise], f"{enc} did not run first"
        if name == "flux_img2img":
            assert "vae.encode" in events[:first_denoise]
        else:
            assert "vae.encode" not in events
        starts = [first_denoise] + [e + 1 for e in ends[:-1]]
        for i, (start, end) in enumerate(zip(starts, ends)):
            step_events = [e for e in events[start:end] if e != "vae.decode"]
            if i > 0:  # right after the previous step: its preview decode, if any
                after_prev = events[start - 1 : start + 1]
                assert after_prev[0] == f"end{i - 1}", after_prev
                assert (after_prev[1] == "vae.decode") is preview, after_prev
            ran = [d for d in DENOISERS[name] if d in step_events]
            if name == "wan22":
                # boundary 0.875: the high-noise expert for step 0 only
                assert ran == (["transformer"] if i == 0 else ["transformer_2"]), ran
            else:
                assert ran == list(DENOISERS[name]), (i, step_events)
            assert set(step_events) <= set(DENOISERS[name]), step_events
        decodes = events.count("vae.decode")
        assert decodes == 1 + preview * steps, events
        # the final decode (plus the last step's preview) after the last step
        assert events[ends[-1] + 1 :] == ["vae.decode"] * (1 + preview), events


def test_controlnet_changes_image():
    _skip_unless_available("sd_controlnet")
    _skip_unless_available("sd15")
    # same seeds for vae/text_encoder/unet: only the controlnet differs
    plain = tp.run(tp.build("sd15"), "sd15")
    controlled = tp.run(tp.build("sd_controlnet"), "sd_controlnet")
    assert (plain - controlled).abs().max().item() > 10 * ATOL


def test_flux_img2img_uses_input_image():
    _skip_unless_available("flux_img2img")
    pipe = tp.build("flux_img2img")
    kw = tp.call_kwargs("flux_img2img")
    a = pipe(**kw).images
    kw = tp.call_kwargs("flux_img2img")
    kw["image"] = 1.0 - kw["image"]
    b = pipe(**kw).images
    assert (a - b).abs().max().item() > 10 * ATOL


def test_build_keeps_global_rng():
    _skip_unless_available("sd15")
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    tp.build("sd15")
    assert torch.equal(torch.rand(4), expected)


def test_call_kwargs():
    for name in tp.PIPELINES:
        kw = tp.call_kwargs(name, seed=5)
        assert kw["output_type"] in ("pt", "np")
        assert kw["num_inference_steps"] in (2, 3, 4)
        assert kw["generator"].device.type == "cpu"
        assert torch.equal(kw["generator"].get_state(), torch.Generator().manual_seed(5).get_state())
        assert "callback_on_step_end" not in kw
        kw = tp.call_kwargs(name, preview=True)
        assert callable(kw["callback_on_step_end"])
        assert kw["callback_on_step_end_tensor_inputs"] == ["latents"]
    assert "image" in tp.call_kwargs("sd_controlnet")
    assert 0 < tp.call_kwargs("flux_img2img")["strength"] < 1
    with pytest.raises(KeyError):
        tp.call_kwargs("nope")
    if tp.available("sd15")[0] and tp.available("flux")[0]:
        with pytest.raises(TypeError):
            tp.call_kwargs("flux", pipe=tp.build("sd15"))


def test_available():
    assert set(tp.PIPELINES) == set(EXPECTED_SHAPES)
    for name in tp.PIPELINES:
        ok, reason = tp.available(name)
        assert isinstance(ok, bool) and isinstance(reason, str)
        assert (reason == "") is ok
    for name in ("sd15", "sdxl", "sd3", "flux", "flux_img2img", "sd_controlnet"):
        assert tp.available(name) == (True, "")
    with pytest.raises(KeyError):
        tp.available("nope")
    import diffusers

    if not hasattr(diffusers, "WanPipeline"):
        assert not tp.available("wan21")[0] and "WanPipeline" in tp.available("wan21")[1]
        assert not tp.available("wan22")[0]
        with pytest.raises(RuntimeError):
            tp.build("wan21")
