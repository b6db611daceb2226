"""Never out of memory (issue 25), on the simulated accelerator with a capacity: device memory counted (weights and
activations), `torch.OutOfMemoryError` past it. A component that runs out of memory in its forward (or while it is
loaded) gets room (the other components evicted, then itself streamed in less room) and runs again; the call's image
is the one of no offload; the next call of the same shape does not run out again; a call that cannot fit at any
residency gets `doe.OffloadOutOfMemoryError`, with nothing left half loaded. The tiny FLUX pipeline has a deeper
transformer (3 double, 4 single blocks, as in `test_block_streaming.py`): 1.08 MB of weights; at 64x64 its transformer
needs about 0.6 MB of activations and its VAE decode 0.82 MB, at 32x32 about 0.2 MB each.

`zero_copy_eviction=False` where the capacity is about 1 MB: a fingerprint's scratch buffer (2 MiB, nothing on a real
card) would not fit such a device."""

import pytest
import torch
from harness import diffusers_logs, max_abs_diff
from simulated_accelerator import SimulatedAccelerator

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: out-of-memory recovery")

import diffusers_offload_ext as doe  # noqa: E402
from diffusers_offload_ext import marks  # noqa: E402
from diffusers_offload_ext.blocks.find import REST, block_sizes  # noqa: E402
from diffusers_offload_ext.residency import reserve as reserve_module  # noqa: E402
from diffusers_offload_ext.residency import budget as budget_module  # noqa: E402
from diffusers_offload_ext.testing import tiny  # noqa: E402
from diffusers_offload_ext.testing.device_memory import out_of_memory, simulated_memory  # noqa: E402

pytestmark = [pytest.mark.plugin_only, pytest.mark.usefixtures("installed")]
NAME = "flux"
#: The weights (1.08 MB) fit; the transformer whole beside its activations at 64x64 (1.37 MB) does not, streamed in
#: its least room (0.52 MB) it does; the VAE alone beside its decode's activations (1.0 MB) does.
CAPACITY = 1_200_000
ALL_WEIGHTS = 1_100_000
NO_COPY = dict(zero_copy_eviction=False)


def deep_flux():
    from test_block_streaming import deep_flux as build

    return build()


@pytest.fixture(scope="module")
def reference():
    pipe = deep_flux()
    return {size: call(pipe, size) for size in (32, 64)}


def call(pipe, size=64, **extra):
    kwargs = tiny.call_kwargs(NAME, pipe=pipe)
    kwargs.update(height=size, width=size, **extra)
    with torch.no_grad():
        return pipe(**kwargs).images.to("cpu")


def forced(pipe):
    return [r for r in doe.transfer_ledger(pipe).records if r.cause == "out-of-memory"]


def components(pipe):
    return {n: m for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}


class WeightsWatch:
    """After every module's forward: the bytes of the pipeline's weights on the simulated device never exceed
    `budget`: each storage of a tensor found there once, but a streaming component's streamed blocks counted as its
    ring (`BlockStatus.ring_bytes`: their tensors point into it only while they run, and it holds the prefetched
    ones)."""

    def __init__(self, pipe, sim, budget):
        self.pipe, self.sim, self.budget, self.most, self.checks = pipe, sim, budget, 0, 0
        self.handles = [m.register_forward_hook(self.check) for c in components(pipe).values() for m in c.modules()]
        self.last_move, self.streaming = (), (0, set())

    def rings(self):
        """`(ring bytes, ids of the streamed blocks' tensors)`, read again after each move in the ledger."""
        records = doe.transfer_ledger(self.pipe).records
        last_move = (len(records), records[-1] if records else None)
        if last_move != self.last_move:
            rings, streamed = 0, set()
            for name, component in doe.offload_status(self.pipe).components.items():
                if component.blocks is not None:
                    rings += component.blocks.ring_bytes
                    blocks = [getattr(self.pipe, name).get_submodule(b) for b in component.blocks.streamed]
                    streamed |= {id(t) for b in blocks for t in list(b.parameters()) + list(b.buffers())}
            self.last_move, self.streaming = last_move, (rings, streamed)
        return self.streaming

    def check(self, *_):
        seen = {}
        rings, streamed = self.rings()
        for module in components(self.pipe).values():
            for t in list(module.parameters()) + list(module.buffers()):
                if self.sim.is_on_device(t) and id(t) not in streamed:
                    storage = t.untyped_storage()
                    seen[storage.data_ptr()] = storage.nbytes()
        self.most, self.checks = max(self.most, sum(seen.values()) + rings), self.checks + 1
        assert self.most <= self.budget, (self.most, self.budget)

    def remove(self):
        for handle in self.handles:
            handle.remove()


