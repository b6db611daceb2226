"""Items 4, 6 and 8: sticky options, re-enables from inside diffusers, exception safety, and what comes after."""

import inspect

import pytest
import torch
import toy
from harness import hooked_names, resident
from spy import MoveSpy, modules_of

pytestmark = pytest.mark.usefixtures("accelerator")  # each test on the plain CPU and on the simulated accelerator

PREVIEW = ["text_encoder", "text_encoder_2"] + ["transformer", "vae"] * 3


def copying(installed) -> dict:
    """The spy is the oracle of `.to()` calls; the plugin's default drops (issue 31) make none: it copies here."""
    return {"zero_copy_eviction": False} if installed is not None else {}


def test_options_are_sticky(installed, offload_impl, detected_device):
    pipe = toy.build()
    pipe.enable_model_cpu_offload(
        device="cpu", exclude_from_offload="transformer", keep_on_device_during_generation=True, **copying(installed)
    )
    pipe.enable_model_cpu_offload()
    with MoveSpy(pipe, on_device={"transformer", "safety_checker"}) as spy:
        pipe(PREVIEW)  # maybe_free_model_hooks() re-enables with the same options
        pipe(PREVIEW)
    assert not [move for move in spy.moves() if move[0] == "transformer"], "the excluded transformer moved"
    assert {n for n, on in spy.placement.items() if on} == {"transformer", "safety_checker"}
    pipe.enable_model_cpu_offload(exclude_from_offload=[])
    with MoveSpy(pipe, on_device={"safety_checker"}) as spy:
        pipe(PREVIEW)
    # keep is still on: nothing is evicted before the end of the call
    moves = spy.moves()
    # (the order of the offloads at the end of the call is an implementation detail: stock's `pipe.to("cpu")`)
    offloads = [n for n, d, _ in moves if d == "offload" and n != "safety_checker"]
    assert sorted(offloads[:4]) == ["text_encoder", "text_encoder_2", "transformer", "vae"]
    last_onload = max(i for i, (_, d, _) in enumerate(moves) if d == "onload" and moves[i][0] != "safety_checker")
    first_offload = min(i for i, (_, d, _) in enumerate(moves) if d == "offload")
    assert first_offload > last_onload
    pipe.enable_model_cpu_offload(keep_on_device_during_generation=False)
    with MoveSpy(pipe, on_device={"safety_checker"}) as spy:
        pipe(PREVIEW)
    if offload_impl == "patched":
        return  # chain evictions are invisible on the CPU with stock accelerate hooks (see test_pipelines.py)
    assert [n for n, d, _ in spy.moves() if d == "offload"][:3] == ["text_encoder", "text_encoder_2", "transformer"]
    assert spy.moves()[:4] == [
        ("text_encoder", "onload", None),
        ("text_encoder", "offload", None),
        ("text_encoder_2", "onload", None),
        ("text_encoder_2", "offload", None),
    ]


def test_lora_style_reenable_keeps_options(installed, detected_device):
    """diffusers' LoRA loading removes the hooks when it finds a `CpuOffload`, then calls
    `enable_model_cpu_offload()` with no argument at all."""
    from diffusers.loaders import lora_base

    pipe = toy.build()
    pipe.enable_model_cpu_offload(
        device="cpu", exclude_from_offload=["transformer"], keep_on_device_during_generation=True, **copying(installed)
    )
    pipe(PREVIEW)
    found = lora_base._func_optionally_disable_offloading(pipe)
    assert found[0] is True, "the hook must still be seen as model offload"
    assert hooked_names(pipe) == set()
    with MoveSpy(pipe, on_device={"transformer", "safety_checker"}) as spy:
        pipe.enable_model_cpu_offload()
        # the excluded transformer did not move, nor did the class-excluded safety checker (with components
        # excluded, only the hooks move components); the rest was already on the host
        assert spy.moves() == []
        pipe(PREVIEW)
    assert hooked_names(pipe) == set(modules_of(pipe)) - {"safety_checker"}
    assert not any(n == "transformer" for n, _, _ in spy.moves())
    assert sorted(n for n, d, _ in spy.moves() if d == "offload" and n != "safety_checker") == [
        "text_encoder",
        "text_encoder_2",
        "vae",
    ]


