"""Fast by default (issue 31): with no option, with `exclude_from_offload` and with
`keep_on_device_during_generation`, an accelerator drops the device copies of unchanged weights instead of copying
them back; where it can page-lock host memory and has copy streams (CUDA; here the fakes of its driver and streams,
`diffusers_offload_ext/testing/`), onloads copy from page-locked memory and the next component of the chain is
prefetched on a copy stream; the plain CPU keeps the plain paths. Each default is turned off by its option, and a
device whose page-locking self-check fails keeps the plain path with one info line and no CUDA error left behind."""

import itertools
from collections import Counter

import pytest
from harness import diffusers_logs, max_abs_diff
from simulated_accelerator import SimulatedAccelerator

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: the fast paths are not in the upstream patch")

import diffusers_offload_ext as doe  # noqa: E402
from diffusers_offload_ext.pinning.prefetch import ChainPrefetchPolicy  # noqa: E402
from diffusers_offload_ext.policies import Facts  # noqa: E402
from diffusers_offload_ext.testing import tiny  # noqa: E402
from diffusers_offload_ext.testing.copy_stream import fake_cuda  # noqa: E402
from diffusers_offload_ext.testing.page_locking import fake_page_locking  # noqa: E402

pytestmark = [pytest.mark.plugin_only, pytest.mark.usefixtures("installed")]
NAME = "sd15"
TOLERANCE = 1e-3
MODES = {
    "defaults": {},
    "exclude": {"exclude_from_offload": ["unet"]},
    "keep": {"keep_on_device_during_generation": True},
}
#: What the chain prefetches in each mode (the unet excluded: the text encoder's next offloaded one is the VAE).
PREFETCHED = {"defaults": {"unet", "vae"}, "exclude": {"vae"}, "keep": {"unet", "vae"}}


@pytest.fixture(scope="module")
def reference():
    return tiny.run(tiny.build(NAME), NAME)


def kinds(records, direction):
    return {r.kind for r in records if r.direction == direction}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_drops_on_the_simulated_accelerator_and_plain_copies_on_the_plain_cpu(accelerator, mode, reference):
    pipe = tiny.build(NAME)
    pipe.enable_model_cpu_offload(device="cpu", **MODES[mode])
    image = tiny.run(pipe, NAME)
    records, fast = doe.transfer_ledger(pipe).records, doe.offload_status(pipe).fast_paths
    if accelerator is None:
        assert kinds(records, "offload") == {"copy"} and not any(fast[:4])
        assert "plain CPU" in fast.why["zero_copy_eviction"] and "plain CPU" in fast.why["pin_memory"]
        assert "no copy stream" in fast.why["prefetch"] or "it is off" in fast.why["prefetch"]
    else:
        assert kinds(records, "offload") == {"drop"} and fast.accelerator and fast.drops
        assert not fast.page_locked and "cannot page-lock" in fast.why["pin_memory"]  # no driver: pageable
        assert not fast.prefetch
    assert max_abs_diff(image, reference) <= TOLERANCE


def run_under_the_fakes(options, calls=2):
    """`calls` calls of a fresh pipeline with `options` on the simulated accelerator, under the fakes of CUDA's
    page-locking and streams: `(images, ledger records, status, FakeCuda)`."""
    pipe = tiny.build(NAME)
    with fake_page_locking(), SimulatedAccelerator(), fake_cuda() as cuda:
        pipe.enable_model_cpu_offload(device="cpu", **options)
        images = [tiny.run(pipe, NAME) for _ in range(calls)]
        status = doe.offload_status(pipe)
    return images, doe.transfer_ledger(pipe).records, status, cuda