def clean(pipe, sim):
    """Nothing half loaded: each component on the device or on the host, or streaming between calls
    (`keep_on_device_between_generations`: its kept blocks on the device, its streamed ones on the host); the status
    agrees with the tensors."""
    status = doe.offload_status(pipe)
    for name, module in components(pipe).items():
        blocks = status.components[name].blocks if name in status.components else None
        if blocks is not None:
            found = {block.name: block for block in doe.find_blocks(module)}
            assert all(_on_device(sim, found[b]) == {True} for b in blocks.resident), name
            assert all(_on_device(sim, found[b]) == {False} for b in blocks.streamed), name
            continue
        assert sim.where(module) in ("device", "host", "empty"), name
        if name in status.components:
            assert status.components[name].blocks is None
            assert status.components[name].resident == (sim.where(module) == "device"), name


def _on_device(sim, block):
    """Whether each of `block`'s tensors is on the device, as a set."""
    tables = [(sub._parameters if is_param else sub._buffers, key) for sub, is_param, key in block.slots]
    return {sim.is_on_device(table[key]) for table, key in tables if table.get(key) is not None}


def test_the_simulated_accelerator_counts_device_memory_and_raises_past_its_capacity():
    layer = torch.nn.Linear(100, 100)  # 40,400 bytes
    with SimulatedAccelerator() as unlimited:
        layer.to(unlimited.device)
        assert unlimited.allocated_bytes == 0 and unlimited.capacity is None  # the default counts nothing
        layer.to("cpu")
    with SimulatedAccelerator(capacity=100_000) as sim:
        layer.to(sim.device)
        assert sim.allocated_bytes == 40_400
        x = torch.ones(10, 100, device=sim.device)
        views = [x.view(100, 10), x[:5]]  # views of one storage count once
        y = layer(x)
        assert sim.allocated_bytes == 40_400 + 4_000 + 4_000 and sim.peak_bytes == sim.allocated_bytes
        del x, y, views
        assert sim.allocated_bytes == 40_400  # freed bytes return
        with pytest.raises(torch.OutOfMemoryError, match="out of memory"):
            torch.empty(20_000, device=sim.device)
        big = torch.nn.Linear(200, 200)
        with pytest.raises(torch.OutOfMemoryError):
            big.to(sim.device)  # partly moved, as on CUDA
        assert sim.out_of_memory_errors == 2
        layer.to("cpu")
        big.to("cpu")
        assert sim.allocated_bytes == 0 and sim.peak_bytes == 48_400
        sim.reset_peak()
        assert sim.peak_bytes == 0


def test_weights_that_fit_beside_activations_that_do_not_complete_as_no_offload_where_stock_raises(reference, caplog):
    stock = deep_flux()
    with SimulatedAccelerator(capacity=CAPACITY) as sim:
        marks.STOCK["enable_model_cpu_offload"](stock, device=sim.device)
        with pytest.raises(torch.OutOfMemoryError):
            call(stock)
    pipe = deep_flux()
    with SimulatedAccelerator(capacity=CAPACITY) as sim, diffusers_logs(caplog, "WARNING"):
        pipe.enable_model_cpu_offload(
            device="cpu", memory_budget=ALL_WEIGHTS, keep_on_device_between_generations=True, **NO_COPY
        )
        first = call(pipe)
        errors = sim.out_of_memory_errors
        status = doe.offload_status(pipe)
        second = call(pipe)  # the same shape: it starts within what fitted
        assert sim.out_of_memory_errors == errors > 0
        small = call(pipe, 32)
    assert max_abs_diff(first, reference[64]) == 0.0 and max_abs_diff(second, reference[64]) == 0.0
    assert max_abs_diff(small, reference[32]) == 0.0
    moves = [r for r in forced(pipe) if r.call_index < 2]  # (the call at 32x32, a new shape, may recover too)
    assert moves and {r.call_index for r in moves} == {0}
    assert any(r.direction == "offload" and r.component in ("text_encoder", "text_encoder_2") for r in moves)
    (learnt,) = [s for s in status.learnt if s.shape == "height=64, width=64"]
    # One warning per recovery, naming what was evicted and the component run again.
    lines = [r.getMessage() for r in caplog.records if "device memory on cpu:0 (height=64" in r.getMessage()]
    assert len(lines) == learnt.recoveries >= 1
    assert "`transformer` ran again" in lines[0] and "evicted `text_encoder`" in lines[0]
    # What fitted beside the transformer: its least room, streamed (no device peak on this device: nothing measured).
    assert learnt.activations == {} and learnt.reserve is None
    assert 0 < learnt.fitted["transformer"] < sum(block_sizes(pipe.transformer).values())


