"""`pin_memory`: the host copies of offloaded components are page-locked in place (the existing storages, at their
exact size, once), within a host budget spent first on what moves most; an eviction that must copy writes into them;
refusals and subclasses fall back to pageable memory. Run on the simulated accelerator with a fake driver
(`diffusers_offload_ext/testing/page_locking.py`): what the driver really does on CUDA is not tested here."""

import pytest
import torch
from simulated_accelerator import SimulatedAccelerator

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: page-locking is not in the upstream patch")

import diffusers_offload_ext as doe  # noqa: E402
from diffusers_offload_ext.testing import tiny  # noqa: E402
from diffusers_offload_ext.testing.page_locking import fake_page_locking  # noqa: E402
from diffusers_offload_ext.transfer import pinned  # noqa: E402

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
    with fake_page_locking() as (locker, store), SimulatedAccelerator():
        pipe.enable_model_cpu_offload(device="cpu", pin_memory=True)
        first = generate(pipe)
        registrations = len([c for c in locker.calls if c[0] == "register"])
        second = generate(pipe)
        assert len([c for c in locker.calls if c[0] == "register"]) == registrations  # pinned once
        status = doe.offload_status(pipe)
    offloaded = ("text_encoder", "unet", "vae")
    expected = {ptr: n for name in offloaded for ptr, n in before[name].items()}
    assert locker.registered == expected  # the very storages, at their exact size: no second copy
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
    with fake_page_locking(budget=unet + 1024) as (locker, store), SimulatedAccelerator():
        pipe.enable_model_cpu_offload(device="cpu", pin_memory="auto")
        image = generate(pipe, preview=True)
        assert store.pinned_bytes <= store.budget
    assert locker.registered == storages(pipe.unet)
    assert (image - reference).abs().max() <= TOLERANCE


def test_refused_page_locking_falls_back_to_pageable_memory(reference):
    pipe = tiny.build(NAME)
    with fake_page_locking(refuse=True) as (locker, _), SimulatedAccelerator():
        pipe.enable_model_cpu_offload(device="cpu", pin_memory=True)
        image = generate(pipe)
        assert doe.offload_status(pipe).pinned_bytes == 0
    assert locker.calls and not locker.registered
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

    with fake_page_locking() as (locker, _), SimulatedAccelerator():
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

    with fake_page_locking() as (locker, _), SimulatedAccelerator():
        pipe.enable_model_cpu_offload(device="cpu", pin_memory=True)
        pipe(**tiny.call_kwargs(NAME, pipe=pipe), callback_on_step_end=replace)
        generate(pipe)
    expected = {**storages(pipe.text_encoder), **storages(pipe.unet), **storages(pipe.vae)}
    assert locker.registered == expected


def test_excluded_components_and_removed_hooks_hold_no_page_locked_memory():
    pipe = tiny.build(NAME)
    with fake_page_locking() as (locker, _), SimulatedAccelerator():
        pipe.enable_model_cpu_offload(device="cpu", pin_memory=True)
        generate(pipe)
        pipe.enable_model_cpu_offload(exclude_from_offload=["unet"])
        generate(pipe)
        assert not set(locker.registered) & set(storages(pipe.unet))
        assert doe.offload_status(pipe).components["unet"].pinned_bytes == 0
        assert set(locker.registered) == {**storages(pipe.text_encoder), **storages(pipe.vae)}.keys()
        pipe.remove_all_hooks()
    assert locker.registered == {}
    assert doe.offload_status(pipe).pinned_bytes == 0


def test_turning_it_off_lets_go():
    pipe = tiny.build(NAME)
    with fake_page_locking() as (locker, _), SimulatedAccelerator():
        pipe.enable_model_cpu_offload(device="cpu", pin_memory=True)
        generate(pipe)
        assert locker.registered
        pipe.enable_model_cpu_offload(pin_memory=False)
        assert locker.registered == {}
        generate(pipe)
    assert locker.registered == {}


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
    with fake_page_locking() as (locker, store):
        store.prepare(module, "linear")
        assert locker.registered == {
            module.weight.untyped_storage().data_ptr(): 64,
            module.bias.untyped_storage().data_ptr(): 16,
        }
        store.release(module)
        assert locker.registered == {}


def test_a_collected_component_is_unregistered():
    import gc

    module = torch.nn.Linear(4, 4)
    with fake_page_locking() as (locker, store):
        store.prepare(module, "linear")
        assert locker.registered
        del module
        gc.collect()
        assert locker.registered == {}
        assert store.pinned_bytes == 0
    assert "cpu" not in pinned.LOCKERS
