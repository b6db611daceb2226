"""The residency manager at run time: options, budgets (CUDA paths through mocked memory functions), keeping
components between calls, `release`, exceptions, zero-copy eviction and change detection, and the replay of the
tiny pipelines' traces.

On the CPU, host and "device" tensors are the same memory, so a lost change would go unnoticed. `DeviceMemory`
makes every onload give the component fresh tensors (as a real copy to an accelerator does): a change made on the
device then lives only there, and an eviction that dropped it would show.
"""

import copy
import logging
import weakref

import pytest
import toy
import torch
from diffusers.utils.accelerate_utils import apply_forward_hook
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: the residency manager is not in the upstream patch")

import diffusers_offload_ext as doe  # noqa: E402
from diffusers_offload_ext import _memory, _options, _zerocopy
from diffusers_offload_ext._policy import END, ChainPolicy
from diffusers_offload_ext._residency import ResidencyPolicy, simulate

pytestmark = pytest.mark.plugin_only

EXEC = torch.device("cpu", 0)
HOST = torch.device("cpu")
OFFLOADED = ("text_encoder", "text_encoder_2", "transformer", "vae", "controlnet")
SIZES = {"text_encoder": 60, "text_encoder_2": 140, "transformer": 320, "vae": 96, "controlnet": 192}
FIXED = 32  # safety_checker: the class's `_exclude_from_cpu_offload`, always on the device
HYPOTHESIS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