def test_within_a_call_each_component_runs_out_of_memory_once(reference):
    """A preview decoded at every step: the VAE and the transformer alternate. Once each has run out of memory, the
    weights that fitted beside it are its limit for the rest of the call: the other leaves first, no error again."""
    pipe = deep_flux()
    with SimulatedAccelerator(capacity=CAPACITY):
        pipe.enable_model_cpu_offload(
            device="cpu", memory_budget=ALL_WEIGHTS, keep_on_device_between_generations=True, **NO_COPY
        )
        kwargs = tiny.call_kwargs(NAME, pipe=pipe, preview=True)
        kwargs.update(height=64, width=64, num_inference_steps=3)
        with torch.no_grad():
            pipe(**kwargs)
    assert len(pipe._tiny_previews) == 3
    (learnt,) = doe.offload_status(pipe).learnt
    assert learnt.recoveries == 2 and set(learnt.fitted) == {"transformer", "vae"}


def measure_per_component(size):
    """What the runtime is to learn, measured apart: every weight on the simulated device and no offload, the device's
    peak beyond them from each component's start to the next one's (or the call's end), by component."""
    pipe = deep_flux()
    peaks, running = {}, []
    with SimulatedAccelerator(capacity=1 << 40) as sim:
        pipe.to(sim.device)
        weights = sim.allocated_bytes

        def segment(name):
            if running:
                peaks[running[-1]] = max(peaks.get(running[-1], 0), sim.peak_bytes - weights)
            running.append(name)
            sim.reset_peak()

        handles = [getattr(pipe, n).register_forward_pre_hook(lambda *_, n=n: segment(n)) for n in components(pipe)]
        decode = pipe.vae.decode
        pipe.vae.decode = lambda *a, **k: (segment("vae"), decode(*a, **k))[1]
        try:
            call(pipe, size)
            segment(None)
        finally:
            del pipe.vae.decode
            for handle in handles:
                handle.remove()
    return {name: nbytes for name, nbytes in peaks.items() if name is not None}


def test_the_next_call_of_a_shape_starts_with_its_learnt_reserve_and_runs_without_an_error(reference, monkeypatch):
    monkeypatch.setattr(budget_module, "AUTO_BUDGET_STEP", 1)
    monkeypatch.setattr(reserve_module, "MARGIN_FLOOR", 16 << 10)
    expected = measure_per_component(64)
    pipe = deep_flux()
    with SimulatedAccelerator(capacity=CAPACITY) as sim, simulated_memory(sim) as memory:
        pipe.enable_model_cpu_offload(
            device="cpu", memory_reserve=200_000, keep_on_device_between_generations=True, **NO_COPY
        )
        unseen = doe.offload_status(pipe).budget  # the capacity less `memory_reserve`
        first = call(pipe)
        errors = sim.out_of_memory_errors
        assert errors > 0 and memory.released > 0  # recovered, the freed memory given back through the transfer
        resets = memory.resets
        images = [call(pipe), call(pipe)]
        assert sim.out_of_memory_errors == errors  # the later calls fitted: they started with what the shape taught
        assert memory.resets == resets  # nothing left to learn: the allocator's peak is left alone
        images.append(call(pipe, 32))  # another shape (it may need a recovery of its own)
        errors = sim.out_of_memory_errors
        images.append(call(pipe))
        assert sim.out_of_memory_errors == errors
        status = doe.offload_status(pipe)
    assert all(max_abs_diff(i, reference[s]) == 0.0 for i, s in zip([first] + images, (64, 64, 64, 32, 64)))
    (learnt,) = [s for s in status.learnt if s.shape == "height=64, width=64"]
    assert set(learnt.activations) == set(expected)
    for name, nbytes in expected.items():  # the device's peak less the weights, per component, as measured apart
        assert abs(learnt.activations[name] - nbytes) <= 0.01 * nbytes, (name, learnt.activations, expected)
    assert learnt.activations["vae"] > learnt.activations["transformer"] > learnt.activations["text_encoder"]
    assert learnt.reserve == min(reserve_module.reserve_for(a) for a in learnt.activations.values())
    assert status.reserve == learnt.reserve < 200_000  # the reserve in force is the last shape's, learnt
    assert status.budget > unseen + 25_000  # and the automatic budget left that, not `memory_reserve`


