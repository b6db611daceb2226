"""`doe.trace`: records agree with the ledger, real moves are observed (meta device), stock is replayed on the CPU."""

import pytest
import torch

doe = pytest.importorskip("diffusers_offload_ext")

import toy  # noqa: E402
from accelerate.hooks import ModelHook, add_hook_to_module  # noqa: E402

from diffusers_offload_ext.calls import AFTER, BEFORE, LOOP  # noqa: E402
from diffusers_offload_ext.observe.trace import BETWEEN, nvtx_range, timing  # noqa: E402

pytestmark = [pytest.mark.plugin_only, pytest.mark.usefixtures("accelerator")]


class MixedToy(doe.OffloadMixin, toy.TracePipeline):
    pass


def _mixed(**options):
    pipe = toy.build(MixedToy)
    pipe.enable_model_cpu_offload(device="cpu", **options)
    return pipe


TRACES = (
    ["text_encoder", "text_encoder_2", "transformer", "vae", "transformer", "vae"],
    ["text_encoder", "transformer", "controlnet", "transformer", "vae"],
    ["vae", "text_encoder", "transformer", "transformer", "vae"],
)


def _ledger_tuples(records):
    return [(r.component, r.direction, r.nbytes, r.kind) for r in records]


#: Roles of the components that have an offload hook (`doe.offload_status`); an excluded component's hook reports its
#: use too (it evicts its chain predecessor).
HOOKED_ROLES = ("chain", "outside chain", "kept", "excluded")


@pytest.mark.parametrize(
    "options",
    [{}, {"exclude_from_offload": ["transformer"]}, {"keep_on_device_during_generation": True}],
    ids=["default", "exclude", "keep"],
)
def test_records_agree_with_the_ledger(options):
    pipe = _mixed(**options)
    ledger = doe.transfer_ledger(pipe)
    before = len(ledger.records)
    with doe.trace(pipe) as recorded:
        for events in TRACES:
            pipe(events)
    made = ledger.records[before:]
    assert made, "the extension made no move: the comparison would be empty"
    assert [r.source for r in recorded.records] == ["extension"] * len(made)
    assert _ledger_tuples(recorded.records) == _ledger_tuples(made)
    first_call = made[0].call_index
    assert [r.call for r in recorded.records] == [r.call_index - first_call for r in made]
    # The component-call trace holds every component that ran; the hooked ones are what the extension's hooks saw.
    status = doe.offload_status(pipe)
    hooked = {name for name, component in status.components.items() if component.role in HOOKED_ROLES}
    seen = [tuple(n for n in recorded.component_trace(i) if n in hooked) for i in range(len(TRACES))]
    assert seen == [tuple(t) for t in status.recent_calls[-3:]]
    assert [tuple(t) for t in TRACES] == [recorded.component_trace(i) for i in range(len(TRACES))]
    # Durations are measured (wall clock on the CPU).
    assert all(r.timing == "wall-clock" and r.duration_s is not None and r.duration_s >= 0 for r in recorded.records)
    # Resident bytes follow the moves.
    for record in recorded.records:
        assert record.resident_bytes == (record.nbytes if record.direction == "onload" else 0)


def test_steps_come_from_the_progress_bar_and_reach_the_ledger():
    tiny = pytest.importorskip("diffusers_offload_ext.tiny")
    if not tiny.available("flux")[0]:
        pytest.skip(tiny.available("flux")[1])

    class MixedFlux(doe.OffloadMixin, type(tiny.build("flux"))):
        pass

    plain = tiny.build("flux")
    pipe = MixedFlux(**plain.components)
    pipe.set_progress_bar_config(disable=True)
    pipe.enable_model_cpu_offload(device="cpu")
    ledger = doe.transfer_ledger(pipe)
    steps = tiny.STEPS_RUN["flux"]
    with torch.no_grad(), doe.trace(pipe) as recorded:
        tiny.run(pipe, "flux", preview=True)
    assert recorded.calls[0].steps == steps
    # Stock policy with a preview: the VAE evicts the transformer at every step, which comes back the next step.
    onloads = [r.step for r in recorded.records if r.component == "transformer" and r.direction == "onload"]
    assert onloads == list(range(steps))
    evictions = [r.step for r in recorded.records if r.component == "transformer" and r.direction == "offload"]
    assert evictions == list(range(steps))
    assert [r.step for r in ledger.records if r.call_index is not None] == [r.step for r in recorded.records]
    phases = {r.component: r.phase for r in recorded.records if r.direction == "onload"}
    assert phases["text_encoder"] == BEFORE and phases["vae"] == LOOP
    assert recorded.records[-1].phase == AFTER and recorded.records[-1].step is None
    assert ledger.records[-1].step is None


