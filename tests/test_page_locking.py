"""`pin_memory`: the host copies of offloaded components are page-locked in place (the existing storages, at their
exact size, once), within a host budget spent first on what moves most; an eviction that must copy writes into them;
refusals and subclasses fall back to pageable memory. Run on the simulated accelerator with the real lockers over a fake
driver and runtime (`diffusers_offload_ext/testing/page_locking.py`) that lock whole pages, refuse what CUDA refuses
and, through the runtime, leave a refusal as an error the next kernel raises (as measured on an H200): what the
driver really does on CUDA is not tested here."""

import pytest
import torch
from simulated_accelerator import SimulatedAccelerator

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: page-locking is not in the upstream patch")

import diffusers_offload_ext as doe  # noqa: E402
from diffusers_offload_ext.testing import tiny  # noqa: E402
from diffusers_offload_ext.testing.page_locking import (  # noqa: E402
    ALREADY_REGISTERED,
    OUT_OF_MEMORY,
    PAGE,
    fake_page_locking,
)
from diffusers_offload_ext.pinning import store as pinned  # noqa: E402

pytestmark = [pytest.mark.plugin_only, pytest.mark.usefixtures("installed")]
TOLERANCE = 1e-3
NAME = "sd15"


@pytest.fixture(scope="module")
def reference():
    return tiny.run(tiny.build(NAME), NAME)


