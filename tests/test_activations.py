"""The parts of issue 25 that need no pipeline: the policy's recovery rungs and component limits (pure Python), the
call shape read from a call's arguments, the reserve and its margin, `transfer/memory.py`'s CUDA readings through a
fake of `torch.cuda`, and the planner's `--activations`."""

import contextlib
import json

import pytest
import torch

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: out-of-memory recovery")

from diffusers_offload_ext.cli import main  # noqa: E402
from diffusers_offload_ext.constants import GiB, MiB, OFFLOAD, ONLOAD, STREAM  # noqa: E402
from diffusers_offload_ext.models import plan  # noqa: E402
from diffusers_offload_ext.policies import NOTHING, ChainPolicy, Facts  # noqa: E402
from diffusers_offload_ext.residency.policy import ResidencyPolicy  # noqa: E402
from diffusers_offload_ext.residency.reserve import MARGIN_FLOOR, MAX_MISSES, reserve_for  # noqa: E402
from diffusers_offload_ext.recovery.activations import MAX_SHAPES, Activations, call_shape  # noqa: E402
from diffusers_offload_ext.transfer import memory  # noqa: E402

pytestmark = pytest.mark.plugin_only
ORDER = ("text_encoder", "transformer", "vae", "safety_checker")
SIZES = {"text_encoder": 100, "transformer": 800, "vae": 200, "safety_checker": 50}


def residency(**kwargs):
    return ResidencyPolicy(
        order=ORDER,
        chain=ORDER[:3],
        hooked=ORDER[:3],
        sizes=SIZES,
        round_trip=("safety_checker",),
        budget=kwargs.pop("budget", 2000),
        keep_between=True,
        **kwargs,
    )


def test_the_rungs_evict_the_others_then_stream_in_half_then_the_least_room_then_nothing():
    facts = Facts(SIZES)
    for policy in (residency(), ChainPolicy(order=ORDER, chain=ORDER[:3], hooked=ORDER[:3], excluded=("vae",))):
        resident = {"text_encoder", "transformer", "vae", "safety_checker"}
        first = policy.on_out_of_memory("transformer", resident, facts, running=(), held=800, least=300)
        kept = {"vae"} if isinstance(policy, ChainPolicy) else set()  # excluded: never leaves
        assert first.moves == tuple((OFFLOAD, n) for n in ("text_encoder", "vae") if n not in kept)
        # A component whose forward is running (it called this one) is never evicted.
        running = policy.on_out_of_memory("transformer", resident, facts, running=("text_encoder",), held=800)
        assert (OFFLOAD, "text_encoder") not in running.moves
        alone = {"transformer", "safety_checker"} | kept
        half = policy.on_out_of_memory("transformer", alone, facts, held=800, least=300)
        assert half.moves == ((OFFLOAD, "transformer"), (STREAM, "transformer")) and half.overflow.limit == 400
        least = policy.on_out_of_memory("transformer", alone, facts, held=400, least=300)
        assert least.overflow.limit == 300
        assert policy.on_out_of_memory("transformer", alone, facts, held=300, least=300) is NOTHING
        assert policy.on_out_of_memory("transformer", alone, facts, held=800, least=None) is NOTHING  # no blocks
        # Not on the device (its load ran out of memory): it streams without an eviction of itself first.
        assert policy.on_out_of_memory("transformer", set(), facts, held=800, least=300).moves == (
            (STREAM, "transformer"),
        )


def test_a_component_limit_keeps_the_others_off_while_it_runs_and_streams_it_if_it_is_whole():
    facts = Facts(SIZES, stream_rooms={"transformer": 300})
    policy = residency(limits={"vae": 300, "transformer": 450})
    assert policy.allowed("vae") == 300 and policy.allowed("text_encoder") == 2000
    policy.on_call_start(policy.calls)
    # The VAE runs with the transformer on the device: its limit (300, the round trip's 50 in it) leaves it alone.
    decision = policy.on_use("vae", {"transformer", "text_encoder", "safety_checker"}, facts)
    assert set(decision.moves) == {(OFFLOAD, "transformer"), (OFFLOAD, "text_encoder"), (ONLOAD, "vae")}
    # The transformer, whole on the device, runs: more than its limit; it streams within it, not below its least room.
    again = policy.on_use("transformer", {"transformer", "safety_checker"}, facts)
    assert again.moves == ((OFFLOAD, "transformer"), (STREAM, "transformer")) and again.overflow.limit == 400
    assert not policy.on_use("transformer", {"transformer", "safety_checker"}, facts).moves  # streaming already
    policy.limit_while("vae", 250)
    policy.limit_while("vae", 280)  # never up
    assert policy.allowed("vae") == 250
    assert residency(limits={"vae": 300}).config != residency().config  # a new plan when the limits change


def test_the_reserve_is_the_activations_and_a_margin_widened_by_each_miss():
    assert reserve_for(4 * GiB) == 5 * GiB
    assert reserve_for(100 * MiB) == 100 * MiB + MARGIN_FLOOR
    assert reserve_for(4 * GiB, misses=2) == 4 * GiB + 3 * GiB
    assert reserve_for(4 * GiB, misses=99) == 4 * GiB + (1 + MAX_MISSES) * GiB  # bounded