@pytest.mark.plugin_only
@pytest.mark.parametrize("interrupt", [False, True])
@pytest.mark.parametrize("keep", [True, ()])
def test_failed_call_leaves_nothing_pinned(installed, interrupt, keep):
    doe = installed
    pipe = toy.build()
    pipe.enable_model_cpu_offload(device="cpu", keep_on_device_during_generation=keep)
    error = KeyboardInterrupt if interrupt else RuntimeError
    with pytest.raises(error):
        pipe(PREVIEW, fail_at=5, interrupt=interrupt)
    assert resident(pipe) == {"safety_checker"}
    assert hooked_names(pipe) == set(modules_of(pipe)) - {"safety_checker"}
    assert not doe.offload_status(pipe).in_call
    # The next call behaves as if the failed one never happened.
    ledger = doe.transfer_ledger(pipe)
    ledger.clear()
    pipe(PREVIEW)
    fresh = toy.build()
    fresh.enable_model_cpu_offload(device="cpu", keep_on_device_during_generation=keep)
    fresh_ledger = doe.transfer_ledger(fresh)
    fresh(PREVIEW)
    strip = lambda records: [(r.component, r.direction, r.nbytes) for r in records if r.call_index is not None]
    assert strip(ledger.records) == strip(fresh_ledger.records)
    assert doe.offload_status(pipe).recent_calls == [tuple(PREVIEW)]  # the failed call left no trace


@pytest.mark.plugin_only
def test_callback_raising_at_step_k(installed):
    pipe = toy.build()
    pipe.enable_model_cpu_offload(device="cpu", exclude_from_offload="vae", keep_on_device_during_generation=True)

    class Stop(Exception):
        pass

    pipe(PREVIEW)
    pipe.transformer.register_forward_hook(lambda *a: (_ for _ in ()).throw(Stop()))
    with pytest.raises(Stop):
        pipe(PREVIEW)
    assert resident(pipe) == {"vae", "safety_checker"}


def test_remove_all_hooks_like_stock(installed):
    pipe = toy.build()
    pipe.enable_model_cpu_offload(device="cpu", exclude_from_offload="transformer")
    with MoveSpy(pipe) as spy:
        pipe.remove_all_hooks()
    assert spy.calls == []
    assert hooked_names(pipe) == set()
    assert pipe._all_hooks == []
    assert pipe._exclude_from_cpu_offload == ["safety_checker"]
    assert all(not hasattr(m, "_hf_hook") for m in modules_of(pipe).values())


def _stock_pipeline_after(action):
    """Apply `action` to a pipeline whose model offload was enabled by stock diffusers (never installed)."""
    from diffusers_offload_ext import marks

    pipe = toy.build()
    marks.STOCK["enable_model_cpu_offload"](pipe, device="cpu")
    return pipe, _outcome(pipe, action)


def _outcome(pipe, action):
    """What `action` did: raised, or which hooks it kept, removed or added, and where the weights are."""
    before = {n: getattr(m, "_hf_hook", None) for n, m in modules_of(pipe).items()}
    try:
        action(pipe)
    except Exception as error:  # the comparison is with stock, whatever it does
        return ("raised", type(error), str(error))
    after = {n: getattr(m, "_hf_hook", None) for n, m in modules_of(pipe).items()}
    hooks = {}
    for name in after:
        if after[name] is before[name]:
            hooks[name] = "unchanged" if after[name] is not None else None
        else:
            hooks[name] = type(after[name]).__name__ if after[name] is not None else "removed"
    devices = {n: sorted({str(t.device) for t in m.state_dict().values()}) for n, m in modules_of(pipe).items()}
    return ("ok", hooks, devices, list(getattr(pipe, "_all_hooks", [])) == [])


AFTER = {
    "sequential": lambda p: p.enable_sequential_cpu_offload(device="cpu"),
    "to_cpu": lambda p: p.to("cpu"),
    "reset_device_map": lambda p: p.reset_device_map(),
    "remove_all_hooks": lambda p: p.remove_all_hooks(),
    "group": lambda p: p.enable_group_offload(torch.device("cpu"), offload_type="leaf_level"),
}


@pytest.mark.plugin_only
@pytest.mark.parametrize("action", sorted(AFTER))
def test_after_enable_like_stock(action):
    import diffusers_offload_ext as doe

    if action == "group" and not hasattr(toy.TracePipeline, "enable_group_offload"):
        pytest.skip("enable_group_offload does not exist in this diffusers")
    _, expected = _stock_pipeline_after(AFTER[action])
    doe.install()
    try:
        pipe = toy.build()
        pipe.enable_model_cpu_offload(
            device="cpu", exclude_from_offload="controlnet", keep_on_device_during_generation=True
        )
        pipe(PREVIEW)
        got = _outcome(pipe, AFTER[action])
        if got[0] == "ok" and expected[0] == "ok":
            # The excluded component had no hook to begin with and stays on the device (where tensors tell, it
            # reports the execution device); everything else must match stock.
            assert got[1].pop("controlnet") in (None, expected[1]["controlnet"])
            expected[1].pop("controlnet")
            assert got[2].pop("controlnet") in (expected[2].pop("controlnet"), ["cpu"], ["cpu:0"])
    finally:
        doe.uninstall()
    assert got == expected