@pytest.mark.parametrize("capacity, size", [(900_000, 64), (500_000, 32)])
def test_a_call_that_cannot_fit_at_any_residency_gets_a_clear_error_and_leaves_nothing_half_loaded(
    reference, capacity, size
):
    """The transformer streamed in its least room, through a ring of two buffers (the last rung), beside its
    activations: more than the device (on the smaller one, loading it whole runs out of memory halfway, every
    time). With a ring of two buffers the devices of 1,000,000 B at 64x64 and 600,000 B at 32x32 this test used
    before now fit."""
    pipe = deep_flux()
    with SimulatedAccelerator(capacity=capacity) as sim:
        pipe.enable_model_cpu_offload(
            device="cpu", memory_budget=ALL_WEIGHTS, keep_on_device_between_generations=True, **NO_COPY
        )
        with pytest.raises(doe.OffloadOutOfMemoryError) as caught:
            call(pipe, size)
        clean(pipe, sim)
        sim.capacity = CAPACITY
        after = call(pipe, 32)
        clean(pipe, sim)
    message = str(caught.value)
    assert isinstance(caught.value, torch.OutOfMemoryError)  # code that catches the error still does
    assert "`transformer` ran out of device memory" in message and f"height={size}, width={size}" in message
    assert "streamed `transformer`" in message and "Make the call smaller" in message
    assert "memory_budget` does not help" in message
    assert max_abs_diff(after, reference[32]) == 0.0


def test_an_out_of_memory_error_while_a_component_is_loaded_puts_back_what_it_moved(reference):
    pipe = deep_flux()
    with SimulatedAccelerator(capacity=850_000) as sim:  # the transformer does not load beside the text encoders
        pipe.enable_model_cpu_offload(
            device="cpu", memory_budget=ALL_WEIGHTS, keep_on_device_between_generations=True, **NO_COPY
        )
        image = call(pipe, 32)
        clean(pipe, sim)
        errors = sim.out_of_memory_errors
        again = call(pipe, 32)
        assert sim.out_of_memory_errors == errors
    assert max_abs_diff(image, reference[32]) == 0.0 and max_abs_diff(again, reference[32]) == 0.0
    assert any(r.component == "text_encoder" and r.direction == "offload" for r in forced(pipe))


def test_an_out_of_memory_error_as_a_call_begins_ends_that_call(reference):
    """The call's first moves (an excluded component put back on the device) run out of memory, outside any
    component's forward: the error propagates, and that call is over, so the next one is a call of its own."""
    pipe = deep_flux()
    with SimulatedAccelerator(capacity=CAPACITY) as sim:
        pipe.enable_model_cpu_offload(device="cpu", memory_budget=ALL_WEIGHTS, exclude_from_offload=["vae"], **NO_COPY)
        pipe.vae.to("cpu")  # moved off the device by hand: a call puts it back first
        sim.capacity = 10_000
        with pytest.raises(torch.OutOfMemoryError):
            call(pipe, 32)
        clean(pipe, sim)
        sim.capacity = CAPACITY
        image = call(pipe, 32)
        clean(pipe, sim)
    assert max_abs_diff(image, reference[32]) == 0.0
    records = doe.transfer_ledger(pipe).records
    assert {r.call_index for r in records if r.component == "transformer"} == {1}  # not nested in the failed call
    assert sim.where(pipe.transformer) == "host"  # and it had its end-of-call offload


