"""The hook's path (issue 29, item 3): a component loaded at its hook passes at most 3 Python frames more than stock's
between the code that runs the hook (accelerate's `new_forward`; ours: the out-of-memory guard, which runs
accelerate's hooked forward itself) and `torch.nn.Module.to`, stock counted in the same test; an eager forward passes
no compiler wrapper and one frame more than stock's; and a guarded forward keeps the signature `inspect` reads.

Counted on the tiny FLUX pipeline on the plain CPU (the simulated accelerator adds its own frames to every move). The
compiler's disable wrappers are left out of both counts (`torch.compiler.disable`'s, and accelerate's lazy one around
it): our hook has one on every stack for `torch.compile`, accelerate's `CpuOffload` only from accelerate 1.7 on."""

import inspect
import sys

import pytest
import torch

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: the extension's hook")

import diffusers_offload_ext as doe  # noqa: E402
from diffusers_offload_ext.testing import tiny  # noqa: E402

pytestmark = [pytest.mark.plugin_only, pytest.mark.usefixtures("installed")]
NAME = "flux"


def _disable_wrapper(frame) -> bool:
    code = frame.f_code
    qualname = getattr(code, "co_qualname", code.co_name)
    return "/torch/_dynamo/" in code.co_filename.replace("\\", "/") or qualname.startswith(
        ("_compiler_disable.", "outside_graphs.")
    )


def _from_the_hook(frame):
    """Frames from `frame` (the caller of `Module.to`) up to the code that runs the hook around the forward:
    accelerate's `new_forward`, or the out-of-memory guard's `_run`, which runs accelerate's hooked forward
    in its place (`recovery/guard.py`); wrappers left out. `None` where the move was not made at a hook."""
    found = 0
    while frame is not None:
        code = frame.f_code
        path = code.co_filename.replace("\\", "/")
        if (code.co_name, path.endswith("accelerate/hooks.py")) == ("new_forward", True) or (
            code.co_name,
            path.endswith("recovery/guard.py"),
        ) == ("_run", True):
            return found
        found += 0 if _disable_wrapper(frame) else 1
        frame = frame.f_back
    return None