@pytest.mark.plugin_only
def test_uninstall_leaves_no_trace():
    import diffusers_offload_ext as doe
    from diffusers import DiffusionPipeline

    before = dict(DiffusionPipeline.__dict__)
    call_before = toy.TracePipeline.__dict__["__call__"]
    doe.install()
    doe.install()  # idempotent
    assert toy.TracePipeline.__call__ is not call_before
    assert toy.TracePipeline.__call__.__offload_ext_wraps__ is call_before

    class Later(toy.TracePipeline):
        def __call__(self, trace=()):
            return super().__call__(trace)

    later_call = Later.__dict__["__call__"].__offload_ext_wraps__  # classes defined after install() are wrapped
    assert later_call.__qualname__.endswith("Later.__call__")
    pipe = toy.build()
    pipe.enable_model_cpu_offload(device="cpu", exclude_from_offload="transformer")
    doe.uninstall()
    doe.uninstall()
    assert dict(DiffusionPipeline.__dict__) == before
    assert toy.TracePipeline.__dict__["__call__"] is call_before
    assert Later.__dict__["__call__"] is later_call
    fresh = toy.build()
    assert "exclude_from_offload" not in inspect.signature(fresh.enable_model_cpu_offload).parameters
    with pytest.raises(TypeError):
        fresh.enable_model_cpu_offload(device="cpu", exclude_from_offload="vae")
    fresh.enable_model_cpu_offload(device="cpu")
    fresh(PREVIEW)
    assert not doe.offload_status(fresh).enabled  # stock's offload: nothing of this extension is armed
    assert not [key for key in vars(fresh) if "offload_ext" in key]  # and it left nothing on the instance
    assert {type(m._hf_hook).__name__ for m in modules_of(fresh).values() if hasattr(m, "_hf_hook")} == {"CpuOffload"}


@pytest.mark.plugin_only
def test_mixin_without_install():
    import diffusers_offload_ext as doe

    class MyToy(doe.OffloadMixin, toy.TracePipeline):
        pass

    assert not doe.is_installed()
    pipe = toy.build(MyToy)
    pipe.enable_model_cpu_offload(
        device="cpu", exclude_from_offload=["transformer"], keep_on_device_during_generation=True
    )
    ledger = doe.transfer_ledger(pipe)
    pipe(PREVIEW)
    assert [(r.component, r.direction) for r in ledger.records if r.call_index == 0][:3] == [
        ("text_encoder", "onload"),
        ("text_encoder_2", "onload"),
        ("vae", "onload"),
    ]
    with pytest.raises(RuntimeError):
        pipe(PREVIEW, fail_at=2)
    assert resident(pipe) == {"transformer", "safety_checker"}
    plain = toy.build()
    assert "exclude_from_offload" not in inspect.signature(plain.enable_model_cpu_offload).parameters


@pytest.mark.plugin_only
def test_pre_forward_is_constant_work_when_resident(installed, monkeypatch):
    pipe = toy.build()
    pipe.enable_model_cpu_offload(device="cpu", keep_on_device_during_generation=True)
    pipe.transformer()  # now on the device
    hook = pipe.transformer._hf_hook
    counted = []
    for method in ("parameters", "named_parameters", "buffers", "to", "_apply"):
        original = getattr(torch.nn.Module, method)

        def counting(self, *a, _original=original, _name=method, **k):
            counted.append(_name)
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.nn.Module, method, counting)
    for _ in range(10):
        hook.pre_forward(pipe.transformer)
        hook.pre_forward(pipe.transformer, torch.ones(2), x=torch.ones(2))
    assert counted == []


def test_execution_device_with_the_first_component_excluded(installed):
    """`_execution_device` looks at the first component not in `_exclude_from_cpu_offload`: an excluded component
    has no hook, so without the instance-level merge it would answer the host (`cpu`) instead of `cpu:0`."""
    pipe = toy.build()
    pipe.enable_model_cpu_offload(device="cpu", exclude_from_offload=["text_encoder", "text_encoder_2"])
    assert pipe._execution_device == torch.device("cpu", 0)
    pipe(PREVIEW)
    assert pipe._execution_device == torch.device("cpu", 0)


@pytest.mark.plugin_only
def test_uses_outside_calls_are_not_traced(installed):
    pipe = toy.build()
    pipe.enable_model_cpu_offload(device="cpu")
    for _ in range(100):
        pipe.transformer()
        pipe.vae.decode()
    import diffusers_offload_ext as doe

    assert doe.offload_status(pipe).recent_calls == []
    pipe(PREVIEW)
    assert doe.offload_status(pipe).recent_calls == [tuple(PREVIEW)]
