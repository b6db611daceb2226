"""The residency manager at run time: options, budgets (CUDA paths through mocked memory functions), keeping
components between calls, `release`, exceptions, and the replay of the tiny pipelines' traces. Each test runs on the
plain CPU and on the simulated accelerator, where placement is read from the tensors."""

import collections
import logging

import pytest
import tiny_pipelines as tiny
import torch
from diffusers.utils.accelerate_utils import apply_forward_hook
from harness import diffusers_logs, resident

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: the residency manager is not in the upstream patch")

import diffusers_offload_ext as doe  # noqa: E402
import toy  # noqa: E402
from diffusers_offload_ext.residency import budget as budget_module  # noqa: E402
from diffusers_offload_ext.blocks.find import block_sizes  # noqa: E402
from diffusers_offload_ext.blocks.items import block_items  # noqa: E402
from diffusers_offload_ext.blocks.streams import stream_room  # noqa: E402
from diffusers_offload_ext.transfer import memory  # noqa: E402

pytestmark = [pytest.mark.plugin_only, pytest.mark.usefixtures("accelerator")]

OFFLOADED = ("text_encoder", "text_encoder_2", "transformer", "vae", "controlnet")
SIZES = {"text_encoder": 60, "text_encoder_2": 140, "transformer": 320, "vae": 96, "controlnet": 192}
FIXED = 32  # safety_checker: the class's `_exclude_from_cpu_offload`, always on the device


class Block(torch.nn.Module):
    """Like `toy.Block`, but a plain module: runs wherever its weights are."""

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


def status(pipe):
    return doe.offload_status(pipe)


def resident_bytes(pipe):
    return status(pipe).resident_bytes


# -- options ----------------------------------------------------------------------------------------------------------
BAD = [
    (dict(memory_budget="twelve gigs"), ValueError, r"`memory_budget`='twelve gigs' is not .*GiB"),
    (dict(memory_budget="12 parsecs"), ValueError, r"unknown unit 'parsecs'"),
    (dict(memory_budget=-1), ValueError, r"`memory_budget` must not be negative, got -1"),
    (dict(memory_budget="-2GiB"), ValueError, r"`memory_budget`='-2GiB' is negative"),
    (dict(memory_budget="1e99999999"), ValueError, r"`memory_budget`='1e99999999' is too large"),
    (dict(memory_budget=10**400), ValueError, r"`memory_budget`=1000.* is too large"),
    (dict(memory_budget="9" * 100), ValueError, r"longer than 64 characters"),
    (dict(memory_budget=True), ValueError, r"`memory_budget` must be a size in bytes, not a bool"),
    (dict(memory_budget=1.5e9), TypeError, r"`memory_budget` must be an int"),
    (dict(memory_budget=["12GiB"]), TypeError, r"`memory_budget` must be an int"),
    (dict(memory_reserve="lots"), ValueError, r"`memory_reserve`"),
    (dict(memory_reserve=-5), ValueError, r"`memory_reserve` must not be negative"),
    (dict(memory_reserve=False), ValueError, r"not a bool"),
    # A text without its unit: refused as for memory_budget, not read as 3 bytes (issue 34, point 5).
    (dict(memory_reserve="3"), ValueError, r"`memory_reserve`: `3`: did you mean `'3GiB'`"),
    (dict(keep_on_device_between_generations="yes"), TypeError, r"`keep_on_device_between_generations`"),
    (dict(zero_copy_eviction=1), TypeError, r"`zero_copy_eviction`"),
    # Excluded components (transformer 320 + the class's safety_checker 32) alone exceed the budget.
    (dict(exclude_from_offload=["transformer"], memory_budget=300), ValueError, r"'safety_checker', 'transformer'"),
]