def storages(module):
    """`data_ptr -> bytes` of the module's host storages, each once."""
    found = {}
    for tensor in list(module.parameters()) + list(module.buffers()):
        if tensor.device == torch.device("cpu"):
            found[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return found


def pages_of(memory, found):
    """Every page the storages of `found` (`data_ptr -> bytes`) lie in."""
    return {page for p, n in found.items() for page in memory.pages(p, n)}


def locked_in_place(memory, found):
    """Every storage of `found` (`data_ptr -> bytes`) is page-locked where it lies, and every registration is whole
    pages that the storages lie in (nothing registered outside the weights' pages, no second copy)."""
    pages = pages_of(memory, found)
    inside = all(set(memory.pages(start, n)) <= pages and start % PAGE == 0 and n % PAGE == 0
                 for start, n in memory.registered.items())  # fmt: skip
    return inside and all(memory.locked(p, n) for p, n in found.items())


def registered_in(memory, module):
    """The registrations that hold pages of `module`'s host storages."""
    pages = pages_of(memory, storages(module))
    return {s for s, n in memory.registered.items() if set(memory.pages(s, n)) & pages}


def generate(pipe, preview=False):
    return pipe(**tiny.call_kwargs(NAME, pipe=pipe, preview=preview)).images.cpu()


def moves(pipe):
    return [(r.component, r.direction) for r in doe.transfer_ledger(pipe).records]


def test_host_copies_are_page_locked_in_place_once(reference):
    plain = tiny.build(NAME)
    with SimulatedAccelerator():
        plain.enable_model_cpu_offload(device="cpu")
        generate(plain)
    pipe = tiny.build(NAME)
    before = {n: storages(m) for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    with fake_page_locking() as (memory, store), SimulatedAccelerator():
        pipe.enable_model_cpu_offload(device="cpu", pin_memory=True)
        first = generate(pipe)
        registrations = len([c for c in memory.calls if c[1] == "register"])
        second = generate(pipe)
        assert len([c for c in memory.calls if c[1] == "register"]) == registrations  # pinned once
        status = doe.offload_status(pipe)
    offloaded = ("text_encoder", "unet", "vae")
    expected = {ptr: n for name in offloaded for ptr, n in before[name].items()}
    assert locked_in_place(memory, expected)  # the very storages: no second copy
    assert status.pinned_bytes == sum(expected.values()) == store.pinned_bytes
    assert {n: c.pinned_bytes for n, c in status.components.items()} == {n: sum(before[n].values()) for n in offloaded}
    for name in offloaded:  # evictions wrote into the same host memory
        assert storages(getattr(pipe, name)) == before[name]
    assert moves(pipe) == moves(plain) * 2  # which component moves when: as without page-locking
    for image in (first, second):
        assert (image - reference).abs().max() <= TOLERANCE


def test_the_budget_goes_to_what_moves_most(reference):
    """With a preview decoded every step, the chain reloads the UNet at every step: the budget, room for the UNet
    alone, ends up holding it rather than the text encoder that came first."""
    pipe = tiny.build(NAME)
    unet = sum(storages(pipe.unet).values())
    with fake_page_locking(budget=unet + 1024) as (memory, store), SimulatedAccelerator():
        pipe.enable_model_cpu_offload(device="cpu", pin_memory="auto")
        image = generate(pipe, preview=True)
        assert store.pinned_bytes <= store.budget
        status = doe.offload_status(pipe)
    assert {n: c.pinned_bytes for n, c in status.components.items() if c.pinned_bytes} == {"unet": unet}
    assert registered_in(memory, pipe.unet) == set(memory.registered)
    assert (image - reference).abs().max() <= TOLERANCE


def test_refused_page_locking_falls_back_to_pageable_memory(reference):
    pipe = tiny.build(NAME)
    with fake_page_locking(refuse=OUT_OF_MEMORY) as (memory, _), SimulatedAccelerator():
        pipe.enable_model_cpu_offload(device="cpu", pin_memory=True)
        image = generate(pipe)
        assert doe.offload_status(pipe).pinned_bytes == 0
    assert memory.calls and not memory.registered
    assert (image - reference).abs().max() <= TOLERANCE


def test_a_change_on_the_device_is_written_into_the_page_locked_copy():
    pipe = tiny.build(NAME)
    original = next(pipe.unet.parameters()).detach().clone()
    host = storages(pipe.unet)

    def edit(pipe, step, timestep, kwargs):
        if step == 0:
            with torch.no_grad():
                next(pipe.unet.parameters()).add_(1.0)
        return kwargs

    with fake_page_locking(), SimulatedAccelerator():
        pipe.enable_model_cpu_offload(device="cpu", pin_memory=True, zero_copy_eviction=True)
        pipe(**tiny.call_kwargs(NAME, pipe=pipe), callback_on_step_end=edit)
    kinds = {(r.component, r.kind) for r in doe.transfer_ledger(pipe).records if r.direction == "offload"}
    assert kinds == {("text_encoder", "drop"), ("unet", "copy"), ("vae", "drop")}
    assert storages(pipe.unet) == host  # written in place
    torch.testing.assert_close(next(pipe.unet.parameters()).detach(), original + 1.0)


def test_a_structure_change_gets_fresh_host_memory_and_the_stale_pins_go():
    pipe = tiny.build(NAME)

    def replace(pipe, step, timestep, kwargs):
        if step == 0:
            old = pipe.unet.conv_out
            new = torch.nn.Conv2d(old.in_channels, old.out_channels, 3, padding=1).to(old.weight.device)
            with torch.no_grad():
                new.weight.copy_(old.weight)
                new.bias.copy_(old.bias)
            pipe.unet.conv_out = new
        return kwargs

    with fake_page_locking() as (memory, _), SimulatedAccelerator():
        pipe.enable_model_cpu_offload(device="cpu", pin_memory=True)
        pipe(**tiny.call_kwargs(NAME, pipe=pipe), callback_on_step_end=replace)
        generate(pipe)
    expected = {**storages(pipe.text_encoder), **storages(pipe.unet), **storages(pipe.vae)}
    assert locked_in_place(memory, expected)  # the stale ones were unregistered


def test_excluded_components_and_removed_hooks_hold_no_page_locked_memory():
    pipe = tiny.build(NAME)
    with fake_page_locking() as (memory, _), SimulatedAccelerator():
        pipe.enable_model_cpu_offload(device="cpu", pin_memory=True)
        generate(pipe)
        pipe.enable_model_cpu_offload(exclude_from_offload=["unet"])
        generate(pipe)
        assert not registered_in(memory, pipe.unet)
        assert doe.offload_status(pipe).components["unet"].pinned_bytes == 0
        kept = {**storages(pipe.text_encoder), **storages(pipe.vae)}
        assert all(memory.locked(p, n) for p, n in kept.items())
        needed = {page for p, n in kept.items() for page in memory.pages(p, n)}
        # What stays registered holds their pages (a range made for the unet may hold a page it shares with them).
        assert all(set(memory.pages(start, n)) & needed for start, n in memory.registered.items())
        pipe.remove_all_hooks()
    assert memory.registered == {}
    assert doe.offload_status(pipe).pinned_bytes == 0


def test_turning_it_off_lets_go():
    pipe = tiny.build(NAME)
    with fake_page_locking() as (memory, _), SimulatedAccelerator():
        pipe.enable_model_cpu_offload(device="cpu", pin_memory=True)
        generate(pipe)
        assert memory.registered
        pipe.enable_model_cpu_offload(pin_memory=False)
        assert memory.registered == {}
        generate(pipe)
    assert memory.registered == {}


@pytest.mark.parametrize(
    "value, error, match",
    [
        ("yes", ValueError, r"`pin_memory` must be True, False or \"auto\".*'yes'"),
        (1, TypeError, r"`pin_memory` must be True, False or \"auto\".*got 1"),
        (True, ValueError, r"`pin_memory=True` needs an execution device.*'cpu:0'.*pin_memory=\"auto\""),
    ],
)
def test_bad_values_raise_before_anything_changes(value, error, match):
    pipe = tiny.build(NAME)
    with pytest.raises(error, match=match):
        pipe.enable_model_cpu_offload(device="cpu", pin_memory=value)
    assert not doe.offload_status(pipe).enabled
    assert all(getattr(m, "_hf_hook", None) is None for m in pipe.components.values())


def test_auto_without_a_driver_is_pageable(reference):
    pipe = tiny.build(NAME)
    with SimulatedAccelerator():
        pipe.enable_model_cpu_offload(device="cpu", pin_memory="auto")
        image = generate(pipe)
    assert doe.offload_status(pipe).pinned_bytes == 0
    assert (image - reference).abs().max() <= TOLERANCE


def test_subclasses_and_sparse_tensors_stay_pageable():
    module = torch.nn.Linear(4, 4)
    module.register_buffer("mask", torch.eye(4).to_sparse())
    with fake_page_locking() as (memory, store):
        assert not store.prepare(module, "linear")  # not all of it: the sparse buffer stays pageable
        assert locked_in_place(memory, {t.untyped_storage().data_ptr(): t.numel() * 4 for t in module.parameters()})
        assert store.holds(module.weight) and store.holds(module.bias) and not store.holds(module.mask)
        store.release(module)
        assert memory.registered == {}


def test_a_collected_component_is_unregistered():
    import gc

    module = torch.nn.Linear(4, 4)
    with fake_page_locking() as (memory, store):
        store.prepare(module, "linear")
        assert memory.registered
        del module
        gc.collect()
        assert memory.registered == {}
        assert store.pinned_bytes == 0
    assert "cpu" not in pinned.LOCKERS


# -- issue 22: page-locking that cannot poison CUDA --------------------------------------------------------------------
@pytest.mark.parametrize("api", ["driver", "runtime"])
def test_a_refused_page_lock_leaves_no_error_for_the_next_kernel(api, reference):
    """Host memory runs out after a few pages: the later registrations are refused. Through the driver API a refusal
    is a return code; through the runtime it stays the last error unless read, and the next layer would raise it."""
    pipe = tiny.build(NAME)
    with fake_page_locking(api=api, limit=64 << 10) as (memory, _), SimulatedAccelerator():
        pipe.enable_model_cpu_offload(device="cpu", pin_memory=True)
        images = [generate(pipe) for _ in range(2)]
    assert any(code for code in memory.refusals) and memory.poisoned == [] and memory.last_error == 0
    for image in images:
        assert (image - reference).abs().max() <= TOLERANCE


@pytest.mark.parametrize("api", ["driver", "runtime"])
def test_memory_already_page_locked_is_used_as_it_is(api, reference):
    """Weights someone moved to `pin_memory()` memory: registering them again is refused by CUDA (invalid value);
    they are page-locked already, so they are neither registered nor a reason to stay pageable."""
    pipe = tiny.build(NAME)
    with fake_page_locking(api=api) as (memory, store), SimulatedAccelerator():
        for parameter in pipe.unet.parameters():
            parameter.data = memory.pin_memory(parameter.data)
        pinned_by_others = storages(pipe.unet)
        pipe.enable_model_cpu_offload(device="cpu", pin_memory=True)
        images = [generate(pipe) for _ in range(2)]
        status = doe.offload_status(pipe)
        own = store.pinned_bytes
    assert memory.poisoned == [] and not registered_in(memory, pipe.unet) and not any(memory.refusals)
    assert status.components["unet"].pinned_bytes == sum(pinned_by_others.values())  # page-locked, as it was
    assert own == status.pinned_bytes - status.components["unet"].pinned_bytes  # the budget counts only ours
    for image in images:
        assert (image - reference).abs().max() <= TOLERANCE


@pytest.mark.parametrize("api", ["driver", "runtime"])
def test_a_storage_two_components_share_is_registered_once_and_kept_for_the_other(api):
    first, second = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
    second.weight = first.weight  # one storage reachable from two components
    pointer = first.weight.untyped_storage().data_ptr()
    with fake_page_locking(api=api) as (memory, store):
        store.prepare(first, "first")
        store.prepare(second, "second")
        assert not any(memory.refusals) and memory.last_error == 0
        assert store.pinned_bytes == sum(n for n in storages(first).values()) + 64 * 4  # each storage once
        store.release(first)
        assert memory.locked(pointer, 64 * 64 * 4) and store.holds(second.weight)  # still needed by `second`
        store.release(second)
        assert memory.registered == {}


def test_safetensors_mapped_weights_are_page_locked_in_place(tmp_path, reference):
    """Weights loaded from a safetensors checkpoint are slices of one file mapping: neighbouring tensors share pages,
    which the driver locks once. Each is page-locked where it lies, with no refusal and no error left."""
    import diffusers

    pipe = tiny.build(NAME)
    pipe.unet.save_pretrained(tmp_path)
    pipe.unet = diffusers.UNet2DConditionModel.from_pretrained(tmp_path)
    mapped = storages(pipe.unet)
    pointers = sorted(mapped)
    assert any((a + mapped[a] - 1) // 4096 == b // 4096 for a, b in zip(pointers, pointers[1:]))  # shared pages
    with fake_page_locking(api="runtime") as (memory, store), SimulatedAccelerator():
        pipe.enable_model_cpu_offload(device="cpu", pin_memory=True)
        images = [generate(pipe) for _ in range(2)]
        assert doe.offload_status(pipe).components["unet"].pinned_bytes == sum(mapped.values())
    assert storages(pipe.unet) == mapped  # in place: the mapping itself, no copy
    assert all(memory.locked(p, n) for p, n in mapped.items())
    assert not any(memory.refusals) and memory.poisoned == []
    for image in images:
        assert (image - reference).abs().max() <= TOLERANCE


def test_page_locked_memory_is_unregistered_only_after_the_copies_reading_it():
    """A prefetch is in flight (the fake copy stream delivers it only when waited on) when the component's host memory
    is let go: unregistering it then would make the copy read memory that is no longer locked (the fake then
    delivers NaN). Let go of as stale, it stays registered until a later call finds the copy done; released, the
    release waits for the copy first."""
    from diffusers_offload_ext.testing.copy_stream import fake_cuda
    from diffusers_offload_ext.transfer import make_transfer

    first, second = torch.nn.Linear(256, 256), torch.nn.Linear(256, 256)
    expected = [m.weight.detach().clone() for m in (first, second)]
    with fake_page_locking() as (memory, store), SimulatedAccelerator() as sim, fake_cuda():
        transfer = make_transfer(sim.device, prefetch=True)
        transfer.pinning = store
        transfer.prefetch(first, keep_host=True)
        store.forget_stale(first)  # its weights are on the device now: its host storages are no longer its own
        still = dict(memory.registered)
        transfer.ready(first)
        store.prepare(torch.nn.Linear(2, 2), "next")  # a later call finds the copy done and lets go of the memory
        left = set(memory.registered)
        transfer.prefetch(second, keep_host=True)
        store.release(second)
        released = set(memory.registered) - left
        transfer.ready(second)
        got = [m.weight.detach().cpu() for m in (first, second)]
    assert still and not set(still) & left  # kept while the copy was in flight, then unregistered
    assert released == set()  # unregistered at once, after waiting for the copy
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


# -- issue 31: the review of the CUDA paths ----------------------------------------------------------------------------
def test_pipe_to_lets_go_of_page_locked_memory_that_no_longer_backs_the_weights(reference):
    """After `pipe.to(device)` the weights live on the device: the page-locked host memory that held them is
    unregistered and no longer kept alive by the store (it was, before: the whole host copy stayed page-locked)."""
    pipe = tiny.build(NAME)
    with fake_page_locking() as (memory, store), SimulatedAccelerator() as sim:
        pipe.enable_model_cpu_offload(device="cpu", pin_memory=True)
        generate(pipe)
        assert memory.registered and store.pinned_bytes
        pipe.to(sim.device)
        assert memory.registered == {} and store.pinned_bytes == 0
        assert doe.offload_status(pipe).pinned_bytes == 0
        image = generate(pipe)
    assert (image - reference).abs().max() <= TOLERANCE


def test_neighbouring_tensors_sharing_a_page_are_registered_once_in_whole_pages():
    """Two storages of one mapping whose ranges share a page (as safetensors' mapped weights do): every page is
    registered once, by registrations that start and end on page boundaries, and none outside their pages."""
    import mmap

    mapping = mmap.mmap(-1, 8 * PAGE)
    module = torch.nn.Module()
    first = torch.frombuffer(mapping, dtype=torch.uint8, count=PAGE + 100, offset=50)
    second = torch.frombuffer(mapping, dtype=torch.uint8, count=2 * PAGE, offset=50 + PAGE + 100)
    module.register_buffer("first", first)
    module.register_buffer("second", second)
    with fake_page_locking() as (memory, store):
        assert store.prepare(module, "neighbours")
        made = [(p, n) for p, n, _, _ in memory.registrations]
        assert not memory.refusals
        pages = [page for p, n in made for page in memory.pages(p, n)]
        wanted = set(memory.pages(first.data_ptr(), first.numel())) | set(memory.pages(second.data_ptr(), PAGE * 2))
        assert sorted(pages) == sorted(set(pages)) and set(pages) == wanted  # each page once, no other page
        assert all(p % PAGE == 0 and n % PAGE == 0 for p, n in made)  # whole pages: what the driver locks
        store.release(module)
        assert memory.registered == {}


def test_registrations_are_portable_in_the_asking_devices_context_and_never_synchronize(monkeypatch):
    """A registration asked for by `cuda:1` is made with `CU_MEMHOSTREGISTER_PORTABLE` (page-locked for every
    context) in cuda:1's primary context, pushed and popped around the call, and unregistered in that same context,
    even when another device asks; no call synchronizes a device (a finaliser running at exit must not)."""
    from diffusers_offload_ext.pinning import locking
    from diffusers_offload_ext.testing.page_locking import CONTEXT, FakeHostMemory

    def refuse(*args, **kwargs):
        raise AssertionError("a device-wide synchronize")

    monkeypatch.setattr(torch.cuda, "synchronize", refuse)
    memory = FakeHostMemory()
    locker = locking.DriverLocker(memory.driver)
    buffer = torch.zeros(3 * PAGE, dtype=torch.uint8)
    start = -(-buffer.data_ptr() // PAGE) * PAGE
    assert locker.register(start, PAGE, torch.device("cuda", 1)) == 0
    assert memory.registrations == [(start, PAGE, locking.PORTABLE, CONTEXT + 1)]
    assert memory.contexts == []  # popped again
    seen = []
    memory.driver.cuMemHostUnregister.function = lambda p: seen.append(list(memory.contexts)) or memory._unregister(
        "driver", p
    )
    assert locker.unregister(start, torch.device("cuda", 0)) == 0
    assert seen == [[CONTEXT + 1]] and memory.registered == {}
