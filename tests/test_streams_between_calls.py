"""A streaming component stays between calls with `keep_on_device_between_generations=True` (issue 22, phase 2): its
kept blocks stay on the device, so from the second call on only its streamed blocks cross (the ledger), and
`doe.offload_status` and the trace show them resident between calls. Every guarantee stands: the budget at every
move, a change made to a kept block seen and never lost, `doe.release` sends everything home, a user's move or a
structure change handled, a failed call leaves nothing in the ring, images equal to no offload. The deep tiny FLUX
transformer (3 double, 4 single blocks) is the only offloaded component (the others are excluded), under a budget
of the others plus 0.8 of it, so that it streams, keeps blocks besides its rest, and nothing else needs its room."""

import pytest
import torch
from harness import max_abs_diff

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: block streaming")

import diffusers_offload_ext as doe  # noqa: E402
from diffusers_offload_ext.blocks.find import REST, block_sizes  # noqa: E402
from diffusers_offload_ext.testing import tiny  # noqa: E402
from test_block_streaming import deep_flux  # noqa: E402
from budget_watch import MovesWithin  # noqa: E402

pytestmark = [pytest.mark.plugin_only, pytest.mark.usefixtures("installed")]
NAME = "flux"
OTHERS = ["vae", "text_encoder", "text_encoder_2"]


@pytest.fixture(scope="module")
def reference():
    return tiny.run(deep_flux(), NAME)


def component_sizes(pipe):
    return {n: doe.module_nbytes(m) for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}


def armed(keep_between=True):
    """The deep FLUX pipeline, its transformer streaming alone, and the budget it streams in."""
    pipe = deep_flux()
    sizes = component_sizes(pipe)
    budget = sum(sizes[n] for n in OTHERS) + int(sizes["transformer"] * 0.8)
    pipe.enable_model_cpu_offload(
        device="cpu",
        memory_budget=budget,
        exclude_from_offload=OTHERS,
        keep_on_device_between_generations=keep_between,
    )
    return pipe, budget


def watched_call(pipe, seen, **kwargs):
    """One call, `doe.offload_status` read at each step's end into `seen`; returns its images."""

    def look(p, step, timestep, kw):
        seen.append(doe.offload_status(p))
        return kw

    return pipe(**tiny.call_kwargs(NAME, pipe=pipe), callback_on_step_end=look, **kwargs).images.cpu()


def onloads(pipe, call_index):
    records = doe.transfer_ledger(pipe).records
    return [r for r in records if r.call_index == call_index and r.direction == "onload"]


@pytest.mark.parametrize("keep_between", [True, False], ids=["kept-between", "not-kept"])
def test_from_the_second_call_only_the_streamed_blocks_cross(accelerator, reference, keep_between):
    pipe, budget = armed(keep_between)
    seen, between = [], []
    for _ in range(3):
        image = watched_call(pipe, seen)
        assert max_abs_diff(image, reference) == 0.0
        between.append(doe.offload_status(pipe))
    blocks = seen[0].components["transformer"].blocks
    assert blocks is not None and REST in blocks.resident and blocks.streamed
    steps = tiny.STEPS_RUN[NAME]
    kept_bytes = sum(block_sizes(pipe.transformer)[b] for b in blocks.resident)
    first = onloads(pipe, 0)
    assert sum(r.nbytes for r in first) == kept_bytes + steps * blocks.bytes_per_pass
    for call_index in (1, 2):
        records = onloads(pipe, call_index)
        if keep_between:  # the kept blocks stayed: only the streamed ones cross, once per step
            assert {r.block for r in records} == set(blocks.streamed)
            assert sum(r.nbytes for r in records) == steps * blocks.bytes_per_pass
        else:  # streams stop at each call's end, as before: the kept blocks cross again
            assert sum(r.nbytes for r in records) == kept_bytes + steps * blocks.bytes_per_pass
    transformer = between[-1].components["transformer"]
    if keep_between:  # between calls: resident, its kept blocks on the device and nothing in its ring
        assert transformer.resident and transformer.blocks == blocks
        if accelerator is not None:
            assert transformer.where == "mixed"
            for name in blocks.resident:
                module = pipe.transformer if name == REST else pipe.transformer.get_submodule(name)
                assert accelerator.where(module) in (("device", "mixed") if name == REST else ("device",))
            for name in blocks.streamed:
                assert accelerator.where(pipe.transformer.get_submodule(name)) == "host"
    else:
        assert not transformer.resident and transformer.blocks is None
    assert all(s.resident_bytes <= budget for s in seen + between)  # the budget, at every step and between calls