@pytest.mark.parametrize("kwargs, error, match", BAD)
def test_bad_options_raise_quickly_and_change_nothing(installed, kwargs, error, match):
    import time

    pipe = build()
    pipe.enable_model_cpu_offload(device="cpu", memory_budget=10_000, keep_on_device_between_generations=True)
    pipe(["text_encoder", "transformer"])
    before = (status(pipe), len(doe.transfer_ledger(pipe)), list(pipe._all_hooks))
    start = time.perf_counter()
    with pytest.raises(error, match=match):
        pipe.enable_model_cpu_offload(**kwargs)
    assert time.perf_counter() - start < 1.0
    assert (status(pipe), len(doe.transfer_ledger(pipe)), list(pipe._all_hooks)) == before
    assert pipe(["vae"]) == ["vae"]


def test_reserve_larger_than_the_device(installed, monkeypatch):
    monkeypatch.setattr(memory, "total_bytes", lambda device: 8 << 30)
    monkeypatch.setattr(memory, "free_bytes", lambda device: 6 << 30)
    pipe = build()
    with pytest.raises(ValueError, match=r"`memory_reserve` is 9.00 GiB .* more than the whole device"):
        pipe.enable_model_cpu_offload(device="cpu", keep_on_device_between_generations=True, memory_reserve="9GiB")
    assert not status(pipe).enabled


def test_a_budget_larger_than_the_device_is_refused_at_enable(installed, monkeypatch):
    """Not at the first call (issue 34, point 5): where the device's memory can be read, a `memory_budget` above it
    is refused before anything changes, with a budget that fits suggested."""
    monkeypatch.setattr(memory, "total_bytes", lambda device: 24 << 30)
    monkeypatch.setattr(memory, "free_bytes", lambda device: 23 << 30)
    pipe = build()
    with pytest.raises(ValueError, match=r"`memory_budget` is 40.00 GiB .* more than the whole device .*'21GiB'"):
        pipe.enable_model_cpu_offload(device="cpu", memory_budget="40GiB")
    assert not status(pipe).enabled and not any(hasattr(m, "_hf_hook") for m in pipe.components.values())
    pipe.enable_model_cpu_offload(device="cpu", memory_budget="20GiB")  # within the device: accepted
    assert status(pipe).budget == 20 << 30


def test_options_are_sticky_and_reset(installed):
    pipe = build()
    pipe.enable_model_cpu_offload(device="cpu", memory_budget="1KiB", keep_on_device_between_generations=True)
    pipe(["text_encoder"])  # the end of the call re-enables with no arguments
    pipe.enable_model_cpu_offload()  # so does LoRA loading
    options = status(pipe).options
    assert (options["memory_budget"], options["keep_between"], options["zero_copy"]) == (
        1024,
        True,
        None,
    )  # None: not set (drops with the manager on)
    assert status(pipe).policy == "residency" and status(pipe).budget == 1024
    pipe.enable_model_cpu_offload(memory_budget="2KB", zero_copy_eviction=False)
    options = status(pipe).options
    assert (options["memory_budget"], options["keep_between"], options["zero_copy"]) == (2000, True, False)
    pipe.enable_model_cpu_offload(memory_budget="auto", keep_on_device_between_generations=False)
    assert status(pipe).policy == "chain" and status(pipe).budget is None
    # Back to stock: every move a copy again, everything back on the host at the end of a call.
    ledger = doe.transfer_ledger(pipe)
    start = len(ledger)
    pipe(["text_encoder", "transformer"])
    assert all(r.kind == "copy" for r in ledger.records[start:])
    assert resident(pipe) == {"safety_checker"}


def test_default_options_never_start_the_manager(installed, accelerator):
    """The manager stays off; on an accelerator the chain's evictions drop unchanged weights (issue 31), on the plain
    CPU they copy and no host copy is kept."""
    pipe = build()
    pipe.enable_model_cpu_offload(device="cpu")
    pipe(["text_encoder", "transformer", "vae", "transformer", "vae"])
    assert status(pipe).policy == "chain" and status(pipe).budget is None
    records = doe.transfer_ledger(pipe).records
    if accelerator is None:
        assert not any(c.host_copy for c in status(pipe).components.values())
        assert all(r.kind == "copy" for r in records)
    else:
        assert {r.kind for r in records if r.direction == "offload"} == {"drop"}


