"""`prefetch=True`: with the residency manager, the component the previous call ran next is onloaded while the
current one runs, when the budget has room for both; its completion is waited on before it runs. On the simulated
accelerator, the real `CopyStreamTransfer` over a fake of `torch.cuda`'s streams (`diffusers_offload_ext/testing/copy_stream.py`)
whose prefetched weights hold NaN until waited on (a component run too early gives a wrong image), with page-locked
host copies from a fake driver (`testing/page_locking.py`): only page-locked memory is prefetched. What a real CUDA
stream does is not tested here."""

import pytest
import torch
from simulated_accelerator import SimulatedAccelerator

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: prefetch is not in the upstream patch")

import diffusers_offload_ext as doe  # noqa: E402
from diffusers_offload_ext.testing import tiny  # noqa: E402
from diffusers_offload_ext.testing.page_locking import fake_page_locking  # noqa: E402
from diffusers_offload_ext.testing.copy_stream import fake_cuda  # noqa: E402

pytestmark = [pytest.mark.plugin_only, pytest.mark.usefixtures("installed")]
TOLERANCE = 1e-3
NAME = "sd15"
BIG = "1GiB"


@pytest.fixture(scope="module")
def reference():
    return tiny.run(tiny.build(NAME), NAME)


def sizes(pipe):
    return {n: c.nbytes for n, c in doe.offload_status(pipe).components.items()}


def run_calls(budget, prefetch, calls=3, preview=(False, False, False)):
    pipe = tiny.build(NAME)
    with fake_page_locking(), SimulatedAccelerator(), fake_cuda() as cuda:
        pipe.enable_model_cpu_offload(device="cpu", memory_budget=budget, prefetch=prefetch, pin_memory=True)
        images = [pipe(**tiny.call_kwargs(NAME, pipe=pipe, preview=preview[i])).images.cpu() for i in range(calls)]
    return pipe, images, doe.transfer_ledger(pipe).records, cuda


def per_call(records, index):
    return [(r.component, r.direction, r.kind) for r in records if r.call_index == index]


def test_the_next_component_is_prefetched_and_waited_on(reference):
    pipe, images, records, made = run_calls(BIG, prefetch=True)
    _, _, plain, _ = run_calls(BIG, prefetch=False)
    assert [(r.component, r.direction, r.call_index) for r in records] == [
        (r.component, r.direction, r.call_index) for r in plain
    ]  # the same moves, only some of them earlier
    assert "prefetch" not in {k for _, _, k in per_call(records, 0)}  # a first call has no prediction
    for index in (1, 2):
        onloads = {c: k for c, d, k in per_call(records, index) if d == "onload"}
        assert onloads == {"text_encoder": "copy", "unet": "prefetch", "vae": "prefetch"}
    # Copied on the side stream, never from pageable memory; the images show each was waited on before it ran.
    assert made.issued and made.pageable_async == 0
    for image in images:
        assert (image - reference).abs().max() <= TOLERANCE


def test_no_prefetch_that_the_budget_cannot_hold(reference):
    """Room for the text encoder and the UNet, not the VAE as well: the VAE is not prefetched while the UNet runs,
    and the bytes on the device never exceed the budget, prefetches counted from their issue."""
    pipe = tiny.build(NAME)
    size = sizes_of(pipe)
    budget = size["text_encoder"] + size["unet"] + size["vae"] // 2
    pipe, images, records, _ = run_calls(budget, prefetch=True)
    on_device, peak = set(), 0
    for r in records:
        (on_device.add if r.direction == "onload" else on_device.discard)(r.component)
        peak = max(peak, sum(size[n] for n in on_device))
    assert peak <= budget
    assert ("unet", "onload", "prefetch") in per_call(records, 1)
    assert ("vae", "onload", "prefetch") not in per_call(records, 1)
    for image in images:
        assert (image - reference).abs().max() <= TOLERANCE


def sizes_of(pipe):
    return {
        name: sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))
        for name, m in pipe.components.items()
        if isinstance(m, torch.nn.Module)
    }


def test_a_call_unlike_the_previous_one_stays_correct(reference):
    """The second call decodes a preview every step, which the first did not, and the third does not again: each is
    predicted from a call that ran differently (in the third, the VAE is prefetched at the first step and used only
    at the end). The images stay right and the host weights intact."""
    pipe, images, records, made = run_calls(BIG, prefetch=True, calls=3, preview=(False, True, False))
    assert any(k == "prefetch" for _, _, k in per_call(records, 1))
    for name in ("text_encoder", "unet", "vae"):
        module = getattr(pipe, name)
        assert all(torch.isfinite(t).all() for t in module.parameters())
    assert ("vae", "onload", "prefetch") in per_call(records, 2)
    assert (images[0] - reference).abs().max() <= TOLERANCE and (images[2] - reference).abs().max() <= TOLERANCE


@pytest.mark.parametrize("then", ["to", "remove_all_hooks"])
def test_moves_from_outside_wait_for_a_pending_prefetch(then):
    """A call interrupted inside the UNet's forward, right after the VAE's prefetch was issued (before that forward's
    end, which waits on it), leaves it pending; `pipe.to("cpu")` or `remove_all_hooks()` then must not move (or leave)
    weights that are still being written."""

    def interrupt(module, args):
        raise KeyboardInterrupt

    pipe = tiny.build(NAME)
    with fake_page_locking(), SimulatedAccelerator(), fake_cuda() as cuda:
        made = cuda.transfers
        pipe.enable_model_cpu_offload(device="cpu", memory_budget=BIG, keep_on_device_between_generations=True,
                                      prefetch=True, pin_memory=True)  # fmt: skip
        pipe(**tiny.call_kwargs(NAME, pipe=pipe))
        doe.release(pipe)  # the next call onloads again, so that there is something to prefetch
        handle = pipe.unet.conv_out.register_forward_pre_hook(interrupt)  # the UNet's last layer
        with pytest.raises(KeyboardInterrupt):
            pipe(**tiny.call_kwargs(NAME, pipe=pipe))
        handle.remove()
        assert made[0].pending  # the VAE's prefetch was issued and never waited on
        if then == "to":
            pipe.to("cpu")
        else:
            pipe.remove_all_hooks()
        assert not made[0].pending
    for module in (pipe.text_encoder, pipe.unet, pipe.vae):
        assert all(torch.isfinite(t).all() for t in module.parameters())


def test_without_a_copy_stream_onloads_stay_as_they_are():
    pipe = tiny.build(NAME)
    with SimulatedAccelerator():
        pipe.enable_model_cpu_offload(device="cpu", memory_budget=BIG, prefetch=True)
        for _ in range(2):
            pipe(**tiny.call_kwargs(NAME, pipe=pipe))
    assert "prefetch" not in {r.kind for r in doe.transfer_ledger(pipe).records}
    assert doe.offload_status(pipe).options["prefetch"] is True


@pytest.mark.parametrize(
    "options, error, match",
    [
        (dict(prefetch="yes"), TypeError, r"`prefetch` must be True, False or None.*'yes'"),
        (dict(prefetch=True), ValueError, r"`prefetch=True` needs the residency manager.*memory_budget"),
    ],
)
def test_bad_values_raise_before_anything_changes(options, error, match):
    pipe = tiny.build(NAME)
    with pytest.raises(error, match=match):
        pipe.enable_model_cpu_offload(device="cpu", **options)
    assert not doe.offload_status(pipe).enabled
