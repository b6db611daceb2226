"""Issue 22's fast paths, run through fakes that model the CUDA semantics they depend on (no GPU in CI): the real
transfers over a fake of `torch.cuda`'s streams (`diffusers_offload_ext/testing/copy_stream.py`: copies in flight until
waited on, pageable copies that hold the host, numbered compute operations for stream order, per-stream pools) and
page-locked host memory from a fake driver (`testing/page_locking.py`).

- only page-locked memory is prefetched; without it a component loads synchronously, said once;
- prefetched weights are allocated on the compute stream (the copy stream's pool would keep them from compute);
- ring copies are queued after the running block's kernels, each after the compute stream's use of its buffer;
- onloads and ring copies from page-locked memory never hold the host per tensor."""

import pytest
import torch
from harness import diffusers_logs, max_abs_diff
from simulated_accelerator import SimulatedAccelerator

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: prefetch and page-locking")

import diffusers_offload_ext as doe  # noqa: E402
from diffusers_offload_ext.blocks.find import block_sizes  # noqa: E402
from diffusers_offload_ext.testing import tiny  # noqa: E402
from diffusers_offload_ext.testing.page_locking import fake_page_locking  # noqa: E402
from diffusers_offload_ext.testing.copy_stream import fake_cuda  # noqa: E402
from diffusers_offload_ext.transfer import make_transfer  # noqa: E402
from diffusers_offload_ext.blocks.ring import Ring  # noqa: E402

pytestmark = [pytest.mark.plugin_only, pytest.mark.usefixtures("installed")]
NAME = "sd15"
TOLERANCE = 1e-3
BIG = "1GiB"


@pytest.fixture(scope="module")
def reference():
    return tiny.run(tiny.build(NAME), NAME)


def device_storages(pipe, sim):
    """Storage addresses of every component weight on the device."""
    found = set()
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            for tensor in [*module.parameters(), *module.buffers()]:
                if sim.is_on_device(tensor):
                    found.add(tensor.untyped_storage().data_ptr())
    return found


# -- through the transfers themselves --------------------------------------------------------------------------------
def test_an_onload_from_page_locked_memory_holds_the_host_for_no_tensor():
    module = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(8)])  # 16 tensors
    with fake_page_locking() as (_, store), SimulatedAccelerator() as sim, fake_cuda() as cuda:
        transfer = make_transfer(sim.device)
        transfer.pinning = store
        transfer.onload(module, keep_host=True)
        onload_waits = cuda.host_waits
        assert sim.where(module) == "device"
        pageable = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(8)])
        transfer.pinning = None
        transfer.onload(pageable, keep_host=True)
    assert onload_waits == 0  # queued on the compute stream, which orders what follows
    assert cuda.host_waits == 16  # pageable memory: blocking, as stock (one per tensor)


def test_ring_copies_on_the_compute_stream_hold_the_host_for_no_tensor_of_a_page_locked_block():
    block = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    hosts = [t.detach() for t in block.parameters()]
    with fake_page_locking() as (_, store), SimulatedAccelerator() as sim, fake_cuda() as cuda:
        store.prepare(block, "block")
        transfer = make_transfer(sim.device)  # no copy stream: the copies are made on the compute stream
        transfer.pinning = store
        ring = Ring(sim.device, 8192, 1)
        views = ring.views(0, hosts)
        transfer.copier().copy(list(zip(views, hosts)))
        assert all(torch.equal(v.cpu(), h) for v, h in zip(views, hosts))
    assert cuda.host_waits == 0


def test_a_prefetch_allocates_on_the_compute_stream_and_copies_on_its_own():
    module = torch.nn.Linear(256, 256)
    expected = module.weight.detach().clone()
    with fake_page_locking() as (_, store), SimulatedAccelerator() as sim, fake_cuda() as cuda:
        transfer = make_transfer(sim.device, prefetch=True)
        transfer.pinning = store
        transfer.prefetch(module, keep_host=True)
        assert torch.isnan(module.weight).all()  # in flight: compute has not waited for it
        weights = {t.untyped_storage().data_ptr() for t in module.parameters()}
        transfer.ready(module)
        assert torch.equal(module.weight.detach().cpu(), expected)
    assert len(cuda.issued) == 2 and cuda.host_waits == 0  # on the copy stream, from page-locked memory
    assert not weights & set(cuda.side_allocations)  # the compute stream's pool: reusable by compute


def test_a_prefetch_from_pageable_memory_loads_synchronously_and_says_so_once(caplog):
    modules = [torch.nn.Linear(64, 64) for _ in range(3)]
    with SimulatedAccelerator() as sim, fake_cuda() as cuda:
        transfer = make_transfer(sim.device, prefetch=True)  # no page-locked store: `pin_memory=False`
        with diffusers_logs(caplog, "WARNING"):
            for module in modules:
                transfer.prefetch(module, keep_host=True)
        assert not transfer.pending and all(sim.where(m) == "device" for m in modules)
    assert cuda.pageable_async == 0 and cuda.issued == []  # never an asynchronous copy from pageable memory
    said = [r.getMessage() for r in caplog.records if "loaded synchronously" in r.getMessage()]
    assert len(said) == 1 and "`Linear`" in said[0]