class Block(torch.nn.Module):
    """Like `toy.Block`, but runs wherever its weights are (also on `meta`)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)
        self.register_buffer("scale", torch.ones(width))

    @property
    def dtype(self):  # `DiffusionPipeline.to` asks modules for it
        return self.linear.weight.dtype

    def forward(self, x=None):
        weight = self.linear.weight
        x = torch.ones(weight.shape[1], device=weight.device, dtype=weight.dtype) if x is None else x
        return self.linear(x) * self.scale


class Vae(Block):
    @apply_forward_hook
    def decode(self, x=None):
        return self.forward(x)


def build(seed=0):
    torch.manual_seed(seed)
    modules = {name: Block(width) for name, width in toy.WIDTHS.items() if name != "vae"}
    return toy.TracePipeline(vae=Vae(toy.WIDTHS["vae"]), **modules)


def resident_bytes(pipe):
    state = pipe._offload_ext_state
    return sum(doe.module_nbytes(state.modules[n]) for n in state.resident)


class DeviceMemory:
    """Spy on `Module.to` for the pipeline's components; onloads (to `cpu:0`) get fresh tensors.

    `moves` lists `(component, "onload"|"offload")` for every real `.to()`. `on_device(name)` tells where the
    component's weights are from the tensors themselves: the onload's fresh tensors (kept alive here, so that their
    memory is not reused) are still in place, not the host ones a drop puts back nor a copy back. A test that
    edits a component tells `edited(name, was_on_device)`: new tensors made on the device are device tensors.
    """

    def __init__(self, pipe, fresh=True):
        self.names = {id(m): n for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
        self.modules = {n: m for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
        self.fresh = fresh
        self.moves = []
        self.device_tensors = {}
        self.on_copy_back = None

    def __enter__(self):
        spy, original = self, torch.nn.Module.to
        self.original = original

        def to(module, *args, **kwargs):
            name = spy.names.get(id(module))
            device = torch._C._nn._parse_to(*args, **kwargs)[0]
            if name is None or device is None:
                return original(module, *args, **kwargs)
            if device == HOST:
                if spy.on_copy_back is not None:
                    spy.on_copy_back(name)
                spy.moves.append((name, "offload"))
                spy.device_tensors.pop(name, None)
                return original(module, *args, **kwargs)
            result = original(module, *args, **kwargs)
            spy.moves.append((name, "onload"))
            if spy.fresh and device == EXEC:
                for sub in module.modules():
                    for key, param in sub._parameters.items():
                        if param is not None:
                            param.data = param.data.clone()
                    for key, buffer in sub._buffers.items():
                        if buffer is not None:
                            sub._buffers[key] = buffer.clone()
                spy.device_tensors[name] = {t.data_ptr(): t for t in spy.tensors(name)}
            return result

        torch.nn.Module.to = to
        return self

    def __exit__(self, *exc):
        torch.nn.Module.to = self.original

    def tensors(self, name):
        module = self.modules[name]
        return [t.data for t in list(module.parameters()) + list(module.buffers())]

    def on_device(self, name):
        tensors = self.device_tensors.get(name)
        return bool(tensors) and self.tensors(name)[0].data_ptr() in tensors

    def edited(self, name, was_on_device):
        if was_on_device:
            self.device_tensors[name].update({t.data_ptr(): t for t in self.tensors(name)})


def ledger_moves(pipe, start=0):
    moves = []
    for record in doe.transfer_ledger(pipe).records[start:]:
        if record.direction == "onload":
            moves.append((record.component, "onload"))
        elif record.kind == "copy":
            moves.append((record.component, "offload"))
    return moves


# -- options ----------------------------------------------------------------------------------------------------------
BAD = [
    (dict(memory_budget="twelve gigs"), ValueError, r"`memory_budget`.*'twelve gigs'.*GiB"),
    (dict(memory_budget="12 parsecs"), ValueError, r"Valid units are"),
    (dict(memory_budget=-1), ValueError, r"`memory_budget` must not be negative, got -1"),
    (dict(memory_budget="-2GiB"), ValueError, r"must not be negative, got '-2GiB'"),
    (dict(memory_budget=True), ValueError, r"`memory_budget` must be a size in bytes, not a bool"),
    (dict(memory_budget=1.5e9), TypeError, r"`memory_budget` must be an int"),
    (dict(memory_budget=["12GiB"]), TypeError, r"`memory_budget` must be an int"),
    (dict(memory_reserve="lots"), ValueError, r"`memory_reserve`"),
    (dict(memory_reserve=-5), ValueError, r"`memory_reserve` must not be negative"),
    (dict(memory_reserve=False), ValueError, r"not a bool"),
    (dict(keep_on_device_between_generations="yes"), TypeError, r"`keep_on_device_between_generations`"),
    (dict(zero_copy_eviction=1), TypeError, r"`zero_copy_eviction`"),
    # Excluded components (transformer 320 + the class's safety_checker 32) alone exceed the budget.
    (dict(exclude_from_offload=["transformer"], memory_budget=300), ValueError, r"'safety_checker', 'transformer'"),
]


@pytest.mark.parametrize("kwargs, error, match", BAD)
def test_bad_options_raise_and_change_nothing(installed, kwargs, error, match):
    pipe = build()
    pipe.enable_model_cpu_offload(device="cpu", memory_budget=10_000, keep_on_device_between_generations=True)
    pipe(["text_encoder", "transformer"])
    state = pipe._offload_ext_state
    before = (state.options, state.policy, set(state.resident), len(state.ledger), list(pipe._all_hooks))
    with pytest.raises(error, match=match):
        pipe.enable_model_cpu_offload(**kwargs)
    assert (state.options, state.policy, set(state.resident), len(state.ledger), list(pipe._all_hooks)) == before
    assert pipe(["vae"]) == ["vae"]


def test_reserve_larger_than_the_device(installed, monkeypatch):
    monkeypatch.setattr(_memory, "total_bytes", lambda device: 8 << 30)
    monkeypatch.setattr(_memory, "free_bytes", lambda device: 6 << 30)
    pipe = build()
    with pytest.raises(ValueError, match=r"`memory_reserve` is 9.00 GiB .* more than the whole device"):
        pipe.enable_model_cpu_offload(device="cpu", keep_on_device_between_generations=True, memory_reserve="9GiB")
    assert getattr(pipe, "_offload_ext_state", None) is None or not pipe._offload_ext_state.active


def test_options_are_sticky_and_reset(installed):
    pipe = build()
    pipe.enable_model_cpu_offload(device="cpu", memory_budget="1KiB", keep_on_device_between_generations=True)
    state = pipe._offload_ext_state
    pipe(["text_encoder"])  # the end of the call re-enables with no arguments
    pipe.enable_model_cpu_offload()  # so does LoRA loading
    assert (state.options.memory_budget, state.options.keep_between, state.options.zero_copy) == (1024, True, True)
    assert isinstance(state.policy, ResidencyPolicy) and state.policy.budget == 1024
    pipe.enable_model_cpu_offload(memory_budget="2KB", zero_copy_eviction=False)
    assert (state.options.memory_budget, state.options.keep_between, state.options.zero_copy) == (2000, True, False)
    pipe.enable_model_cpu_offload(memory_budget="auto", keep_on_device_between_generations=False)
    assert not state.options.residency and isinstance(state.policy, ChainPolicy)
    # Back to stock: every move a copy again, everything back on the host at the end of a call.
    start = len(state.ledger)
    pipe(["text_encoder", "transformer"])
    assert all(r.kind == "copy" for r in state.ledger.records[start:])
    assert state.resident == {"safety_checker"}


def test_default_options_never_start_the_manager(installed):
    pipe = build()
    pipe.enable_model_cpu_offload(device="cpu")
    pipe(["text_encoder", "transformer", "vae", "transformer", "vae"])
    state = pipe._offload_ext_state
    assert isinstance(state.policy, ChainPolicy) and not state.zero_copy and not state.host_copies
    assert all(r.kind == "copy" for r in state.ledger.records)


# -- budgets ----------------------------------------------------------------------------------------------------------
def test_automatic_budget_on_cuda(installed, monkeypatch):
    """`None` on CUDA: free memory at enable + what the pipeline holds there - reserve (memory functions mocked)."""
    monkeypatch.setattr(_memory, "total_bytes", lambda device: 1 << 20)
    monkeypatch.setattr(_memory, "free_bytes", lambda device: 1000)
    monkeypatch.setattr(_options, "AUTO_BUDGET_STEP", 1)
    pipe = build()
    pipe.enable_model_cpu_offload(device="cpu", keep_on_device_between_generations=True, memory_reserve=100)
    state = pipe._offload_ext_state
    assert state.policy.budget == 1000 - 100  # nothing on the device yet
    pipe(["text_encoder", "transformer"])
    held = resident_bytes(pipe)
    assert held == FIXED + SIZES["text_encoder"] + SIZES["transformer"]
    assert state.policy.budget == 1000 + held - 100  # re-read at the end-of-call enable
    # On devices without memory information (CPU, MPS, ...) the automatic budget is unlimited.
    monkeypatch.setattr(_memory, "free_bytes", lambda device: None)
    pipe.enable_model_cpu_offload()
    assert state.policy.budget is None


def test_automatic_budget_is_rounded_down(installed, monkeypatch):
    monkeypatch.setattr(_memory, "total_bytes", lambda device: 80 << 30)
    monkeypatch.setattr(_memory, "free_bytes", lambda device: (20 << 30) + 12345)
    pipe = build()
    pipe.enable_model_cpu_offload(device="cpu", keep_on_device_between_generations=True)
    assert pipe._offload_ext_state.policy.budget == (17 << 30)  # 20 GiB free - the default 3 GiB reserve


def test_free_memory_is_read_again_before_each_onload(installed, monkeypatch):
    """On CUDA, memory taken by others since enable is respected: the next onload evicts to fit in it."""
    free = {"bytes": 1 << 20}
    reads = []

    def free_bytes(device):
        reads.append(device)
        return free["bytes"]

    monkeypatch.setattr(_memory, "total_bytes", lambda device: 80 << 30)
    monkeypatch.setattr(_memory, "free_bytes", free_bytes)
    pipe = build()
    pipe.enable_model_cpu_offload(device="cpu", memory_budget=10_000, keep_on_device_between_generations=True)
    pipe(["text_encoder", "text_encoder_2", "transformer"])
    assert pipe._offload_ext_state.resident == {"safety_checker", "text_encoder", "text_encoder_2", "transformer"}
    free["bytes"] = 0  # someone else took all the free memory: only what we hold can be reused
    held = resident_bytes(pipe)
    reads_after = []
    reads.clear()
    pipe(["transformer", "vae"], probe=lambda index, name: reads_after.append(len(reads)))
    assert reads_after == [0, 1]  # the transformer was resident: no onload, no read; the vae's onload read it
    assert "vae" in pipe._offload_ext_state.resident
    assert resident_bytes(pipe) <= held


def test_larger_than_budget_runs_alone_with_one_warning(installed, caplog):
    pipe = build()
    budget = FIXED + 200  # the transformer (320) does not fit even alone
    pipe.enable_model_cpu_offload(device="cpu", memory_budget=budget, keep_on_device_between_generations=True)
    state = pipe._offload_ext_state
    seen = []

    def probe(index, name):
        seen.append((name, set(state.resident)))

    with caplog.at_level(logging.WARNING, logger="diffusers_offload_ext"):
        for _ in range(3):
            pipe(["text_encoder", "transformer", "text_encoder", "vae", "transformer"], probe=probe)
    warnings = [r for r in caplog.records if "does not fit in the memory budget" in r.getMessage()]
    assert len(warnings) == 1 and "`transformer`" in warnings[0].getMessage()
    for name, resident in seen:
        assert name in resident
        if name == "transformer":
            assert resident == {"transformer", "safety_checker"}  # alone (with the always-resident one)
        else:
            assert sum(SIZES.get(n, FIXED) for n in resident) <= budget


# -- keeping between calls, release, exceptions ---------------------------------------------------------------------
def test_keep_between_generations_and_release(installed):
    pipe = build()
    pipe.enable_model_cpu_offload(device="cpu", memory_budget="1MiB", keep_on_device_between_generations=True)
    ledger = doe.transfer_ledger(pipe)
    trace = ["text_encoder", "text_encoder_2", "transformer", "vae", "transformer", "vae"]
    pipe(trace)
    first = ledger.copied_bytes(call_index=0)
    assert first == sum(SIZES[n] for n in set(trace))
    pipe(trace)
    assert ledger.copied_bytes(call_index=1) == 0  # everything stayed
    assert doe.release(pipe) == sum(SIZES[n] for n in set(trace))
    assert pipe._offload_ext_state.resident == {"safety_checker"}  # excluded components stay
    assert all(r.kind == "drop" for r in ledger.records[-4:])  # nothing was copied back
    pipe(trace)
    assert ledger.copied_bytes(call_index=2) == first  # they come back on their own
    assert doe.release(pipe) > 0 and doe.release(pipe) == 0


def test_release_in_the_middle_of_a_call_and_explicit_moves(installed):
    pipe = build()
    pipe.enable_model_cpu_offload(device="cpu", memory_budget="1MiB", keep_on_device_between_generations=True)
    state = pipe._offload_ext_state
    released = []
    pipe(["text_encoder", "transformer", "vae"], probe=lambda i, name: i == 1 and released.append(doe.release(pipe)))
    assert released == [SIZES["text_encoder"] + SIZES["transformer"]]
    assert state.resident == {"safety_checker", "vae"}  # the vae ran after the release and came back
    assert set(state.host_copies) == {"vae"}  # the always-resident safety_checker keeps no host copy
    pipe.to("cpu")  # an explicit move: the host copies of what left the device are stale now
    assert state.resident == set() and state.host_copies == {}


def test_release_without_the_extension_does_nothing(installed):
    pipe = build()
    assert doe.release(pipe) == 0
    with pytest.raises(TypeError):
        doe.release("not a pipeline")


@pytest.mark.parametrize("interrupt", [False, True])
def test_exception_mid_call_keeps_the_budget_and_the_next_call_works(installed, interrupt):
    pipe = build()
    budget = FIXED + 460  # transformer + text_encoder_2 fit, not with the vae too
    trace = ["text_encoder", "text_encoder_2", "transformer", "vae", "transformer", "vae"]
    over = []

    def probe(index, name):
        if resident_bytes(pipe) > budget or name not in state.resident:
            over.append((index, name, set(state.resident)))

    with DeviceMemory(pipe) as spy:
        pipe.enable_model_cpu_offload(device="cpu", memory_budget=budget, keep_on_device_between_generations=True)
        state = pipe._offload_ext_state
        pipe(trace, probe=probe)
        traces_before = list(state.traces)
        with pytest.raises(KeyboardInterrupt if interrupt else RuntimeError):
            pipe(trace, fail_at=4, interrupt=interrupt, probe=probe)
        assert resident_bytes(pipe) <= budget
        assert state.traces == traces_before  # the failed call does not become the prediction
        assert state.call_depth == 0 and state.active
        assert pipe(trace, probe=probe) == trace
        assert state.policy.history == list(state.traces)
    assert not over
    assert ledger_moves(pipe) == spy.moves
    for name in OFFLOADED:
        assert spy.on_device(name) == (name in state.resident), name


# -- zero-copy eviction ------------------------------------------------------------------------------------------------
def test_zero_copy_eviction_drops_without_copying_on_meta(installed):
    """Onload to `meta`: a device with no data. If the eviction copied back, the weights would be gone (or the copy
    would fail); only putting the kept host tensors back can restore them."""
    pipe = build()
    originals = {n: {k: v.clone() for k, v in m.state_dict().items()} for n, m in pipe.components.items() if m}
    pointers = {n: m.linear.weight.data_ptr() for n, m in pipe.components.items() if m}
    with DeviceMemory(pipe, fresh=False) as spy:
        pipe.enable_model_cpu_offload(device="meta", memory_budget="1MiB")
        pipe(["text_encoder", "transformer", "vae", "controlnet"])
        assert pipe.transformer.linear.weight.device.type == "cpu"
    records = doe.transfer_ledger(pipe).records
    offloads = [r for r in records if r.direction == "offload"]
    assert {r.component for r in offloads} == {"text_encoder", "transformer", "vae", "controlnet"}
    assert all(r.kind == "drop" for r in offloads)
    assert not any(device == "offload" for _, device in spy.moves)  # no `.to("cpu")`
    for name in ("text_encoder", "transformer", "vae", "controlnet"):
        module = pipe.components[name]
        assert module.linear.weight.data_ptr() == pointers[name]  # the very same host memory
        assert all(torch.equal(module.state_dict()[k], v) for k, v in originals[name].items())


def test_copying_eviction_cannot_come_back_from_meta(installed):
    """The control for the test above: with zero-copy off, the eviction copies and fails on `meta`."""
    pipe = build()
    pipe.enable_model_cpu_offload(device="meta", memory_budget="1MiB", zero_copy_eviction=False)
    with pytest.raises(NotImplementedError, match="meta"):
        pipe(["transformer"])


def inplace(m):
    with torch.no_grad():
        m.linear.weight.mul_(2)


def data_inplace(m):  # how PEFT's default merge() fuses a LoRA: no version counter sees it
    m.linear.weight.data += 1


def data_replaced(m):
    m.linear.weight.data = m.linear.weight.data * 3


def parameter_replaced(m):
    m.linear.weight = torch.nn.Parameter(m.linear.weight.detach() + 1)


def parameter_added(m):
    m.register_parameter("extra", torch.nn.Parameter(torch.ones(2)))


def parameter_removed(m):
    m.linear.bias = None


def buffer_inplace(m):
    m.scale.add_(1)


def buffer_replaced(m):
    m.scale = m.scale * 2


def layer_added(m):  # LoRA layers injected next to a weight
    m.linear.lora = torch.nn.Linear(m.linear.in_features, 1, bias=False)
    torch.nn.init.constant_(m.linear.lora.weight, 0.5)


def dtype_changed(m):
    m.double()


EDITS = [
    inplace,
    data_inplace,
    data_replaced,
    parameter_replaced,
    parameter_added,
    parameter_removed,
    buffer_inplace,
    buffer_replaced,
    layer_added,
    dtype_changed,
]


def state_equal(a, b):
    a, b = a.state_dict(), b.state_dict()
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("edit", EDITS, ids=lambda f: f.__name__)
def test_a_change_made_on_the_device_is_copied_back(installed, edit):
    pipe = build()
    reference = copy.deepcopy(pipe.transformer)
    untouched = copy.deepcopy(pipe.vae)
    with DeviceMemory(pipe) as spy:
        pipe.enable_model_cpu_offload(device="cpu", memory_budget="1MiB", keep_on_device_between_generations=True)
        pipe(["transformer", "vae"])
        state = pipe._offload_ext_state
        edit(pipe.transformer)
        edit(reference)
        kept = weakref.ref(state.host_copies["transformer"])
        copied_back = []
        spy.on_copy_back = lambda name: copied_back.append((name, kept() is None))
        doe.release(pipe)
    records = {r.component: r for r in doe.transfer_ledger(pipe).records if r.direction == "offload"}
    assert records["transformer"].kind == "copy" and ("transformer", "offload") in spy.moves
    assert records["vae"].kind == "drop" and ("vae", "offload") not in spy.moves
    assert copied_back == [("transformer", True)]  # the stale host copy was freed before the copy back
    assert state_equal(pipe.transformer, reference)
    assert state_equal(pipe.vae, untouched)
    assert not spy.on_device("transformer") and not spy.on_device("vae")


def test_version_counters_alone_would_lose_an_edit_through_data(installed, monkeypatch):
    """Why the fingerprint exists: `weight.data += delta` bumps no version counter the parameter shows. Without
    the fingerprint the edit is dropped with the device copy (this is the failure the test above guards)."""
    monkeypatch.setattr(_zerocopy, "fingerprint", lambda tensor: torch.zeros(2, dtype=torch.int64))
    pipe = build()
    before = pipe.transformer.linear.weight.detach().clone()
    with DeviceMemory(pipe):
        pipe.enable_model_cpu_offload(device="cpu", memory_budget="1MiB", keep_on_device_between_generations=True)
        pipe(["transformer"])
        data_inplace(pipe.transformer)
        doe.release(pipe)
    assert torch.equal(pipe.transformer.linear.weight, before)  # lost
    assert doe.transfer_ledger(pipe).records[-1].kind == "drop"


def test_unfingerprintable_tensors_are_copied_back(installed, monkeypatch):
    def refuse(tensor):
        raise TypeError("no integer view")

    monkeypatch.setattr(_zerocopy, "fingerprint", refuse)
    pipe = build()
    pipe.enable_model_cpu_offload(device="cpu", memory_budget="1MiB", keep_on_device_between_generations=True)
    pipe(["transformer"])
    doe.release(pipe)
    assert doe.transfer_ledger(pipe).records[-1].kind == "copy"


@st.composite
def sessions(draw):
    calls = draw(st.lists(st.lists(st.sampled_from(OFFLOADED), max_size=8), min_size=1, max_size=4))
    edits = {}
    for c, trace in enumerate(calls):
        for i in range(len(trace)):
            if draw(st.integers(0, 4)) == 0:
                edits[(c, i)] = (draw(st.sampled_from(OFFLOADED)), draw(st.sampled_from(EDITS[:-1])))
    budget = FIXED + draw(st.integers(0, sum(SIZES.values())))
    keep_between = draw(st.booleans())
    return calls, edits, budget, keep_between


@HYPOTHESIS
@given(session=sessions())
def test_random_sessions_keep_the_budget_and_lose_no_change(installed, session):
    calls, edits, budget, keep_between = session
    note(f"edits {[(k, n, f.__name__) for k, (n, f) in edits.items()]}")
    pipe = build()
    references = {n: copy.deepcopy(pipe.components[n]) for n in OFFLOADED}
    problems = []
    with DeviceMemory(pipe) as spy:
        pipe.enable_model_cpu_offload(
            device="cpu", memory_budget=budget, keep_on_device_between_generations=keep_between
        )
        state = pipe._offload_ext_state
        seen = [len(state.ledger)]
        for c, trace in enumerate(calls):

            def probe(index, name, c=c):
                if name not in state.resident:
                    problems.append(f"{name} ran off the device")
                held = resident_bytes(pipe)
                size = doe.module_nbytes(pipe.components[name])  # edits may have added weights
                alone = state.resident - {"safety_checker"} == {name} and size + FIXED > budget
                # Checked after each onload (edits that add weights to a resident component count from the next
                # onload on: nothing can be evicted in between).
                onloaded = len(state.ledger) > seen[0] and state.ledger.records[-1].direction == "onload"
                seen[0] = len(state.ledger)
                if onloaded and held > budget and not alone:
                    problems.append(f"{held} bytes resident > budget {budget}")
                for other in OFFLOADED:
                    if spy.on_device(other) != (other in state.resident):
                        problems.append(f"{other}: ledger and placement disagree at event {index} of call {c}")
                if (c, index) in edits:
                    target, edit = edits[(c, index)]
                    was_on_device = spy.on_device(target)
                    edit(pipe.components[target])
                    spy.edited(target, was_on_device)
                    edit(references[target])

            pipe(trace, probe=probe)
            for name in OFFLOADED:
                if spy.on_device(name) != (name in state.resident):
                    problems.append(f"{name}: ledger and placement disagree")
        doe.release(pipe)
    assert not problems, problems
    assert ledger_moves(pipe) == spy.moves  # every onload and copy is a real `.to()`, every drop is not
    for name in OFFLOADED:
        assert state_equal(pipe.components[name], references[name]), name


# -- replay --------------------------------------------------------------------------------------------------------------
def replay_ledger(pipe, budget):
    """Replay the pipeline's recorded traces through a fresh policy: the moves it predicts, with kinds."""
    state = pipe._offload_ext_state
    policy = state.policy
    trace = [event for call in state.traces for event in list(call) + [END]]
    fresh = ResidencyPolicy(
        order=policy.order,
        chain=policy.chain,
        hooked=policy.hooked,
        sizes=policy.sizes,
        pinned=policy.pinned,
        bounce=policy.bounce,
        budget=budget,
        keep_between=True,
    )
    return simulate(fresh, trace, policy.sizes, zero_copy=True).moves