def inside(pipe, target, blocks):
    """A module that runs inside `target`'s forward (below every hook)."""
    if target == "vae":
        return pipe.vae.decoder
    if target in ("streamed block", "kept block"):
        names = blocks.streamed if target == "streamed block" else [b for b in blocks.resident if b != REST]
        block = pipe.transformer.get_submodule(names[0])
        return next(m for m in block.children() if any(True for _ in m.parameters()))
    return [m for m in getattr(pipe, target).children() if any(True for _ in m.parameters())][-1]  # it runs last


@pytest.mark.parametrize(
    "target", ["text_encoder", "text_encoder_2", "transformer", "vae", "streamed block", "kept block"]
)
def test_an_error_injected_below_every_hook_is_recovered_with_the_image_of_no_offload(reference, target):
    pipe = deep_flux()
    budget = int(sum(block_sizes(pipe.transformer).values()) * 0.8)  # the transformer streams its blocks
    seen = []

    def callback(p, step, timestep, kwargs):
        seen.append(doe.offload_status(p).components["transformer"].blocks)
        return kwargs

    with SimulatedAccelerator(capacity=8 << 20) as sim:
        pipe.enable_model_cpu_offload(device="cpu", memory_budget=budget)
        call(pipe, 32, callback_on_step_end=callback)  # the blocks' plan, the same at the next call
        blocks = seen[0]
        assert blocks.streamed and [b for b in blocks.resident if b != REST]
        watch = WeightsWatch(pipe, sim, budget)
        with out_of_memory(inside(pipe, target, blocks)) as injected:
            image = call(pipe, 32)
        watch.remove()
        clean(pipe, sim)
    assert injected.raised and watch.checks > 0
    assert max_abs_diff(image, reference[32]) == 0.0
    learnt = doe.offload_status(pipe).learnt
    assert sum(s.recoveries for s in learnt) == 1
    if target.endswith("block"):  # nothing else on the device: the transformer streamed again, in less room
        assert any(r.component == "transformer" and r.block is not None for r in forced(pipe))


def test_when_the_retry_fails_too_the_error_propagates_and_the_next_call_is_clean(reference):
    pipe = deep_flux()
    budget = int(sum(block_sizes(pipe.transformer).values()) * 0.8)
    with SimulatedAccelerator(capacity=8 << 20) as sim:
        pipe.enable_model_cpu_offload(device="cpu", memory_budget=budget, keep_on_device_between_generations=True)
        with out_of_memory(pipe.transformer.x_embedder, times=None) as injected:
            with pytest.raises(doe.OffloadOutOfMemoryError, match="at its smallest residency it ran out again"):
                call(pipe, 32)
        assert len(injected.raised) >= 3  # it was run again, in less and less room, then once more as it was
        clean(pipe, sim)
        watch = WeightsWatch(pipe, sim, budget)
        image = call(pipe, 32)
        watch.remove()
        clean(pipe, sim)
    assert max_abs_diff(image, reference[32]) == 0.0


def test_on_the_plain_cpu_an_injected_error_is_recovered_and_a_persistent_one_leaves_the_next_call_clean(reference):
    """Where host and device are the same memory (the record is the truth): the same rungs, the same image."""
    pipe = deep_flux()
    budget = int(sum(block_sizes(pipe.transformer).values()) * 0.8)
    pipe.enable_model_cpu_offload(device="cpu", memory_budget=budget, keep_on_device_between_generations=True)
    with out_of_memory(pipe.transformer.x_embedder, times=2):
        recovered = call(pipe, 32)
    with out_of_memory(pipe.vae.decoder, times=None):
        with pytest.raises(doe.OffloadOutOfMemoryError):
            call(pipe, 32)
    after = call(pipe, 32)
    assert max_abs_diff(recovered, reference[32]) == 0.0 and max_abs_diff(after, reference[32]) == 0.0
    assert forced(pipe) and doe.offload_status(pipe).learnt[0].recoveries == 1