class _PrintsButMovesNothing(ModelHook):
    """What the widely shared monkey-patch did: print a move in a hook method that moves nothing."""

    def post_forward(self, module, output):
        module._said = "moved back to CPU"
        return output


class _QuietHook(ModelHook):
    """A hook with an innocent name that really drops its module's weights to the meta device."""

    def post_forward(self, module, output):
        module.to("meta")
        return output


def test_a_move_to_meta_is_observed_with_its_bytes():
    pipe = toy.build()
    expected = doe.module_nbytes(pipe.transformer)
    add_hook_to_module(pipe.text_encoder, _PrintsButMovesNothing())
    add_hook_to_module(pipe.transformer, _QuietHook())
    with doe.trace(pipe) as recorded:
        pipe(["text_encoder", "transformer"])
    assert pipe.text_encoder._said == "moved back to CPU"
    assert len(recorded.records) == 1
    record = recorded.records[0]
    assert (record.component, record.source, record.src, record.dst) == ("transformer", "observed", "cpu", "meta")
    assert (record.direction, record.kind, record.nbytes) == ("offload", "drop", expected)
    assert record.where == "_QuietHook.post_forward(transformer)"
    assert record.duration_s is not None and record.call == 0
    assert record.resident_bytes == 0
    assert not recorded.replayed


def test_a_move_outside_any_hook_is_observed_between_hooks():
    class Moving(toy.TracePipeline):
        def __call__(self, trace=()):
            self.vae.to("meta")
            return super().__call__(trace)

    pipe = toy.build(Moving)
    expected = doe.module_nbytes(pipe.vae)
    with doe.trace(pipe) as recorded:
        pipe(["text_encoder"])
    assert [(r.component, r.nbytes, r.where, r.duration_s) for r in recorded.records] == [
        ("vae", expected, BETWEEN, None)
    ]