def test_the_trace_shows_the_kept_blocks_resident_between_calls(accelerator, reference):
    pipe, _ = armed()
    tiny.run(pipe, NAME)
    blocks = doe.offload_status(pipe).components["transformer"].blocks
    with doe.trace(pipe) as recorded:
        for _ in range(2):
            assert max_abs_diff(tiny.run(pipe, NAME), reference) == 0.0
    kept_bytes = sum(block_sizes(pipe.transformer)[b] for b in blocks.resident)
    if accelerator is not None:  # read from the tensors when the trace began: the kept blocks
        assert recorded.initial_resident["transformer"] == kept_bytes
    moves = [r for r in recorded.records if r.component == "transformer"]
    assert moves and {r.block for r in moves} == set(blocks.streamed)  # no kept block moved in either call
    last = [r for r in moves if r.call == 0][-1]
    assert last.direction == "offload" and last.resident_bytes == kept_bytes  # at the end of a call: the kept blocks


def test_a_change_to_a_kept_block_between_calls_is_used_and_written_back_at_release(accelerator):
    pipe, _ = armed()
    tiny.run(pipe, NAME)
    kept = [b for b in doe.offload_status(pipe).components["transformer"].blocks.resident if b != REST]
    block = pipe.transformer.get_submodule(kept[0])
    weight = next(p for p in block.parameters() if p.dim() == 2)
    with torch.no_grad():
        weight.data.mul_(1.5)  # through .data, on the device where it is kept: no version counter sees it
    image = tiny.run(pipe, NAME)
    released = doe.release(pipe)
    # The same edit on a pipeline without offload gives the same image, and the host now holds it.
    plain = deep_flux()
    with torch.no_grad():
        next(p for p in plain.transformer.get_submodule(kept[0]).parameters() if p.dim() == 2).mul_(1.5)
    assert max_abs_diff(image, tiny.run(plain, NAME)) == 0.0
    assert released > 0 and doe.offload_status(pipe).components["transformer"].blocks is None
    copied = [r for r in doe.transfer_ledger(pipe).records if r.direction == "offload" and r.block == kept[0]][-1]
    if accelerator is not None:
        assert copied.kind == "copy"  # seen by its fingerprint, copied back
        assert accelerator.where(pipe.transformer) == "host"
    expected = next(p for p in plain.transformer.get_submodule(kept[0]).parameters() if p.dim() == 2)
    assert torch.equal(weight.detach().cpu(), expected.detach())


def test_release_sends_every_kept_block_home_and_the_next_call_streams_again(accelerator, reference):
    pipe, _ = armed()
    tiny.run(pipe, NAME)
    blocks = doe.offload_status(pipe).components["transformer"].blocks
    kept_bytes = sum(block_sizes(pipe.transformer)[b] for b in blocks.resident)
    assert doe.release(pipe) == kept_bytes
    status = doe.offload_status(pipe).components["transformer"]
    assert not status.resident and status.blocks is None
    if accelerator is not None:
        assert accelerator.where(pipe.transformer) == "host"
    assert max_abs_diff(tiny.run(pipe, NAME), reference) == 0.0
    assert sum(r.nbytes for r in onloads(pipe, 1)) > sum(r.nbytes for r in onloads(pipe, 0)) - 1  # kept blocks again


def test_a_user_move_between_calls_stops_the_stream_where_it_is(accelerator, reference):
    pipe, _ = armed()
    tiny.run(pipe, NAME)
    pipe.to("cpu")  # the user's move: everything on the host
    status = doe.offload_status(pipe).components["transformer"]
    assert status.blocks is None
    if accelerator is not None:
        assert accelerator.where(pipe.transformer) == "host"
    assert max_abs_diff(tiny.run(pipe, NAME), reference) == 0.0
    assert doe.offload_status(pipe).components["transformer"].blocks is not None  # streaming again