@pytest.mark.parametrize("where", ["ring", "second kept block"])
def test_a_stream_that_runs_out_of_memory_as_it_starts_leaves_its_blocks_on_the_host(reference, monkeypatch, where):
    """The ring's allocation, or a kept block's copy, runs out of memory as the transformer starts streaming: what the
    start did is undone (kept blocks back on the host, no hook left), and the recovery streams it in less room."""
    from diffusers_offload_ext.blocks import kept_blocks, streamer as streaming

    failures = []

    def once(real, after=0):
        calls = []

        def fail_once(*args, **kwargs):
            calls.append(1)
            if len(calls) == after + 1 and not failures:
                failures.append(where)
                raise torch.OutOfMemoryError(f"injected: out of memory at the {where}")
            return real(*args, **kwargs)

        return fail_once

    if where == "ring":
        monkeypatch.setattr(streaming, "Ring", once(streaming.Ring))
    else:
        monkeypatch.setattr(kept_blocks, "carry", once(kept_blocks.carry, after=1))
    pipe = deep_flux()
    budget = int(sum(block_sizes(pipe.transformer).values()) * 0.8)
    with SimulatedAccelerator(capacity=8 << 20) as sim:
        pipe.enable_model_cpu_offload(device="cpu", memory_budget=budget)
        watch = WeightsWatch(pipe, sim, budget)
        image = call(pipe, 32)
        watch.remove()
        clean(pipe, sim)
    assert failures == [where] and max_abs_diff(image, reference[32]) == 0.0
    records = doe.transfer_ledger(pipe).records
    for name in components(pipe):  # every byte loaded went back (whole, or block by block)
        onloads = sum(r.nbytes for r in records if r.component == name and r.direction == "onload")
        assert onloads == sum(r.nbytes for r in records if r.component == name and r.direction == "offload"), name


def test_a_rung_whose_stream_cannot_start_says_so_and_the_retry_loads_the_component_whole(
    reference, monkeypatch, caplog
):
    """The transformer runs out of memory whole, twice: the second rung streams it, and the ring's allocation runs
    out of memory. Nothing streams then, the recovery's line says so, and the retry runs it whole on the device."""
    from diffusers_offload_ext.blocks import streamer as streaming

    real, failures = streaming.Ring, []

    def ring(*args, **kwargs):
        if not failures:
            failures.append("ring")
            raise torch.OutOfMemoryError("injected: out of memory at the ring")
        return real(*args, **kwargs)

    monkeypatch.setattr(streaming, "Ring", ring)
    pipe = deep_flux()
    with SimulatedAccelerator(capacity=8 << 20) as sim, diffusers_logs(caplog, "WARNING"):
        pipe.enable_model_cpu_offload(device="cpu", memory_budget=ALL_WEIGHTS, keep_on_device_between_generations=True)
        places = []
        pipe.transformer.x_embedder.register_forward_pre_hook(lambda *_: places.append(sim.where(pipe.transformer)))
        with out_of_memory(pipe.transformer.x_embedder, times=2):
            image = call(pipe, 32)
        clean(pipe, sim)
    assert failures == ["ring"] and max_abs_diff(image, reference[32]) == 0.0
    assert set(places) == {"device"}  # whole on the device every time it ran
    (line,) = [r.getMessage() for r in caplog.records if "ran again: it completed" in r.getMessage()]
    assert "could not stream `transformer`" in line and "streamed `transformer`" not in line, line