# -- whole pipelines -------------------------------------------------------------------------------------------------
def test_prefetch_without_page_locked_memory_gives_the_same_images_without_asynchronous_copies(reference):
    pipe = tiny.build(NAME)
    with SimulatedAccelerator(), fake_cuda() as cuda:
        pipe.enable_model_cpu_offload(device="cpu", memory_budget=BIG, prefetch=True)
        images = [tiny.run(pipe, NAME) for _ in range(2)]
    assert cuda.pageable_async == 0 and cuda.issued == []
    assert all(max_abs_diff(image, reference) <= TOLERANCE for image in images)


def test_page_locked_prefetches_hold_no_host_and_leave_their_weights_to_the_compute_pool(reference):
    pipe = tiny.build(NAME)
    seen = []
    with fake_page_locking(), SimulatedAccelerator() as sim, fake_cuda() as cuda:
        pipe.enable_model_cpu_offload(device="cpu", memory_budget=BIG, prefetch=True, pin_memory=True)

        def look(p, step, timestep, kwargs):
            seen.append(device_storages(p, sim) & set(cuda.side_allocations))
            return kwargs

        images = [pipe(**tiny.call_kwargs(NAME, pipe=pipe), callback_on_step_end=look).images for _ in range(2)]
    assert cuda.issued and cuda.pageable_async == 0
    assert seen and not any(seen)
    assert all(max_abs_diff(image, reference) <= TOLERANCE for image in images)


def test_streamed_blocks_are_copied_as_soon_as_asked_after_their_buffers_last_reader_only(reference_flux):
    """The deep tiny FLUX transformer under 80% of its size, with page-locked host copies and a copy stream: every
    ring copy is queued when it is asked for (in the running block's pre-hook, before that block's kernels: issue 31;
    it used to wait for them), ordered after the compute stream's last use of the buffer it rewrites (a fresh buffer
    included: else the fake raises) and after nothing else queued on the compute stream (it used to wait for all of
    it); the images are those of no offload."""
    from test_block_streaming import deep_flux

    pipe = deep_flux()
    budget = int(sum(block_sizes(pipe.transformer).values()) * 0.8)
    windows = []
    with fake_page_locking(), SimulatedAccelerator(), fake_cuda() as cuda:
        blocks = [*pipe.transformer.transformer_blocks, *pipe.transformer.single_transformer_blocks]
        for block in blocks:  # registered first: they run before the offload hooks, and after them at the end
            block.register_forward_pre_hook(lambda m, a: windows.append([cuda.clock, None]))
            block.register_forward_hook(lambda m, a, o: windows[-1].__setitem__(1, cuda.clock))
        pipe.enable_model_cpu_offload(device="cpu", memory_budget=budget, pin_memory=True)
        images = [tiny.run(pipe, "flux") for _ in range(3)]
    ahead = [clock for issued, landed, clock in cuda.landed if landed > issued]
    assert ahead and cuda.pageable_async == 0
    assert [
        n for n in ahead for start, end in windows if start <= n < end
    ]  # queued before the running block's kernels
    assert any(ordered < issued for issued, ordered in zip(cuda.issued, cuda.ordered))  # not after all compute
    assert all(max_abs_diff(image, reference_flux) == 0.0 for image in images)


def test_each_forward_prefetches_its_first_blocks_and_ends_without_a_host_wait(reference_flux):
    """On a copy stream the first streamed blocks of every forward are prefetched at its start (they used to be
    copied when they ran, one block per step), and a forward ends without the host waiting for the copy stream
    inside a call without a step callback (it used to wait at each one); with a step callback, which may edit the
    host weights, the host waits there as before."""
    from test_block_streaming import deep_flux

    pipe = deep_flux()
    budget = int(sum(block_sizes(pipe.transformer).values()) * 0.8)
    with fake_page_locking(), SimulatedAccelerator(), fake_cuda() as cuda:
        pipe.enable_model_cpu_offload(device="cpu", memory_budget=budget)
        tiny.run(pipe, "flux")  # learns the order and the passes
        ledger = doe.transfer_ledger(pipe)
        ledger.clear()
        syncs = cuda.side_syncs
        image = tiny.run(pipe, "flux")
        quiet = cuda.side_syncs - syncs
        records = list(ledger.records)
        syncs = cuda.side_syncs
        pipe(**tiny.call_kwargs("flux", pipe=pipe), callback_on_step_end=lambda p, i, t, kwargs: kwargs)
        with_callback = cuda.side_syncs - syncs
    # The transformer's blocks released at each run (the encoders, which run once beside it, may keep some blocks
    # too: the residency manager decides block by block).
    transformer = [r for r in records if r.component == "transformer"]
    names = {r.block for r in transformer if r.direction == "offload" and r.step is not None and r.block}
    streamed = [r for r in transformer if r.block in names and r.direction == "onload"]
    steps = tiny.STEPS_RUN["flux"]
    assert len(streamed) == steps * len(names) and all(r.kind == "prefetch" for r in streamed)
    assert with_callback == quiet + steps  # the host waits at each forward's end only with a callback
    assert max_abs_diff(image, reference_flux) == 0.0