@pytest.mark.parametrize("name", ["flux", "wan22", "sd_controlnet"])
def test_replay_agrees_with_the_ledger_of_a_tiny_pipeline(installed, name):
    from diffusers_offload_ext import tiny

    ok, reason = tiny.available(name)
    if not ok:
        pytest.skip(reason)
    pipe = tiny.build(name)
    pipe.set_progress_bar_config(disable=True)
    sizes = {n: doe.module_nbytes(m) for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    budget = int(sum(sizes.values()) * 0.6)  # forces evictions every call
    pipe.enable_model_cpu_offload(device="cpu", memory_budget=budget, keep_on_device_between_generations=True)
    for seed, preview in enumerate((False, True, True)):
        tiny.run(pipe, name, seed=seed, preview=preview)
    real = [(r.direction, r.component, r.nbytes, r.kind, r.call_index) for r in doe.transfer_ledger(pipe).records]
    assert any(kind == "drop" for _, _, _, kind, _ in real)
    assert real == replay_ledger(pipe, budget)


def test_tiny_pipeline_images_are_unchanged(installed):
    from diffusers_offload_ext import tiny

    name = "flux"
    reference = tiny.run(tiny.build(name), name, seed=1, preview=True)
    pipe = tiny.build(name)
    pipe.set_progress_bar_config(disable=True)
    sizes = {n: doe.module_nbytes(m) for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    pipe.enable_model_cpu_offload(
        device="cpu", memory_budget=int(sum(sizes.values()) * 0.6), keep_on_device_between_generations=True
    )
    with DeviceMemory(pipe):
        for _ in range(2):
            assert torch.equal(tiny.run(pipe, name, seed=1, preview=True), reference)
        doe.release(pipe)
        assert torch.equal(tiny.run(pipe, name, seed=1, preview=True), reference)