def frames_to_the_first_load(pipe, monkeypatch, name="transformer") -> int:
    """Frames between accelerate's `new_forward` and `torch.nn.Module.to` (diffusers' own `ModelMixin.to` among
    them) when component `name` is first moved at its hook in a call."""
    component, found, real = getattr(pipe, name), [], torch.nn.Module.to

    def to(self, *args, **kwargs):
        if self is component and not found:
            count = _from_the_hook(sys._getframe(1))
            if count is not None:
                found.append(count)
        return real(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(torch.nn.Module, "to", to)
        tiny.run(pipe, NAME)
    assert found, f"`{name}` was never moved at its hook"
    return found[0]


def test_a_load_at_a_hook_passes_at_most_three_frames_more_than_stock(monkeypatch):
    doe.uninstall()
    try:
        stock_pipe = tiny.build(NAME)
        stock_pipe.enable_model_cpu_offload(device="cpu")
        stock = frames_to_the_first_load(stock_pipe, monkeypatch)
    finally:
        doe.install()
    pipe = tiny.build(NAME)
    pipe.enable_model_cpu_offload(device="cpu")
    ours = frames_to_the_first_load(pipe, monkeypatch)
    assert stock >= 2  # accelerate's pre_forward, diffusers' ModelMixin.to
    assert ours <= stock + 3, (ours, stock)


def test_a_guarded_forward_keeps_its_signature():
    pipe = tiny.build(NAME)
    before = {
        "transformer.forward": inspect.signature(pipe.transformer.forward),
        "vae.decode": inspect.signature(pipe.vae.decode),
        "vae.encode": inspect.signature(pipe.vae.encode),
    }
    pipe.enable_model_cpu_offload(device="cpu")
    after = {
        "transformer.forward": inspect.signature(pipe.transformer.forward),
        "vae.decode": inspect.signature(pipe.vae.decode),
        "vae.encode": inspect.signature(pipe.vae.encode),
    }
    assert after == before


def _frames_below_the_call(frame) -> list:
    """`(file, function)` of the frames from `frame` up to (not including) `torch.nn.Module._call_impl`."""
    found = []
    while frame is not None and frame.f_code.co_name != "_call_impl":
        found.append((frame.f_code.co_filename.replace("\\", "/"), frame.f_code.co_name))
        frame = frame.f_back
    return found


def _stack_at_the_forward(pipe, name="transformer") -> list:
    """The frames between `Module.__call__` and component `name`'s own forward at a steady forward (nothing moves)."""
    component, found = getattr(pipe, name), []
    own = component._old_forward if hasattr(component, "_old_forward") else component.forward

    def forward(*args, **kwargs):
        found.append(_frames_below_the_call(sys._getframe(1)))
        return own(*args, **kwargs)

    tiny.run(pipe, NAME)  # a first call loads what it must
    component._old_forward = forward
    try:
        tiny.run(pipe, NAME)
    finally:
        component._old_forward = own
    assert found, f"`{name}` never ran"
    return found[0]


def test_an_eager_forward_passes_no_compiler_wrapper_and_one_frame_more_than_stock():
    doe.uninstall()
    try:
        stock_pipe = tiny.build(NAME)
        stock_pipe.enable_model_cpu_offload(device="cpu")
        stock = _stack_at_the_forward(stock_pipe)
    finally:
        doe.install()
    pipe = tiny.build(NAME)
    pipe.enable_model_cpu_offload(device="cpu", keep_on_device_between_generations=True)
    ours = _stack_at_the_forward(pipe)
    assert not [f for f in ours if "/torch/_dynamo/" in f[0] or f[1] == "call"], ours  # no disable wrapper
    assert len(ours) <= len(stock) + 1, (ours, stock)  # the guard runs accelerate's hooked forward itself


def test_an_eager_hook_reaches_the_session_without_a_compiler_wrapper(monkeypatch):
    from diffusers_offload_ext.runtime.session import Session

    found, real = [], Session.use

    def use(self, name):
        if name == "transformer" and not found:
            found.append(_frames_below_the_call(sys._getframe(1)))
        return real(self, name)

    monkeypatch.setattr(Session, "use", use)  # before arming: the hook keeps the session's bound method
    pipe = tiny.build(NAME)
    pipe.enable_model_cpu_offload(device="cpu")
    tiny.run(pipe, NAME)
    assert found and not [f for f in found[0] if "/torch/_dynamo/" in f[0] or f[1] == "call"], found


def _calls_in_a_steady_use(monkeypatch, **options) -> int:
    """Python calls made inside the session's `use` of the transformer at a denoising step after the first (it is on
    the device already: nothing to decide), the fewest over the second call's steps."""
    from diffusers_offload_ext.runtime.session import Session

    counts, real, counting = [], Session.use, []

    def use(self, name):
        if name != "transformer" or not counting:
            return real(self, name)
        calls = [0]

        def profile(frame, event, arg):
            if event == "call":
                calls[0] += 1

        sys.setprofile(profile)
        try:
            return real(self, name)
        finally:
            sys.setprofile(None)
            counts.append(calls[0])

    with monkeypatch.context() as patch:
        patch.setattr(Session, "use", use)  # before arming: the hook keeps the session's bound method
        pipe = tiny.build(NAME)
        pipe.enable_model_cpu_offload(device="cpu", **options)
        tiny.run(pipe, NAME)
        counting.append(True)
        tiny.run(pipe, NAME)
    assert len(counts) >= 2, counts
    return min(counts[1:])


def test_a_steady_use_with_components_kept_between_calls_costs_no_more_calls_than_stocks_chain(monkeypatch):
    # The residency manager tells its forecasts and stock's shadow of a use only when a decision reads them
    # (`ResidencyPolicy._catch_up`): with nothing to decide, its use is as short as the chain's.
    chain = _calls_in_a_steady_use(monkeypatch)
    kept = _calls_in_a_steady_use(monkeypatch, keep_on_device_between_generations=True)
    assert kept <= chain, (kept, chain)