def test_a_submodule_replaced_in_a_kept_block_between_calls_is_what_runs(accelerator):
    pipe, _ = armed()
    tiny.run(pipe, NAME)
    kept = [b for b in doe.offload_status(pipe).components["transformer"].blocks.resident if b != REST][0]
    plain = deep_flux()
    for target in (pipe, plain):
        block = target.transformer.get_submodule(kept)
        name, linear = next((n, m) for n, m in block.named_modules() if isinstance(m, torch.nn.Linear))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(11)
            fresh = torch.nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
        block.set_submodule(name, fresh)  # built on the host, put in a block kept on the device
    assert max_abs_diff(tiny.run(pipe, NAME), tiny.run(plain, NAME)) == 0.0
    doe.release(pipe)
    if accelerator is not None:
        assert accelerator.where(pipe.transformer) == "host"


def test_a_failed_call_leaves_the_kept_blocks_consistent_and_nothing_in_the_ring(accelerator, reference):
    pipe, budget = armed()
    tiny.run(pipe, NAME)

    def fail(p, step, timestep, kw):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pipe(**tiny.call_kwargs(NAME, pipe=pipe), callback_on_step_end=fail)
    status = doe.offload_status(pipe)
    blocks = status.components["transformer"].blocks
    assert blocks is not None and status.resident_bytes <= budget
    if accelerator is not None:
        for name in blocks.streamed:
            assert accelerator.where(pipe.transformer.get_submodule(name)) == "host"
    assert max_abs_diff(tiny.run(pipe, NAME), reference) == 0.0
    assert {r.block for r in onloads(pipe, 2)} == set(blocks.streamed)  # the kept blocks stayed through it all


def test_a_stream_started_without_knowing_its_uses_learns_them_and_keeps_no_block_a_decode_never_runs(accelerator):
    """The VAE does not fit beside the resident components (a budget that holds the others and a ring for it): its
    first use weighs every block alike; once a call has shown which of its blocks a decode runs (no encoder block),
    the blocks it does not run are kept no more (they go first when room is needed, and are never copied in), and
    from the fourth call on only the VAE's streamed decoder blocks cross, once each. (Before residency by blocks its
    stream stopped at the first call's end and started again weighed by its uses, steady from the third call; it now
    takes a call more to settle and then moves fewer bytes.)"""
    from test_block_streaming import deep_encoders_flux

    pipe = deep_encoders_flux()
    sizes = component_sizes(pipe)
    vae = block_sizes(pipe.vae)
    room = vae[REST] + 3 * max(v for k, v in vae.items() if k != REST) + 4096
    budget = sum(sizes[n] for n in sizes if n != "vae") + room
    assert sizes["vae"] > room
    reference = tiny.run(deep_encoders_flux(), NAME)
    pipe.enable_model_cpu_offload(device="cpu", memory_budget=budget, keep_on_device_between_generations=True)
    for _ in range(5):
        assert max_abs_diff(tiny.run(pipe, NAME), reference) == 0.0
    blocks = doe.offload_status(pipe).components["vae"].blocks
    assert blocks is not None and not [b for b in blocks.resident if b.startswith("encoder.")]
    assert [r.component for r in onloads(pipe, 1) if r.block is None] == []  # block by block, nothing whole
    for call_index in (3, 4):  # the streamed blocks a decode runs, once each
        streamed = [r.block for r in onloads(pipe, call_index)]
        assert streamed and set(streamed) <= set(blocks.streamed)
        assert len(streamed) == len(set(streamed)) and not [b for b in streamed if b.startswith("encoder.")]
    steady = sum(r.nbytes for r in onloads(pipe, 4))
    assert steady == sum(vae[b] for b in blocks.streamed if not b.startswith("encoder."))  # one pass, no more


