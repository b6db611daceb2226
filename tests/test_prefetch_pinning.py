"""`prefetch=True` copies only from page-locked host memory (issue 22, phase 2): with `pin_memory` not set it turns
page-locking to `"auto"` and says so once; an explicit `pin_memory=False` beside it is refused before anything
changes. Run through the fakes of the driver's page-locking and of `torch.cuda`'s streams (no GPU in CI)."""

import pytest
import torch
from harness import diffusers_logs, max_abs_diff
from simulated_accelerator import SimulatedAccelerator

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: prefetch and page-locking")

import diffusers_offload_ext as doe  # noqa: E402
from diffusers_offload_ext.testing import tiny  # noqa: E402
from diffusers_offload_ext.testing.copy_stream import fake_cuda  # noqa: E402
from diffusers_offload_ext.testing.page_locking import fake_page_locking  # noqa: E402

pytestmark = [pytest.mark.plugin_only, pytest.mark.usefixtures("installed")]
NAME = "sd15"
BIG = "1GiB"


def test_prefetch_with_pin_memory_not_set_page_locks_and_says_so_once(caplog):
    pipe = tiny.build(NAME)
    reference = tiny.run(tiny.build(NAME), NAME)
    with fake_page_locking(), SimulatedAccelerator(), fake_cuda() as cuda:
        with diffusers_logs(caplog, "INFO"):
            pipe.enable_model_cpu_offload(device="cpu", memory_budget=BIG, prefetch=True)
            images = [tiny.run(pipe, NAME) for _ in range(2)]
            pipe.enable_model_cpu_offload(device="cpu", prefetch=True)  # enabled again: said once
        status = doe.offload_status(pipe)
    said = [r.getMessage() for r in caplog.records if 'pin_memory="auto"' in r.getMessage()]
    assert len(said) == 1 and "`prefetch=True` page-locks" in said[0]
    assert status.options["pin_memory"] is None and status.options["prefetch"] is True  # not set, and shown so
    assert status.pinned_bytes > 0  # page-locked, as "auto" does on a device that supports it
    assert cuda.issued and cuda.pageable_async == 0  # prefetched asynchronously, never from pageable memory
    assert all(max_abs_diff(image, reference) <= 1e-3 for image in images)


def test_pin_memory_not_set_stays_off_without_prefetch():
    pipe = tiny.build(NAME)
    with fake_page_locking(), SimulatedAccelerator():
        pipe.enable_model_cpu_offload(device="cpu", memory_budget=BIG)
        tiny.run(pipe, NAME)
        assert doe.offload_status(pipe).pinned_bytes == 0


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


def test_pin_memory_false_while_the_manager_is_off_is_refused_when_prefetch_would_act_again():
    """Issue 21's fix stands: `prefetch` stays set while the manager is off; `pin_memory=False` is accepted then
    (prefetch does nothing), and refused when the manager comes back on and prefetch would act."""
    pipe = tiny.build(NAME)
    pipe.enable_model_cpu_offload(device="cpu", memory_budget=BIG, prefetch=True)
    pipe.enable_model_cpu_offload(device="cpu", memory_budget="auto")  # the manager off: prefetch stays set
    pipe.enable_model_cpu_offload(device="cpu", pin_memory=False)
    options = doe.offload_status(pipe).options
    assert options["prefetch"] is True and options["pin_memory"] is False
    with pytest.raises(ValueError, match="set before"):
        pipe.enable_model_cpu_offload(device="cpu", memory_budget=BIG)
    assert doe.offload_status(pipe).options["memory_budget"] is None  # the rejected call changed nothing
    pipe.enable_model_cpu_offload(device="cpu", memory_budget=BIG, pin_memory="auto")
    assert doe.offload_status(pipe).options["prefetch"] is True
    assert torch.is_tensor(tiny.run(pipe, NAME))