@pytest.mark.parametrize("manager", [{"memory_budget": 500}, {"keep_on_device_between_generations": True}])
def test_keep_during_generation_means_nothing_under_the_manager_and_says_so(installed, caplog, manager):
    """Under the residency manager (which evicts only to make room) `keep_on_device_during_generation` has no effect:
    the same moves as without it, one warning when it comes to be so, no component reported `"kept"`; it stays in
    force, and means again what it means, once the manager is off."""
    trace = ["text_encoder", "text_encoder_2", "transformer", "vae", "transformer", "vae"]
    kept, plain = build(), build()
    with diffusers_logs(caplog, logging.WARNING):
        kept.enable_model_cpu_offload(device="cpu", keep_on_device_during_generation=True, **manager)
        kept.enable_model_cpu_offload(**manager)  # the same again: no second warning
    plain.enable_model_cpu_offload(device="cpu", **manager)
    warnings = [r.getMessage() for r in caplog.records if "has no effect" in r.getMessage()]
    assert len(warnings) == 1 and "`keep_on_device_during_generation`" in warnings[0]
    for pipe in (kept, plain):
        for _ in range(2):
            pipe(trace)
    moves = [[(r.component, r.direction, r.nbytes, r.kind) for r in doe.transfer_ledger(p)] for p in (kept, plain)]
    assert moves[0] == moves[1]
    assert "kept" not in {c.role for c in status(kept).components.values()}
    assert status(kept).options["keep_all"] is True  # in force, for when the manager is off
    kept.enable_model_cpu_offload(memory_budget="auto", keep_on_device_between_generations=False)
    assert status(kept).policy == "chain"
    assert {n for n, c in status(kept).components.items() if c.role == "kept"} == set(kept.components) - {
        "safety_checker"
    }


# -- budgets ----------------------------------------------------------------------------------------------------------
def test_automatic_budget_on_cuda(installed, monkeypatch):
    """`None` on CUDA: free memory at enable + what the pipeline holds there - reserve (memory functions mocked)."""
    monkeypatch.setattr(memory, "total_bytes", lambda device: 1 << 20)
    monkeypatch.setattr(memory, "free_bytes", lambda device: 1000)
    monkeypatch.setattr(budget_module, "AUTO_BUDGET_STEP", 1)
    pipe = build()
    pipe.enable_model_cpu_offload(device="cpu", keep_on_device_between_generations=True, memory_reserve=100)
    assert status(pipe).budget == 1000 - 100  # nothing on the device yet
    pipe(["text_encoder", "transformer"])
    held = resident_bytes(pipe)
    assert held == FIXED + SIZES["text_encoder"] + SIZES["transformer"]
    assert status(pipe).budget == 1000 + held - 100  # read again at the end of the call
    # On devices without memory information (CPU, MPS, ...) the automatic budget is unlimited.
    monkeypatch.setattr(memory, "free_bytes", lambda device: None)
    pipe.enable_model_cpu_offload()
    assert status(pipe).budget is None


def test_automatic_budget_is_rounded_down(installed, monkeypatch):
    monkeypatch.setattr(memory, "total_bytes", lambda device: 80 << 30)
    monkeypatch.setattr(memory, "free_bytes", lambda device: (20 << 30) + 12345)
    pipe = build()
    pipe.enable_model_cpu_offload(device="cpu", keep_on_device_between_generations=True)
    assert status(pipe).budget == (17 << 30)  # 20 GiB free - the default 3 GiB reserve