@pytest.fixture(scope="module")
def reference_flux():
    from test_block_streaming import deep_flux

    return tiny.run(deep_flux(), "flux")


def test_block_streaming_without_a_copy_stream_never_holds_the_host_for_a_page_locked_weight(reference_flux):
    """Whole components, kept blocks and streamed blocks, all page-locked, cross on the compute stream without a
    host wait: the only copies that hold the host are the pipeline's own (its inputs and its image), as many as
    without offload."""
    from test_block_streaming import deep_flux

    pipe = deep_flux()
    with SimulatedAccelerator() as sim:
        pipe.to(sim.device)
        with fake_cuda() as cuda:
            [tiny.run(pipe, "flux") for _ in range(2)]
            own = cuda.host_waits
    pipe = deep_flux()
    budget = int(sum(block_sizes(pipe.transformer).values()) * 0.8)
    with fake_page_locking(), SimulatedAccelerator(), fake_cuda() as cuda:
        pipe.enable_model_cpu_offload(device="cpu", memory_budget=budget, pin_memory=True, prefetch=False)
        images = [tiny.run(pipe, "flux") for _ in range(2)]
        streamed = [r for r in doe.transfer_ledger(pipe).records if r.block is not None and r.direction == "onload"]
    assert streamed and cuda.issued == []  # no copy stream: everything on the compute stream
    assert cuda.host_waits == own
    assert all(max_abs_diff(image, reference_flux) == 0.0 for image in images)


# -- write-backs ----------------------------------------------------------------------------------------------------
def _edit_through_data(module, sim):
    """Double every floating weight of `module` on the device through `.data` (no version counter sees it); returns
    the expected host values, read before any write-back is counted."""
    expected = []
    with torch.no_grad():
        for p in module.parameters():
            if sim.is_on_device(p) and p.is_floating_point():
                p.data.mul_(2)
                expected.append((p, p.detach().to("cpu", copy=True)))
    return expected


def test_a_write_back_into_page_locked_host_copies_holds_the_host_once_per_component():
    """A resident component changed on the device is copied back into its page-locked host copies at its eviction:
    non-blocking on the compute stream, then one host wait for all its tensors (not one per tensor), and the host
    reads the new values (the fake's write-backs read NaN until the host waits)."""
    pipe = tiny.build(NAME)
    with fake_page_locking(), SimulatedAccelerator() as sim, fake_cuda() as cuda:
        pipe.enable_model_cpu_offload(
            device="cpu", memory_budget=BIG, keep_on_device_between_generations=True, pin_memory=True
        )
        tiny.run(pipe, NAME)
        expected = _edit_through_data(pipe.unet, sim)
        waits, syncs = len(cuda.waits), cuda.host_syncs
        doe.release(pipe)
        held = [w for w in cuda.waits[waits:] if w.startswith("d2h")]
        syncs = cuda.host_syncs - syncs
        assert sim.where(pipe.unet) == "host"
    copied = [r for r in doe.transfer_ledger(pipe).records if r.direction == "offload" and r.kind == "copy"]
    assert [r.component for r in copied] == ["unet"] and len(expected) > 10
    assert held == [] and syncs == 1  # was one blocking copy per tensor
    assert all(torch.equal(p.detach(), value) for p, value in expected)


def test_a_kept_block_changed_on_the_device_is_written_back_with_one_host_wait():
    from test_block_streaming import deep_flux

    pipe = deep_flux()
    budget = int(sum(block_sizes(pipe.transformer).values()) * 0.8)
    with fake_page_locking(), SimulatedAccelerator() as sim, fake_cuda() as cuda:
        pipe.enable_model_cpu_offload(device="cpu", memory_budget=budget, pin_memory=True)
        found = {}

        def edit(p, step, timestep, kwargs):
            if not found:
                kept = [b for b in doe.offload_status(p).components["transformer"].blocks.resident if b != "<rest>"]
                found["block"] = kept[0]
                found["expected"] = _edit_through_data(p.transformer.get_submodule(kept[0]), sim)
                found["at"] = (len(cuda.waits), cuda.host_syncs)
            return kwargs

        pipe(**tiny.call_kwargs("flux", pipe=pipe), callback_on_step_end=edit)
        waits, syncs = found["at"]
        held = [w for w in cuda.waits[waits:] if w.startswith("d2h")]
        syncs = cuda.host_syncs - syncs
    copied = [r for r in doe.transfer_ledger(pipe).records if r.direction == "offload" and r.kind == "copy"]
    assert [r.block for r in copied] == [found["block"]]
    assert held == [] and syncs == 1  # was one blocking copy per tensor
    assert all(torch.equal(p.detach(), value) for p, value in found["expected"])
