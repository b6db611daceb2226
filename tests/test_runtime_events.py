"""The end of a call is its own event: one session event per call, told whether the call failed, with no round trip
through stock's `maybe_free_model_hooks()`; when offload is armed again with nothing changed (at the end of every
call, or an enable with the same options), hooks and policy stay and no parameter is walked; anything that did change
arms everything again."""

import pytest
import toy
import torch

pytestmark = [pytest.mark.plugin_only, pytest.mark.usefixtures("accelerator")]

PREVIEW = ["text_encoder", "text_encoder_2", "transformer", "vae", "transformer", "vae", "vae"]
OPTIONS = {
    "defaults": {},
    "exclude": {"exclude_from_offload": ["transformer"]},
    "keep": {"keep_on_device_during_generation": True},
    "residency": {"keep_on_device_between_generations": True},
}
WALKS = ("parameters", "named_parameters", "buffers", "named_buffers", "modules", "named_modules", "_apply", "to")


def hooks(pipe):
    return {n: getattr(m, "_hf_hook", None) for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}


@pytest.mark.parametrize("option", OPTIONS)
def test_hooks_stay_across_calls(installed, option):
    pipe = toy.build()
    pipe.enable_model_cpu_offload(device="cpu", **OPTIONS[option])
    before = hooks(pipe)
    for _ in range(3):
        pipe(PREVIEW)
    assert hooks(pipe) == before and all(h is before[n] for n, h in hooks(pipe).items())


def count_walks(monkeypatch):
    counted = []
    for method in WALKS:
        original = getattr(torch.nn.Module, method)

        def counting(self, *args, _original=original, _name=method, **kwargs):
            counted.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.nn.Module, method, counting)
    return counted


def test_end_of_call_with_nothing_to_move_walks_no_parameter(installed, monkeypatch):
    pipe = toy.build()
    pipe.enable_model_cpu_offload(device="cpu", keep_on_device_between_generations=True)
    pipe(PREVIEW)
    counted = count_walks(monkeypatch)
    pipe.maybe_free_model_hooks()
    pipe.enable_model_cpu_offload()  # the same options again, as diffusers' LoRA loading does
    pipe.enable_model_cpu_offload(device="cpu")
    assert counted == []


def test_end_of_call_walks_only_what_it_moves(installed, monkeypatch):
    """Stock's chain sends every offloaded component home at the end of a call: the walks are those moves' own."""
    doe = installed
    pipe = toy.build()
    pipe.enable_model_cpu_offload(device="cpu")
    pipe.transformer()  # one component on the device
    ledger = doe.transfer_ledger(pipe)
    ledger.clear()
    counted = count_walks(monkeypatch)
    pipe.maybe_free_model_hooks()
    moved = [(r.component, r.direction) for r in ledger.records]
    assert moved == [("transformer", "offload"), ("safety_checker", "offload"), ("safety_checker", "onload")]
    copies = [r for r in ledger.records if r.kind != "drop"]  # a drop puts the host tensors back: no `.to()`
    assert counted.count("to") == len(copies)


def test_a_change_arms_everything_again(installed):
    pipe = toy.build()
    pipe.enable_model_cpu_offload(device="cpu")
    before = hooks(pipe)
    pipe.enable_model_cpu_offload(keep_on_device_during_generation=True)  # new options
    after = hooks(pipe)
    assert all(after[n] is not before[n] for n in after if before[n] is not None)
    pipe.text_encoder = toy.Block(toy.WIDTHS["text_encoder"])  # a component replaced
    pipe(PREVIEW)
    assert isinstance(pipe.text_encoder._hf_hook, type(after["transformer"]))


class WithoutFree(toy.TracePipeline):
    """Ends its calls without `maybe_free_model_hooks()`, as a combined pipeline armed whole does."""

    def __call__(self, trace=(), fail_at=None):
        for index, name in enumerate(trace):
            if index == fail_at:
                raise RuntimeError(f"failure at event {index}")
            getattr(self, name)()
        return list(trace)


class FreeingTwice(toy.TracePipeline):
    """Calls `maybe_free_model_hooks()` twice at the end of its calls."""

    def __call__(self, trace=()):
        result = super().__call__(trace)
        self.maybe_free_model_hooks()
        return result


def spy_ends(monkeypatch):
    """Every `Session.end_of_call(failed)`, and every call of stock's `maybe_free_model_hooks` or
    `enable_model_cpu_offload` made while the extension has the pipeline armed (the round trip there was)."""
    from diffusers_offload_ext import marks
    from diffusers_offload_ext.runtime.session import Session

    ends, round_trips = [], []
    original = Session.end_of_call

    def end_of_call(self, failed):
        ends.append(failed)
        return original(self, failed)

    monkeypatch.setattr(Session, "end_of_call", end_of_call)
    for name in ("maybe_free_model_hooks", "enable_model_cpu_offload"):
        stock = marks.STOCK[name]

        def spied(pipe, *args, _stock=stock, _name=name, **kwargs):
            session = marks.get_session(pipe)
            if session is not None and session.active:
                round_trips.append(_name)
            return _stock(pipe, *args, **kwargs)

        monkeypatch.setitem(marks.STOCK, name, spied)
    return ends, round_trips


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("kind", [toy.TracePipeline, WithoutFree, FreeingTwice], ids=lambda k: k.__name__)
def test_the_end_of_a_call_is_one_session_event_with_the_failure(installed, monkeypatch, option, kind):
    pipe = toy.build(kind)
    pipe.enable_model_cpu_offload(device="cpu", **OPTIONS[option])
    ends, round_trips = spy_ends(monkeypatch)
    pipe(PREVIEW)
    pipe.maybe_free_model_hooks()  # outside a call: offload armed again, not a call's end
    pipe.enable_model_cpu_offload()
    assert ends == [False]
    if kind is not FreeingTwice:
        with pytest.raises(RuntimeError, match="failure at event 2"):
            pipe(PREVIEW, fail_at=2)
        assert ends == [False, True]
    pipe(PREVIEW)
    assert ends[-1] is False and len(ends) == (2 if kind is FreeingTwice else 3)
    assert round_trips == []
    if option in ("defaults", "keep"):  # and the end of the call sent everything offloaded home, as stock
        assert {n for n, c in installed.offload_status(pipe).components.items() if c.resident} == {"safety_checker"}