def test_free_memory_is_read_again_before_each_onload(installed, monkeypatch):
    """On CUDA, memory taken by others since enable is respected: the next onload evicts to fit in it."""
    free = {"bytes": 1 << 20}
    reads = []

    def free_bytes(device):
        reads.append(device)
        return free["bytes"]

    monkeypatch.setattr(memory, "total_bytes", lambda device: 80 << 30)
    monkeypatch.setattr(memory, "free_bytes", free_bytes)
    pipe = build()
    pipe.enable_model_cpu_offload(device="cpu", memory_budget=10_000, keep_on_device_between_generations=True)
    pipe(["text_encoder", "text_encoder_2", "transformer"])
    assert resident(pipe) == {"safety_checker", "text_encoder", "text_encoder_2", "transformer"}
    free["bytes"] = 0  # someone else took all the free memory: only what we hold can be reused
    held = resident_bytes(pipe)
    reads_after = []
    reads.clear()
    pipe(["transformer", "vae"], probe=lambda index, name: reads_after.append(len(reads)))
    assert reads_after == [0, 1]  # the transformer was resident: no onload, no read; the vae's onload read it
    assert "vae" in resident(pipe)
    assert resident_bytes(pipe) <= held


def test_larger_than_budget_runs_alone_with_one_warning(installed, caplog):
    pipe = build()
    budget = FIXED + 200  # the transformer (320) does not fit even alone
    pipe.enable_model_cpu_offload(device="cpu", memory_budget=budget, keep_on_device_between_generations=True)
    seen = []

    def probe(index, name):
        seen.append((name, resident(pipe)))

    with diffusers_logs(caplog, logging.WARNING):
        for _ in range(3):
            pipe(["text_encoder", "transformer", "text_encoder", "vae", "transformer"], probe=probe)
    warnings = [r for r in caplog.records if "does not fit in the memory budget" in r.getMessage()]
    assert len(warnings) == 1 and "`transformer`" in warnings[0].getMessage()
    for name, on_device in seen:
        assert name in on_device
        if name == "transformer":
            assert on_device == {"transformer", "safety_checker"}  # alone (with the always-resident one)
        else:
            assert sum(SIZES.get(n, FIXED) for n in on_device) <= budget


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
    assert resident(pipe) == {"safety_checker"}  # excluded components stay
    assert all(r.kind == "drop" for r in ledger.records[-4:])  # nothing was copied back
    pipe(trace)
    assert ledger.copied_bytes(call_index=2) == first  # they come back on their own
    assert doe.release(pipe) > 0 and doe.release(pipe) == 0


def test_release_in_the_middle_of_a_call_and_explicit_moves(installed):
    pipe = build()
    pipe.enable_model_cpu_offload(device="cpu", memory_budget="1MiB", keep_on_device_between_generations=True)
    released = []
    pipe(["text_encoder", "transformer", "vae"], probe=lambda i, name: i == 1 and released.append(doe.release(pipe)))
    assert released == [SIZES["text_encoder"] + SIZES["transformer"]]
    assert resident(pipe) == {"safety_checker", "vae"}  # the vae ran after the release and came back
    # The always-resident safety_checker keeps no host copy; the vae does.
    assert {n for n, c in status(pipe).components.items() if c.host_copy} == {"vae"}
    pipe.to("cpu")  # an explicit move: the host copies of what left the device are stale now
    assert resident(pipe) == set()
    assert not any(c.host_copy for c in status(pipe).components.values())


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
        if resident_bytes(pipe) > budget or name not in resident(pipe):
            over.append((index, name, resident(pipe)))

    pipe.enable_model_cpu_offload(device="cpu", memory_budget=budget, keep_on_device_between_generations=True)
    pipe(trace, probe=probe)
    history = status(pipe).recent_calls
    with pytest.raises(KeyboardInterrupt if interrupt else RuntimeError):
        pipe(trace, fail_at=4, interrupt=interrupt, probe=probe)
    assert resident_bytes(pipe) <= budget
    assert status(pipe).recent_calls == history  # the failed call does not become the prediction
    assert not status(pipe).in_call and status(pipe).enabled
    assert pipe(trace, probe=probe) == trace
    assert not over
    for name, component in status(pipe).components.items():
        assert component.where == ("device" if component.resident else "host"), name