@pytest.mark.parametrize("mode", sorted(MODES))
def test_page_locked_copies_and_chain_prefetch_under_the_fakes_of_cuda(mode, reference):
    images, records, status, cuda = run_under_the_fakes(MODES[mode])
    fast = status.fast_paths
    assert fast.drops and fast.page_locked and fast.prefetch
    assert status.pinned_bytes > 0  # page-locked in place
    assert {r.component for r in records if r.kind == "prefetch"} == PREFETCHED[mode]
    assert kinds(records, "offload") == {"drop"}
    assert cuda.issued and cuda.pageable_async == 0  # on the copy stream, never from pageable memory
    assert all(max_abs_diff(image, reference) <= TOLERANCE for image in images)
    # The same moves as without prefetch (which component, which way, how many bytes), some of them earlier.
    _, plain, _, _ = run_under_the_fakes({**MODES[mode], "prefetch": False})
    assert "prefetch" not in kinds(plain, "onload")
    assert Counter((r.component, r.direction, r.nbytes) for r in records) == Counter(
        (r.component, r.direction, r.nbytes) for r in plain
    )


@pytest.mark.parametrize(
    "option, expected",
    [
        ({"zero_copy_eviction": False}, dict(drops=False, page_locked=True, prefetch=True)),
        ({"pin_memory": False}, dict(drops=True, page_locked=False, prefetch=False)),
        ({"prefetch": False}, dict(drops=True, page_locked=True, prefetch=False)),
    ],
    ids=["zero_copy_eviction", "pin_memory", "prefetch"],
)
def test_each_default_is_turned_off_by_its_option(option, expected, reference):
    images, records, status, cuda = run_under_the_fakes(option)
    fast = status.fast_paths
    assert {k: getattr(fast, k) for k in expected} == expected
    name = next(iter(option))
    assert fast.why[name].startswith(f"{name}=False")
    assert kinds(records, "offload") == ({"drop"} if expected["drops"] else {"copy"})
    assert ("prefetch" in kinds(records, "onload")) is expected["prefetch"]
    assert (status.pinned_bytes > 0) is expected["page_locked"]
    assert all(max_abs_diff(image, reference) <= TOLERANCE for image in images)


@pytest.mark.parametrize(
    "driver",
    [dict(refuse=2), dict(refuse=2, api="runtime"), dict(corrupt=True)],
    ids=["driver-refuses", "runtime-refuses", "copies-corrupt"],
)
def test_a_failed_self_check_keeps_the_plain_path_with_one_info_line_and_no_cuda_error(driver, caplog, reference):
    """Without the self-check, a driver whose page-locked copies arrive wrong gives a wrong image (the fake adds 1 to
    every byte copied from page-locked memory); with it, the device is never trusted with them."""
    pipe = tiny.build(NAME)
    with fake_page_locking(**driver) as (memory, _), SimulatedAccelerator(), fake_cuda():
        with diffusers_logs(caplog, "INFO"):
            pipe.enable_model_cpu_offload(device="cpu")
            images = [tiny.run(pipe, NAME) for _ in range(2)]
            pipe.enable_model_cpu_offload(device="cpu", exclude_from_offload=["unet"])  # armed again: checked once
            images.append(tiny.run(pipe, NAME))
        status = doe.offload_status(pipe)
        registered, poisoned, left = dict(memory.registered), list(memory.poisoned), memory.last_error
    said = [r.getMessage() for r in caplog.records if "page-locked copies are off" in r.getMessage()]
    assert len(said) == 1 and ("refused" in said[0] or "wrong" in said[0]), said
    fast = status.fast_paths
    assert fast.drops and not fast.page_locked and not fast.prefetch
    assert "self-check" in fast.why["pin_memory"] or "refused" in fast.why["pin_memory"]
    assert status.pinned_bytes == 0 and registered == {}  # the test buffer let go
    assert poisoned == [] and left == 0  # no CUDA error left behind: every kernel after it ran
    assert all(max_abs_diff(image, reference) <= TOLERANCE for image in images)


def test_prefetch_true_with_pin_memory_false_is_refused_and_prefetch_true_works_in_the_chain(reference):
    pipe = tiny.build(NAME)
    with pytest.raises(ValueError, match=r"`prefetch=True` copies only from page-locked.*`pin_memory=False`"):
        pipe.enable_model_cpu_offload(device="cpu", prefetch=True, pin_memory=False)
    assert not doe.offload_status(pipe).enabled
    images, records, status, _ = run_under_the_fakes({"prefetch": True, "keep_on_device_during_generation": True})
    assert status.policy == "chain" and "prefetch" in kinds(records, "onload")
    assert all(max_abs_diff(image, reference) <= TOLERANCE for image in images)


