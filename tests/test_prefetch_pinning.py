"""`prefetch` copies only from page-locked host memory (issue 22, phase 2): not set, both are on where the device is an
accelerator that can page-lock and has copy streams (issue 31), off on the plain CPU; an explicit `pin_memory=False`
beside an explicit `prefetch=True` is refused before anything changes. Run through the fakes of the driver's
page-locking and of `torch.cuda`'s streams (no GPU in CI)."""

import pytest
import torch
from harness import max_abs_diff
from simulated_accelerator import SimulatedAccelerator

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: prefetch and page-locking")

import diffusers_offload_ext as doe  # noqa: E402
from diffusers_offload_ext.testing import tiny  # noqa: E402
from diffusers_offload_ext.testing.copy_stream import fake_cuda  # noqa: E402
from diffusers_offload_ext.testing.page_locking import fake_page_locking  # noqa: E402

pytestmark = [pytest.mark.plugin_only, pytest.mark.usefixtures("installed")]
NAME = "sd15"
BIG = "1GiB"


def test_pin_memory_and_prefetch_not_set_page_lock_and_prefetch_on_an_accelerator():
    """Issue 31: with neither set, an accelerator with page-locking and copy streams (the fakes of CUDA) page-locks
    and prefetches; the options stay "not set", and `fast_paths` says why each is on."""
    pipe = tiny.build(NAME)
    reference = tiny.run(tiny.build(NAME), NAME)
    with fake_page_locking(), SimulatedAccelerator(), fake_cuda() as cuda:
        pipe.enable_model_cpu_offload(device="cpu", memory_budget=BIG)
        images = [tiny.run(pipe, NAME) for _ in range(2)]
        status = doe.offload_status(pipe)
    assert status.options["pin_memory"] is None and status.options["prefetch"] is None  # not set, and shown so
    fast = status.fast_paths
    assert fast.accelerator and fast.drops and fast.page_locked and fast.prefetch
    assert "default" in fast.why["pin_memory"] and "self-check passed" in fast.why["pin_memory"]
    assert status.pinned_bytes > 0
    assert "prefetch" in {r.kind for r in doe.transfer_ledger(pipe).records}
    assert cuda.issued and cuda.pageable_async == 0  # prefetched asynchronously, never from pageable memory
    assert all(max_abs_diff(image, reference) <= 1e-3 for image in images)


def test_prefetch_true_on_the_plain_cpu_page_locks_nothing_there():
    """The plain CPU keeps the plain paths: with the fakes active, `prefetch=True` (which asks for page-locking) finds
    no accelerator: nothing is page-locked (the device is the host), nothing prefetched."""
    pipe = tiny.build(NAME)
    with fake_page_locking():
        pipe.enable_model_cpu_offload(device="cpu", memory_budget=BIG, prefetch=True)
        tiny.run(pipe, NAME)
        status = doe.offload_status(pipe)
    assert not status.fast_paths.accelerator and not status.fast_paths.page_locked
    assert status.pinned_bytes == 0
    assert "prefetch" not in {r.kind for r in doe.transfer_ledger(pipe).records}


@pytest.mark.parametrize("together", [True, False], ids=["same-call", "pin-first"])
def test_an_explicit_pin_memory_false_with_prefetch_is_refused_before_anything_changes(together):
    pipe = tiny.build(NAME)
    pipe.enable_model_cpu_offload(device="cpu", memory_budget=BIG)
    if not together:
        pipe.enable_model_cpu_offload(device="cpu", pin_memory=False)
    before = doe.offload_status(pipe)
    arguments = dict(prefetch=True, pin_memory=False) if together else dict(prefetch=True)
    with pytest.raises(ValueError) as raised:
        pipe.enable_model_cpu_offload(device="cpu", **arguments)
    message = str(raised.value)
    assert "`prefetch=True`" in message and "`pin_memory=False`" in message
    assert 'pin_memory="auto"' in message and "`prefetch=False`" in message  # the fixes
    assert doe.offload_status(pipe) == before  # nothing changed


def test_pin_memory_false_is_refused_while_prefetch_true_is_in_force_and_accepted_after_prefetch_false():
    """`prefetch=True` no longer needs the residency manager (issue 31: the chain modes prefetch too), so
    `pin_memory=False` is refused whenever `prefetch=True` is in force, manager on or off; `prefetch=False` first (or
    leaving `prefetch` unset) makes it acceptable."""
    pipe = tiny.build(NAME)
    pipe.enable_model_cpu_offload(device="cpu", prefetch=True)  # the chain: accepted now
    with pytest.raises(ValueError, match="set before"):
        pipe.enable_model_cpu_offload(device="cpu", pin_memory=False)
    assert doe.offload_status(pipe).options["pin_memory"] is None  # the rejected call changed nothing
    pipe.enable_model_cpu_offload(device="cpu", prefetch=False, pin_memory=False)
    options = doe.offload_status(pipe).options
    assert options["prefetch"] is False and options["pin_memory"] is False
    assert torch.is_tensor(tiny.run(pipe, NAME))