class Doubling(torch.nn.Module):
    """Changes its input in place before its layer runs: a forward that must not run again after failing."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        x.mul_(2)
        return self.layer(x)


def test_a_forward_that_running_again_could_change_is_not_run_again(caplog):
    import toy

    pipe = toy.build()
    for module in components(pipe).values():
        module.eval()  # as `from_pretrained` leaves them
    with SimulatedAccelerator():
        pipe.enable_model_cpu_offload(device="cpu", memory_budget=10_000)
        x = torch.ones(toy.WIDTHS["transformer"], device="cpu:0")
        with out_of_memory(pipe.transformer.linear):
            pipe.transformer(x)  # plain inputs, inference mode: run again, it completes
        cases = {
            "training mode": lambda: pipe.transformer.train(),
            "argument `0` holds a `Generator`": lambda: None,
        }
        for why, setup in cases.items():
            setup()
            argument = torch.Generator() if "Generator" in why else x
            with diffusers_logs(caplog, "WARNING"), out_of_memory(pipe.transformer.linear):
                with pytest.raises(torch.OutOfMemoryError) as caught:
                    pipe.transformer(argument)
            assert not isinstance(caught.value, doe.OffloadOutOfMemoryError)
            assert why in caplog.text
            pipe.transformer.eval()
        pipe.transformer.linear = Doubling(pipe.transformer.linear)
        with diffusers_logs(caplog, "WARNING"), out_of_memory(pipe.transformer.linear.layer):
            with pytest.raises(torch.OutOfMemoryError):
                pipe.transformer(torch.ones(toy.WIDTHS["transformer"], device="cpu:0"))
        assert "changed its input `0` in place" in caplog.text


def test_a_stateful_diffusers_hook_is_not_run_again(caplog):
    hooks = pytest.importorskip("diffusers.hooks", reason="diffusers before 0.33 has no hook registry")
    import toy

    class Cache(hooks.ModelHook):
        _is_stateful = True

    pipe = toy.build()
    pipe.transformer.eval()
    with SimulatedAccelerator():
        pipe.enable_model_cpu_offload(device="cpu", memory_budget=10_000)
        hooks.HookRegistry.check_if_exists_or_initialize(pipe.transformer.linear).register_hook(Cache(), "cache")
        with diffusers_logs(caplog, "WARNING"), out_of_memory(pipe.transformer.linear):
            with pytest.raises(torch.OutOfMemoryError) as caught:
                pipe.transformer()
    assert not isinstance(caught.value, doe.OffloadOutOfMemoryError)
    assert "stateful diffusers hook (`Cache`)" in caplog.text


def test_the_trace_shows_the_moves_a_recovery_forced(tmp_path):
    pytest.importorskip("matplotlib")
    pipe = deep_flux()
    with SimulatedAccelerator(capacity=CAPACITY):
        pipe.enable_model_cpu_offload(
            device="cpu", memory_budget=ALL_WEIGHTS, keep_on_device_between_generations=True, **NO_COPY
        )
        with doe.trace(pipe) as recorded:
            call(pipe)
    traced = [(r.component, r.direction, r.nbytes, r.block) for r in recorded.records if r.cause == "out-of-memory"]
    assert traced == [(r.component, r.direction, r.nbytes, r.block) for r in forced(pipe)] and traced
    figure = recorded.plot(str(tmp_path / "timeline.png"))
    texts = [t.get_text() for t in figure.texts] + [t.get_text() for legend in figure.legends for t in legend.texts]
    assert any("forced by out-of-memory recoveries" in t for t in texts)
    assert any("forced by out of memory" in t for t in texts)
    path = str(tmp_path / "trace.json")
    recorded.to_json(path)
    assert [r.cause for r in doe.Trace.load(path).records] == [r.cause for r in recorded.records]


def test_a_transformer_compiled_in_place_is_guarded_around_its_compiled_call(reference):
    """`module.compile()` before offload: the guard wraps the compiled call (outside Dynamo's frames), an injected
    error is recovered from with the image of no offload, and the guard leaves with the hook."""
    pipe = deep_flux()
    pipe.transformer.compile(backend="eager")
    compiled = pipe.transformer._compiled_call_impl
    budget = int(sum(block_sizes(pipe.transformer).values()) * 0.8)
    pipe.enable_model_cpu_offload(device="cpu", memory_budget=budget, keep_on_device_between_generations=True)
    try:
        with out_of_memory(pipe.transformer.x_embedder, times=2) as injected:
            recovered = call(pipe, 32)
        assert len(injected.raised) == 2 and forced(pipe)
        assert max_abs_diff(recovered, reference[32]) == 0.0
        pipe.remove_all_hooks()
        assert pipe.transformer._compiled_call_impl is compiled  # the guard left with the hook
    finally:
        torch._dynamo.reset()