def test_the_chain_prefetches_only_what_the_free_memory_holds():
    """A pure decision: the next component of the chain is prefetched only when the room for weights the device has
    now (free memory, what the pipeline holds, less the reserve) holds it beside what stays after this use."""
    policy = ChainPrefetchPolicy(order=("a", "b", "c"), chain=("a", "b", "c"), hooked=("a", "b", "c"))
    sizes = {"a": 10, "b": 30, "c": 5}

    def facts(room):
        return Facts(sizes, capacity=lambda held: room)

    assert policy.on_use("a", set(), facts(40)).moves == (("onload", "a"), ("prefetch", "b"))
    assert policy.on_use("a", set(), facts(39)).moves == (("onload", "a"),)  # a and b: 40 bytes
    # b runs: a leaves first, so c fits beside b alone
    assert policy.on_use("b", {"a", "b"}, facts(35)).moves == (("offload", "a"), ("prefetch", "c"))
    assert policy.on_use("b", {"a", "b"}, facts(34)).moves == (("offload", "a"),)
    assert policy.on_use("c", {"c"}, facts(0)).moves == ()  # the last one: nothing follows
    assert policy.on_use("a", set(), Facts(sizes)).moves[-1] == ("prefetch", "b")  # free memory unknown: unlimited


def test_streamed_blocks_are_spread_through_the_forward():
    """Of equal blocks, those kept lie evenly along the running order, so the streamed ones are spread between them
    (each streamed block's copy overlaps the kept blocks running before it) instead of running last, back to back;
    the bytes kept and streamed are the same."""
    from diffusers_offload_ext.blocks.choice import Item, choose_blocks, keep_most_used

    items = [Item("rest", 5, 1)] + [Item(i, 10, 1) for i in range(12)]
    choice = choose_blocks(items, 5 + 40 + 30, forced=["rest"])
    kept = [k for k in choice.kept if k != "rest"]
    assert kept == [0, 3, 6, 9] and choice.kept_bytes == 45  # four of twelve, evenly spaced
    runs = [len(list(group)) for key, group in itertools.groupby(i in kept for i in range(12)) if not key]
    assert max(runs) == 2  # never more than two streamed blocks in a row
    assert sorted(keep_most_used([Item(i, 10, 1) for i in range(8)], 40)) == [0, 2, 4, 6]
    # Blocks of other sizes or uses keep their order of preference: most uses, then larger.
    assert keep_most_used([Item("a", 10, 1), Item("b", 10, 3), Item("c", 20, 1)], 30) == {"b", "c"}


def test_the_printed_status_says_how_bytes_move(accelerator):
    pipe = tiny.build(NAME)
    pipe.enable_model_cpu_offload(device="cpu")
    text = str(doe.offload_status(pipe))
    if accelerator is None:
        assert "moves: plain copies (pageable, copied back)" in text
    else:
        assert "moves: unchanged weights dropped, not copied back" in text and "page-locked" not in text


def test_doctor_says_which_fast_paths_the_defaults_use_and_why(capsys):
    """On this machine (no accelerator) `doctor` reports the plain CPU's: no fast path, each with its reason."""
    import json

    from diffusers_offload_ext.cli import main

    assert main(["doctor", "--no-bandwidth", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)["fast_paths"]
    if "cpu:0" not in found:
        pytest.skip("an accelerator is here: doctor reports it instead")
    fast = found["cpu:0"]
    assert not fast["accelerator"] and not (fast["drops"] or fast["page_locked"] or fast["prefetch"])
    assert set(fast["why"]) == {"zero_copy_eviction", "pin_memory", "prefetch"}
    assert "plain CPU" in fast["why"]["pin_memory"]