def test_stock_model_offload_on_the_cpu_is_replayed_from_its_chain_policy(accelerator):
    pipe = toy.build()
    pipe.enable_model_cpu_offload(device="cpu")  # stock diffusers: nothing installed
    assert not doe.is_installed()
    with doe.trace(pipe) as recorded:
        for events in TRACES:
            pipe(events)
    simulated = accelerator is not None  # `cpu:0` is a device apart: stock's moves are seen there, not replayed
    assert recorded.replayed != simulated and {r.source for r in recorded.records} == {
        "observed" if simulated else "replayed"
    }
    assert any("REPLAYED" in note for note in recorded.notes) != simulated
    sizes = {n: doe.module_nbytes(m) for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    policy = doe.ChainPolicy(
        order=[n for n in toy.NAMES if n in sizes],
        chain=["text_encoder", "text_encoder_2", "transformer", "vae"],
        hooked=["text_encoder", "text_encoder_2", "transformer", "vae", "controlnet"],
        round_trip=["safety_checker"],
    )
    flat = [event for events in TRACES for event in list(events) + [doe.END]]
    expected = doe.replay(policy, flat, sizes, resident={"safety_checker"})
    # Observed, the class's round trip is not seen: stock moves it out and back inside one re-arm, between two looks.
    seen = [m for m in expected if m[1] != "safety_checker"] if simulated else expected
    assert [(r.direction, r.component, r.nbytes) for r in recorded.records] == seen
    # The extension with default options makes exactly these moves on the same traces.
    mixed = _mixed()
    ledger = doe.transfer_ledger(mixed)
    before = len(ledger.records)
    for events in TRACES:
        mixed(events)
    assert [(r.direction, r.component, r.nbytes) for r in ledger.records[before:]] == expected


def test_group_offload_on_the_cpu_is_replayed_from_its_groups():
    pipe = toy.build()
    if not hasattr(pipe, "enable_group_offload"):
        pytest.skip("this diffusers has no group offload")
    pipe.enable_group_offload(onload_device=torch.device("cpu"), offload_type="leaf_level")
    with doe.trace(pipe) as recorded:
        pipe(["text_encoder", "transformer", "vae"])
    assert recorded.calls[0].mode == "group-offload" and recorded.replayed
    onloaded = {}
    for record in recorded.records:
        sign = 1 if record.direction == "onload" else -1
        onloaded[record.component] = onloaded.get(record.component, 0) + sign * record.nbytes
    assert all(value == 0 for value in onloaded.values())
    moved_in = {}
    for record in recorded.records:
        if record.direction == "onload":
            moved_in[record.component] = moved_in.get(record.component, 0) + record.nbytes
    # forward() runs every group of a block; the VAE's decode() only runs its linear layer.
    assert moved_in == {
        "text_encoder": doe.module_nbytes(pipe.text_encoder),
        "transformer": doe.module_nbytes(pipe.transformer),
        "vae": doe.module_nbytes(pipe.vae.linear),
    }


def test_nvtx_range_only_on_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda message: calls.append(("push", message)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append(("pop",)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with nvtx_range("a", torch.device("cpu")):
        pass
    assert calls == []
    with nvtx_range("b", torch.device("cuda", 0)):
        calls.append(("body",))
    assert calls == [("push", "b"), ("body",), ("pop",)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with nvtx_range("c", torch.device("cuda", 0)):
        pass
    assert calls == [("push", "b"), ("body",), ("pop",)]


class _FakeEvent:
    clock = 0.0

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at = None

    def record(self):
        _FakeEvent.clock += 2.0
        self.at = _FakeEvent.clock

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return end.at - self.at


def test_extension_moves_on_cuda_use_nvtx_and_cuda_events(monkeypatch):
    pushed = []
    monkeypatch.setattr(timing, "nvtx_enabled", lambda device: True)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda message: pushed.append(message))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: pushed.append(None))
    pipe = _mixed()
    with doe.trace(pipe) as recorded:
        pipe(["text_encoder", "transformer"])
    moves = [f"diffusers_offload_ext::{r.direction}::{r.component}" for r in recorded.records]
    assert moves and [m for m in pushed if m and m.startswith("diffusers_offload_ext::o")] == moves
    assert pushed.count(None) == len([m for m in pushed if m is not None])
    assert {r.timing for r in recorded.records} == {"cuda-events"}
    # Fake events tick 2 ms per record(): start and end of one move are one tick apart.
    assert {r.duration_s for r in recorded.records} == {0.002}


def test_moves_appear_in_the_profiler():
    pipe = toy.build()
    add_hook_to_module(pipe.transformer, _QuietHook())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        with doe.trace(pipe):
            pipe(["transformer"])
    names = {event.name for event in profile.events()}
    assert "diffusers_offload_ext::hook::_QuietHook.post_forward(transformer)" in names
    assert "diffusers_offload_ext::offload::transformer (observed in _QuietHook.post_forward(transformer))" in names
    mixed = _mixed()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        with doe.trace(mixed):
            mixed(["transformer"])
    assert "diffusers_offload_ext::onload::transformer" in {event.name for event in profile.events()}


def test_the_pipeline_is_left_as_it_was():
    pipe = toy.build()
    pipe.enable_model_cpu_offload(device="cpu")
    cls = type(pipe)
    hook = pipe.transformer._hf_hook
    pre_hooks = len(torch.nn.modules.module._global_forward_pre_hooks)
    recorded = doe.trace(pipe)
    with pytest.raises(RuntimeError, match="failure at event 1"):
        with recorded:
            assert type(pipe) is not cls and isinstance(pipe, cls) and type(pipe).__name__ == cls.__name__
            pipe(["text_encoder", "transformer", "vae"], fail_at=1)
    assert type(pipe) is cls
    assert "pre_forward" not in vars(hook) and "pre_forward" not in vars(pipe.transformer._hf_hook)
    assert len(torch.nn.modules.module._global_forward_pre_hooks) == pre_hooks
    assert recorded.calls[0].failed
    # Entering again records more calls into the same trace.
    with recorded:
        pipe(["text_encoder"])
    assert [c.index for c in recorded.calls] == [0, 1] and not recorded.calls[1].failed
    with pytest.raises(TypeError):
        doe.trace(object())


def test_nested_traces_of_one_pipeline_are_refused():
    pipe = toy.build()
    with doe.trace(pipe):
        with pytest.raises(RuntimeError, match="already being traced"):
            with doe.trace(pipe):
                pass
    assert type(pipe) is toy.TracePipeline