# -- replay --------------------------------------------------------------------------------------------------------------
def replay_ledger(pipe, budget):
    """Replay the pipeline's recorded traces through a fresh policy: the moves it predicts, with kinds."""
    layout = doe.PipelineLayout.from_pipeline(pipe)
    arranged = layout.arrange()
    sizes = {n: c.nbytes for n, c in status(pipe).components.items()}
    trace = [event for call in status(pipe).recent_calls for event in list(call) + [doe.END]]
    fresh = doe.ResidencyPolicy(
        order=layout.order,
        chain=arranged.chain,
        hooked=arranged.hooked,
        sizes=sizes,
        round_trip=arranged.round_trip,
        budget=budget,
        keep_between=True,
    )
    modules = pipe.components

    rooms = {name: room for name in sizes if (room := stream_room(modules[name])) is not None}
    # The blocks the runtime tells the policy of (block by block when the budget binds), and what each use runs: a
    # VAE that only decodes runs no encoder block.
    blocks = {name: block_items(modules[name]) for name in rooms}
    runs = {"vae": [b for b in block_sizes(modules["vae"]) if not b.startswith("encoder.")]}
    replayed = doe.replay_trace(fresh, trace, sizes, zero_copy=True, stream_rooms=rooms, blocks=blocks, runs=runs)
    return [tuple(m) for m in replayed.moves]


def onloads(moves):
    """Bytes copied to the device per (call, component): whole components, kept blocks and streamed blocks."""
    found = collections.Counter()
    for direction, component, nbytes, kind, call in moves:
        if direction == "onload":
            found[(call, component)] += nbytes
    return found


@pytest.mark.parametrize("name", ["flux", "wan22", "sd_controlnet"])
def test_replay_agrees_with_the_ledger_of_a_tiny_pipeline(installed, name):
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
    records = doe.transfer_ledger(pipe).records
    real = [(r.direction, r.component, r.nbytes, r.kind, r.call_index) for r in records]
    assert any(kind == "drop" for _, _, _, kind, _ in real)
    replayed = replay_ledger(pipe, budget)
    streamed = {r.component for r in records if r.block is not None}
    assert streamed  # the budget binds: the policy decides block by block
    whole = [m for m, r in zip(real, records) if r.component not in streamed]
    assert whole == [m for m in replayed if m[1] not in streamed]  # the same moves, in order, of the others
    # The bytes copied, per call and component, are the replay's: exactly once the blocks' order is known (in the
    # first call a streamed block may be prefetched along module order and not run), except for Wan's VAE, which
    # runs its mid block once per latent frame (the replay books each block once per use).
    real, replayed = onloads(real), onloads(replayed)
    for key in set(real) | set(replayed):
        call, component = key
        if call == 0 or (name == "wan22" and component == "vae"):
            assert real[key] >= replayed[key], key
        else:
            assert real[key] == replayed[key], key


def test_tiny_pipeline_images_are_unchanged(installed):
    name = "flux"
    reference = tiny.run(tiny.build(name), name, seed=1, preview=True)
    pipe = tiny.build(name)
    pipe.set_progress_bar_config(disable=True)
    sizes = {n: doe.module_nbytes(m) for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    pipe.enable_model_cpu_offload(
        device="cpu", memory_budget=int(sum(sizes.values()) * 0.6), keep_on_device_between_generations=True
    )
    for _ in range(2):
        assert torch.equal(tiny.run(pipe, name, seed=1, preview=True), reference)
    doe.release(pipe)
    assert torch.equal(tiny.run(pipe, name, seed=1, preview=True), reference)
