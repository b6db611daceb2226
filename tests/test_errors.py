"""Item 7: bad input gets a clear error, raised before anything changes."""

import pytest
import toy
from spy import MoveSpy, modules_of

pytestmark = pytest.mark.usefixtures("accelerator")  # each test on the plain CPU and on the simulated accelerator


def snapshot(pipe):
    modules = modules_of(pipe)
    return {
        "hooks": {n: getattr(m, "_hf_hook", None) for n, m in modules.items()},
        "forwards": {n: m.__dict__.get("forward") for n, m in modules.items()},
        "devices": {n: [t.device for t in m.state_dict().values()] for n, m in modules.items()},
        "all_hooks": list(getattr(pipe, "_all_hooks", [])),
        "instance": {
            k: v
            for k, v in pipe.__dict__.items()
            if k in ("_exclude_from_cpu_offload", "_offload_device", "_offload_gpu_id")
        },
        "class_exclude": list(type(pipe)._exclude_from_cpu_offload),
        "state": _state(pipe),
    }


def _state(pipe):
    try:
        import diffusers_offload_ext as doe
    except ImportError:  # the patched run: no extension state
        return None
    return (doe.offload_status(pipe), len(doe.transfer_ledger(pipe).records))


BAD = [
    (
        {"exclude_from_offload": ["nope"]},
        ValueError,
        r"`exclude_from_offload` names unknown components \['nope'\].*'transformer'",
    ),
    ({"exclude_from_offload": ["transformer", "vea"]}, ValueError, r"\['vea'\]"),
    ({"exclude_from_offload": "controlnet"}, ValueError, r"not `torch.nn.Module`s \(\{'controlnet': 'NoneType'\}\)"),
    ({"exclude_from_offload": 5}, TypeError, r"`exclude_from_offload` must be a component name .* got 5"),
    ({"exclude_from_offload": True}, TypeError, r"`exclude_from_offload` .* got True"),
    ({"exclude_from_offload": [1, "vae"]}, TypeError, r"only component names \(str\), got \[1\]"),
    ({"exclude_from_offload": {"vae": 1}}, TypeError, r"`exclude_from_offload`"),
    ({"exclude_from_offload": b"vae"}, TypeError, r"`exclude_from_offload`"),
    ({"keep_on_device_during_generation": "nope"}, ValueError, r"`keep_on_device_during_generation` names unknown"),
    ({"keep_on_device_during_generation": 1}, TypeError, r"`keep_on_device_during_generation` must be"),
    ({"keep_on_device_during_generation": [None]}, TypeError, r"only component names"),
    pytest.param({"gpu_id": "0"}, TypeError, r"`gpu_id` must be an int", marks=pytest.mark.plugin_only),
    pytest.param({"gpu_id": -1}, ValueError, r"`gpu_id` must be >= 0", marks=pytest.mark.plugin_only),
    pytest.param({"device": 3}, TypeError, r"`device` must be a str", marks=pytest.mark.plugin_only),
    pytest.param({"device": "not-a-device"}, ValueError, r"`device` must name", marks=pytest.mark.plugin_only),
    ({"device": "cpu:0", "gpu_id": 1}, ValueError, r"`gpu_id`=1"),
]


@pytest.mark.parametrize("kwargs, error, match", BAD)
@pytest.mark.parametrize("first", [None, {"keep_on_device_during_generation": True, "exclude_from_offload": "vae"}])
def test_rejected_call_changes_nothing(installed, offload_impl, kwargs, error, match, first):
    pipe = toy.build(with_controlnet=False)
    if first is not None:
        pipe.enable_model_cpu_offload(device="cpu", **first)
        pipe(["text_encoder", "transformer"])
    kwargs = {"device": "cpu", **kwargs}
    if offload_impl == "patched":
        match = None  # the patch words its errors in diffusers' style; the type and "nothing changed" are shared
    before = snapshot(pipe)
    with MoveSpy(pipe) as spy:
        with pytest.raises(error, match=match):
            pipe.enable_model_cpu_offload(**kwargs)
    assert spy.calls == []
    assert snapshot(pipe) == before


def test_unknown_name_lists_valid_names(installed, offload_impl):
    pipe = toy.build()
    with pytest.raises(ValueError) as info:
        pipe.enable_model_cpu_offload(device="cpu", exclude_from_offload=["unet"])
    message = str(info.value)
    names = ["text_encoder", "text_encoder_2", "transformer", "vae", "controlnet"]
    if offload_impl == "plugin":
        # the patch lists only the names it can act on: the class-excluded safety checker never leaves the device
        names.append("safety_checker")
    for name in names:
        assert repr(name) in message


def test_no_accelerator_and_no_device(installed, monkeypatch):
    pipe = toy.build()
    import diffusers.utils.torch_utils as torch_utils

    if not hasattr(torch_utils, "get_device"):
        pytest.skip("diffusers < 0.33 defaults to 'cuda' instead of detecting the accelerator")
    monkeypatch.setattr(torch_utils, "get_device", lambda: "cpu")
    with pytest.raises(RuntimeError, match="requires (an )?accelerator"):
        pipe.enable_model_cpu_offload()
    assert getattr(pipe, "_all_hooks", []) == []


def _stock_error(pipe_factory, prepare):
    from diffusers_offload_ext import marks

    pipe = pipe_factory()
    prepare(pipe)
    with pytest.raises(Exception) as info:
        marks.STOCK["enable_model_cpu_offload"](pipe, device="cpu")
    return type(info.value), str(info.value)


@pytest.mark.plugin_only
@pytest.mark.parametrize("case", ["device_map", "no_seq"])
def test_same_errors_as_stock(installed, case):
    def prepare(pipe):
        if case == "device_map":
            pipe.hf_device_map = {"text_encoder": 0, "transformer": 1}
        else:
            pipe.model_cpu_offload_seq = None

    stock_type, stock_message = _stock_error(toy.build, prepare)
    pipe = toy.build()
    prepare(pipe)
    before = snapshot(pipe)
    with pytest.raises(stock_type) as info:
        pipe.enable_model_cpu_offload(device="cpu", exclude_from_offload="transformer")
    assert str(info.value) == stock_message
    assert snapshot(pipe) == before


def test_class_attribute_never_mutated(installed):
    pipe = toy.build()
    pipe.enable_model_cpu_offload(device="cpu", exclude_from_offload=["transformer", "vae"])
    assert toy.TracePipeline._exclude_from_cpu_offload == ["safety_checker"]
    other = toy.build()
    assert other._exclude_from_cpu_offload == ["safety_checker"]
    pipe.enable_model_cpu_offload(device="cpu", exclude_from_offload=[])
    assert pipe._exclude_from_cpu_offload == ["safety_checker"]
    assert "_exclude_from_cpu_offload" not in pipe.__dict__ or pipe.__dict__["_exclude_from_cpu_offload"] == [
        "safety_checker"
    ]