def test_another_component_that_needs_the_room_takes_the_ring_s_before_any_kept_block(accelerator, reference):
    """The VAE excluded, the others offloaded, a budget of the VAE and 0.8 of the transformer: the transformer's
    stream stays at each call's end, and at the next call the text encoders, which do not fit beside its kept blocks
    and ring, take the room of its ring (let go for nothing: it holds no weight between forwards) and no kept block
    leaves (issue 30: before residency by blocks every kept block left at every call's start, and came back). The
    budget holds after every move, measured from the tensors on the simulated accelerator, and the images are those
    of no offload."""
    pipe = deep_flux()
    sizes = component_sizes(pipe)
    budget = sizes["vae"] + int(sizes["transformer"] * 0.8)
    pipe.enable_model_cpu_offload(
        device="cpu", memory_budget=budget, exclude_from_offload=["vae"], keep_on_device_between_generations=True
    )
    watch = MovesWithin(pipe, accelerator, budget) if accelerator is not None else None
    seen, between = [], []
    for _ in range(3):
        assert max_abs_diff(watched_call(pipe, seen), reference) == 0.0
        between.append(doe.offload_status(pipe))
    if watch is not None:
        watch.remove()
        assert watch.moves and watch.over == []
    assert all(s.resident_bytes <= budget for s in seen + between)
    blocks = between[-1].components["transformer"].blocks
    assert blocks is not None and all(s.components["transformer"].blocks == blocks for s in between[1:])
    kept_bytes = sum(block_sizes(pipe.transformer)[b] for b in blocks.resident)
    assert sizes["text_encoder"] > budget - sizes["vae"] - blocks.device_bytes  # it cannot load beside them
    assert kept_bytes + sizes["text_encoder"] <= budget - sizes["vae"]  # they fit beside the kept blocks alone
    records = doe.transfer_ledger(pipe).records
    for call_index in (1, 2):
        this_call = [r for r in records if r.call_index == call_index]
        assert [r for r in this_call if r.component == "text_encoder" and r.direction == "onload"]
        assert not [r for r in this_call if r.block in blocks.resident and r.component == "transformer"]


def test_an_exception_in_a_streamed_block_leaves_the_next_call_clean(accelerator, reference):
    """A streamed block raises in the second call: nothing is left in the ring, the kept blocks stay consistent
    (on the device, their host copies current), and the next call gives the images of no offload with only the
    streamed blocks crossing."""
    pipe, budget = armed()
    tiny.run(pipe, NAME)
    blocks = doe.offload_status(pipe).components["transformer"].blocks
    failing = pipe.transformer.get_submodule(blocks.streamed[1])
    runs = {"n": 0}

    def fail(module, args):
        runs["n"] += 1
        if runs["n"] == 2:
            raise RuntimeError("boom in a streamed block")

    handle = failing.register_forward_pre_hook(fail)  # after the streamer's: the block is in the ring
    with pytest.raises(RuntimeError, match="boom"):
        tiny.run(pipe, NAME)
    handle.remove()
    status = doe.offload_status(pipe)
    assert status.components["transformer"].blocks == blocks and status.resident_bytes <= budget
    if accelerator is not None:
        for name in blocks.streamed:
            assert accelerator.where(pipe.transformer.get_submodule(name)) == "host"
        for name in blocks.resident:
            if name != REST:
                assert accelerator.where(pipe.transformer.get_submodule(name)) == "device"
    assert max_abs_diff(tiny.run(pipe, NAME), reference) == 0.0
    records = onloads(pipe, 2)
    assert {r.block for r in records} == set(blocks.streamed)
    assert sum(r.nbytes for r in records) == tiny.STEPS_RUN[NAME] * blocks.bytes_per_pass


@pytest.mark.parametrize("keep_between", [False, True], ids=["other-chain", "other-kept-between"])
def test_a_pipeline_sharing_the_streaming_component_runs_it_with_the_images_of_no_offload(
    accelerator, reference, keep_between
):
    """A second pipeline made with `from_pipe` shares the transformer that the first keeps streaming between calls:
    when it runs it, that stream stops first and it places the transformer by its own options; calls of both, one
    after the other, give the images of no offload, and once both release it everything is on the host."""
    pipe, _ = armed()
    other = type(pipe).from_pipe(pipe)
    other.enable_model_cpu_offload(device="cpu", keep_on_device_between_generations=keep_between)
    for target in (pipe, other, pipe, other, pipe):
        assert max_abs_diff(tiny.run(target, NAME), reference) == 0.0
        streams = doe.offload_status(pipe).components["transformer"].blocks is not None
        if target is other:
            assert not streams  # its call stopped the stream
        elif not keep_between:  # (kept whole by the other, it runs whole, as any shared component it left there)
            assert streams
        whole = [r for r in doe.transfer_ledger(other).records if r.component == "transformer" and r.block is None]
        assert not whole or whole[0].direction == "onload"  # it never sent home what it had not loaded
    doe.release(pipe)
    doe.release(other)
    if accelerator is not None:
        assert accelerator.where(pipe.transformer) == "host"