def test_the_call_shape_is_read_from_the_arguments_that_change_activations():
    from PIL import Image

    assert call_shape(("a cat",), {}) == ()
    assert call_shape((), {"prompt": ["a", "b"], "height": 1024, "width": 768, "num_frames": 81}) == (
        ("height", 1024),
        ("width", 768),
        ("num_frames", 81),
        ("prompts", 2),
    )
    embeds = torch.zeros(3, 7, 4)
    assert call_shape((), {"prompt_embeds": embeds, "num_images_per_prompt": 2}) == (
        ("num_images_per_prompt", 2),
        ("prompts", 3),
    )
    assert call_shape((), {"image": Image.new("RGB", (640, 480))}) == (("image", (480, 640)),)
    assert call_shape((), {"image": [torch.zeros(1, 3, 64, 32)], "height": True}) == (("image", (64, 32)),)


def test_what_is_learnt_is_per_shape_and_component_and_bounded():
    learnt = Activations()
    learnt.expect((("height", 64),))
    assert learnt.plan(3 * GiB) == (3 * GiB, {}, {})
    learnt.recovered("vae", held=500, within=True)
    assert learnt.plan(3 * GiB) == (3 * GiB, {}, {"vae": 500})
    learnt.recovered("vae", held=700, within=True)  # the least that fitted stays
    assert learnt.status()[0].fitted == {"vae": 500} and learnt.status()[0].recoveries == 2
    for index in range(MAX_SHAPES + 5):
        learnt.expect((("height", index),))
        learnt.recovered("vae", held=1, within=False)
    assert len(learnt.status()) == MAX_SHAPES


def test_only_the_calls_that_teach_are_measured(monkeypatch):
    """Measuring resets the allocator's peak at each component: the first call of a shape is measured until one
    completes, then no call of it, until an out-of-memory error in a call that was not measured."""
    resets = []
    monkeypatch.setattr(memory, "peak_bytes", lambda device: 900)
    monkeypatch.setattr(memory, "allocated_bytes", lambda device: 100)
    monkeypatch.setattr(memory, "reset_peak", lambda device: resets.append(device))
    learnt, device = Activations(), torch.device("cuda", 0)

    def call(fails=False, recovers=False):
        learnt.begin(device, held=100)
        measured = learnt.measuring
        learnt.open(device, 100, "vae")
        if recovers:
            learnt.recovered("vae", held=100, within=True)
        learnt.end(device, failed=fails)
        return measured

    learnt.expect((("height", 64),))
    assert [call(fails=True), call(), call(), call()] == [True, True, False, False]
    assert learnt.status()[0].activations == {"vae": 800}
    assert [call(recovers=True), call(), call()] == [False, True, False]
    learnt.expect((("height", 32),))  # a new shape teaches; its error, measured, teaches no more calls
    assert [call(recovers=True), call()] == [True, False]
    count = len(resets)
    call()
    assert len(resets) == count  # a call not measured leaves the peak alone


class FakeCuda:
    """What `transfer/memory.py` calls of `torch.cuda`, recorded."""

    def __init__(self):
        self.calls = []

    def max_memory_allocated(self, device):
        self.calls.append(("peak", device))
        return 7 * GiB

    def memory_allocated(self, device):
        self.calls.append(("allocated", device))
        return 5 * GiB

    def reset_peak_memory_stats(self, device):
        self.calls.append(("reset", device))

    def empty_cache(self):
        self.calls.append(("empty", self.current))

    @contextlib.contextmanager
    def device(self, device):
        self.current = device
        yield
        self.current = None


def test_the_cuda_readings_go_through_torch_cuda_and_are_none_elsewhere(monkeypatch):
    fake = FakeCuda()
    for name in ("max_memory_allocated", "memory_allocated", "reset_peak_memory_stats", "empty_cache", "device"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    cuda = torch.device("cuda", 1)
    assert memory.peak_bytes(cuda) == 7 * GiB and memory.allocated_bytes(cuda) == 5 * GiB
    memory.reset_peak(cuda)
    memory.release_cached(cuda)
    assert fake.calls == [("peak", cuda), ("allocated", cuda), ("reset", cuda), ("empty", cuda)]
    cpu = torch.device("cpu", 0)
    assert memory.peak_bytes(cpu) is None and memory.allocated_bytes(cpu) is None
    memory.reset_peak(cpu)
    memory.release_cached(cpu)
    assert len(fake.calls) == 4  # nothing called for another device


def test_the_plan_states_its_activation_assumption_and_takes_a_known_size(capsys):
    assumed = plan("flux-dev", vram="24GiB")  # estimated for the model's own call (issue 34), with the margin
    estimated = assumed["activations"]
    assert estimated["given"] is False and estimated["source"] == "estimated"
    assert assumed["reserve_bytes"] == reserve_for(estimated["bytes"]) and 2 * GiB < estimated["bytes"] < 3 * GiB
    assert "ESTIMATED" in estimated["note"] and "--activations" in estimated["note"]
    assert plan("flux-dev", vram="24GiB", reserve="3GiB")["reserve_bytes"] == 3 * GiB  # given: as given
    known = plan("flux-dev", vram="24GiB", activations="6GiB")
    assert known["activations"]["bytes"] == 6 * GiB and known["reserve_bytes"] == reserve_for(6 * GiB)
    assert known["strategies"]["residency"]["budget_bytes"] <= 24 * GiB - reserve_for(6 * GiB)
    assert main(["plan", "--model", "flux-dev", "--activations", "6GiB"]) == 0
    assert "Activations given: 6.00 GiB" in capsys.readouterr().out
    for bad, message in (
        ("6", "without a unit, under 1.00 MiB"),
        ("0GiB", "more than 0 bytes"),
        ("-1GiB", "negative"),
        ("1e99", "too large"),
        ("30GiB", "leaves nothing of the card"),
    ):
        assert main(["plan", "--model", "flux-dev", f"--activations={bad}", "--json"]) == 2
        result = json.loads(capsys.readouterr().out)
        assert result["argument"] == "--activations" and message in result["error"], (bad, result)
