"""Eviction without a copy at run time: an unchanged component is only dropped from the device, and a change made
while it was there, of any kind and any dtype, is copied back. Losing a weight change is the one thing an offloader
must never do.

On the plain CPU a device "copy" is the host tensor itself, so a lost change could not show; these tests run on the
simulated accelerator, where `.to(device)` makes distinct tensors (and counts the bytes that cross).
"""

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from simulated_accelerator import SimulatedAccelerator
from torch.multiprocessing.reductions import StorageWeakRef

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: zero-copy eviction is not in the upstream patch")

import diffusers_offload_ext as doe  # noqa: E402
import toy  # noqa: E402
from diffusers_offload_ext.transfer import host_copy  # noqa: E402
from test_residency_runtime import FIXED, OFFLOADED, SIZES, build, resident_bytes  # noqa: E402

pytestmark = pytest.mark.plugin_only
HYPOTHESIS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture
def sim():
    with SimulatedAccelerator() as accelerator:
        yield accelerator


def status(pipe):
    return doe.offload_status(pipe)


def resident(pipe):
    return {n for n, c in status(pipe).components.items() if c.resident}


def state_equal(a, b):
    a, b = a.state_dict(), b.state_dict()
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def ledger_bytes(pipe):
    records = doe.transfer_ledger(pipe).records
    onloaded = sum(r.nbytes for r in records if r.direction == "onload")
    copied_back = sum(r.nbytes for r in records if r.direction == "offload" and r.kind == "copy")
    return onloaded, copied_back


# -- a device with no data ---------------------------------------------------------------------------------------------
def test_zero_copy_eviction_drops_without_copying_on_meta(installed):
    """Onload to `meta`: a device with no data. If the eviction copied back, the weights would be gone (or the copy
    would fail); only putting the kept host tensors back can restore them."""
    pipe = build()
    originals = {n: {k: v.clone() for k, v in m.state_dict().items()} for n, m in pipe.components.items() if m}
    pointers = {n: m.linear.weight.data_ptr() for n, m in pipe.components.items() if m}
    pipe.enable_model_cpu_offload(device="meta", memory_budget="1MiB")
    pipe(["text_encoder", "transformer", "vae", "controlnet"])
    assert pipe.transformer.linear.weight.device.type == "cpu"
    offloads = [r for r in doe.transfer_ledger(pipe).records if r.direction == "offload"]
    assert {r.component for r in offloads} == {"text_encoder", "transformer", "vae", "controlnet"}
    assert all(r.kind == "drop" for r in offloads)
    for name in ("text_encoder", "transformer", "vae", "controlnet"):
        module = pipe.components[name]
        assert module.linear.weight.data_ptr() == pointers[name]  # the very same host memory
        assert all(torch.equal(module.state_dict()[k], v) for k, v in originals[name].items())


def test_copying_eviction_cannot_come_back_from_meta(installed):
    """The control for the test above: with zero-copy off, the eviction copies and fails on `meta`."""
    pipe = build()
    pipe.enable_model_cpu_offload(device="meta", memory_budget="1MiB", zero_copy_eviction=False)
    with pytest.raises(NotImplementedError, match="meta"):
        pipe(["transformer"])


# -- edits made on the device --------------------------------------------------------------------------------------------
def inplace(m):
    with torch.no_grad():
        m.linear.weight.mul_(2)


def data_inplace(m):  # how PEFT's default merge() fuses a LoRA: no version counter sees it
    m.linear.weight.data += 1


def data_negated(m):  # flips every sign bit: a plain sum of the 64-bit words wraps it away
    m.linear.weight.data.neg_()


def data_replaced(m):
    m.linear.weight.data = m.linear.weight.data * 3


def parameter_replaced(m):
    m.linear.weight = torch.nn.Parameter(m.linear.weight.detach() + 1)


def parameter_added(m):
    m.register_parameter("extra", torch.nn.Parameter(torch.ones(2, device=m.linear.weight.device)))


def parameter_removed(m):
    m.linear.bias = None


def buffer_inplace(m):
    m.scale.add_(1)


def buffer_replaced(m):
    m.scale = m.scale * 2


def copied_in(m):
    with torch.no_grad():
        m.linear.weight.copy_(torch.full_like(m.linear.weight, 0.25))


def elements_swapped(m):
    with torch.no_grad():
        row = m.linear.weight.data[0].clone()
        m.linear.weight.data[0] = m.linear.weight.data[1]
        m.linear.weight.data[1] = row


def layer_added(m):  # LoRA layers injected next to a weight
    m.linear.lora = torch.nn.Linear(m.linear.in_features, 1, bias=False, device=m.linear.weight.device)
    torch.nn.init.constant_(m.linear.lora.weight, 0.5)


def dtype_changed(m):
    m.float() if m.linear.weight.dtype == torch.float64 else m.double()


EDITS = [
    inplace,
    data_inplace,
    data_negated,
    data_replaced,
    parameter_replaced,
    parameter_added,
    parameter_removed,
    buffer_inplace,
    buffer_replaced,
    copied_in,
    elements_swapped,
    layer_added,
    dtype_changed,
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("edit", EDITS, ids=lambda f: f.__name__)
def test_a_change_made_on_the_device_is_copied_back(installed, sim, edit, dtype):
    pipe = build()
    pipe.transformer.to(dtype)
    reference = copy.deepcopy(pipe.transformer)
    untouched = copy.deepcopy(pipe.vae)
    host_storage = StorageWeakRef(pipe.transformer.linear.weight.untyped_storage())
    pipe.enable_model_cpu_offload(device="cpu", memory_budget="1MiB", keep_on_device_between_generations=True)
    pipe(["transformer", "vae"])
    assert sim.where(pipe.transformer) == "device" and status(pipe).components["transformer"].host_copy
    edit(pipe.transformer)
    edit(reference)
    sim.reset_counters()
    doe.release(pipe)
    records = {r.component: r for r in doe.transfer_ledger(pipe).records if r.direction == "offload"}
    assert records["transformer"].kind == "copy" and records["vae"].kind == "drop"
    assert sim.d2h_bytes == records["transformer"].nbytes  # only the changed component crossed back
    assert host_storage.expired()  # the stale host copy was released
    assert state_equal(pipe.transformer, reference)
    assert state_equal(pipe.vae, untouched)
    assert sim.where(pipe.transformer) == "host" and sim.where(pipe.vae) == "host"


DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.bool]
DTYPES += [getattr(torch, n) for n in ("float8_e4m3fn",) if hasattr(torch, n)]


class Holder(torch.nn.Module):
    """A component whose weights may be of any dtype; running it only reads where they are."""

    def __init__(self, dtype):
        super().__init__()
        generator = torch.Generator().manual_seed(1)
        values = torch.randn(64, generator=generator)
        data = values > 0 if dtype == torch.bool else (values * 50).to(dtype)
        self.weight = torch.nn.Parameter(data, requires_grad=False)

    def forward(self, x=None):
        return torch.zeros(1, device=self.weight.device)


def sign_bits_flipped(tensor):
    words = tensor.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])
    top = tensor.element_size() * 8 - 1
    words.bitwise_xor_(1 << top if words.dtype == torch.uint8 else -(1 << top))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_sign_flipped_is_never_lost_whatever_the_dtype(installed, sim, dtype):
    pipe = toy.build()
    pipe.transformer = Holder(dtype)
    pipe.enable_model_cpu_offload(device="cpu", memory_budget="1MiB", keep_on_device_between_generations=True)
    pipe(["transformer"])
    if dtype == torch.bool:
        pipe.transformer.weight.data.logical_not_()
    else:
        sign_bits_flipped(pipe.transformer.weight.data)
    edited = pipe.transformer.weight.detach().cpu()  # a host copy of the edited weights
    doe.release(pipe)
    assert doe.transfer_ledger(pipe).records[-1].kind == "copy"
    assert torch.equal(pipe.transformer.weight.view(-1).view(torch.uint8), edited.view(-1).view(torch.uint8))


def test_version_counters_alone_would_lose_an_edit_through_data(installed, sim, monkeypatch):
    """Why the fingerprint exists: `weight.data += delta` bumps no version counter the parameter shows. Without
    the fingerprint the edit is dropped with the device copy (the failure the tests above guard)."""
    monkeypatch.setattr(host_copy, "fingerprints", lambda tensors: torch.zeros(len(tensors), dtype=torch.int64))
    pipe = build()
    before = pipe.transformer.linear.weight.detach().clone()
    pipe.enable_model_cpu_offload(device="cpu", memory_budget="1MiB", keep_on_device_between_generations=True)
    pipe(["transformer"])
    data_inplace(pipe.transformer)
    doe.release(pipe)
    assert torch.equal(pipe.transformer.linear.weight, before)  # lost
    assert doe.transfer_ledger(pipe).records[-1].kind == "drop"


def test_unfingerprintable_tensors_are_copied_back(installed, sim, monkeypatch):
    monkeypatch.setattr(host_copy, "fingerprints", lambda tensors: None)  # a tensor it cannot read
    pipe = build()
    pipe.enable_model_cpu_offload(device="cpu", memory_budget="1MiB", keep_on_device_between_generations=True)
    pipe(["transformer"])
    doe.release(pipe)
    assert doe.transfer_ledger(pipe).records[-1].kind == "copy"


@pytest.mark.parametrize("removal", ["set_to_none", "deleted"])
def test_a_tensor_removed_without_a_registration_hook_is_counted_at_the_next_onload(installed, sim, removal):
    """Setting a parameter to `None` or deleting it calls none of torch's registration hooks: the component's size is
    read again when it is loaded, so the budget and the status count what it holds now (here: the VAE without its
    bias fits beside the text encoder; with it, it did not)."""
    pipe = build()
    bias = doe.module_nbytes(pipe.vae.linear) - pipe.vae.linear.weight.numel() * pipe.vae.linear.weight.element_size()
    smaller = doe.module_nbytes(pipe.vae) - bias
    budget = FIXED + SIZES["text_encoder"] + smaller
    assert SIZES["vae"] == smaller + bias and bias > 0
    seen = []

    def probe(index, name):
        seen.append((name, resident(pipe), resident_bytes(pipe)))

    pipe.enable_model_cpu_offload(device="cpu", memory_budget=budget)
    pipe(["text_encoder", "vae"], probe=probe)
    assert "text_encoder" not in seen[-1][1]  # it did not fit beside the VAE: evicted
    if removal == "set_to_none":
        pipe.vae.linear.bias = None
    else:
        del pipe.vae.linear.bias
        pipe.vae.linear.bias = None  # a plain attribute now, for `Linear.forward`
    pipe(["text_encoder", "vae"], probe=probe)
    assert seen[-1] == ("vae", {"safety_checker", "text_encoder", "vae"}, budget)
    assert status(pipe).components["vae"].nbytes == smaller


def test_a_component_excluded_after_it_was_resident_holds_no_host_copy(installed, sim):
    pipe = build()
    host_storage = StorageWeakRef(pipe.transformer.linear.weight.untyped_storage())
    pipe.enable_model_cpu_offload(device="cpu", memory_budget="1MiB", keep_on_device_between_generations=True)
    pipe(["text_encoder", "transformer"])
    assert status(pipe).components["transformer"].host_copy and not host_storage.expired()
    pipe.enable_model_cpu_offload(exclude_from_offload=["transformer"])
    assert status(pipe).components["transformer"].role == "excluded"
    assert not status(pipe).components["transformer"].host_copy
    assert host_storage.expired()  # host memory is not held for a component that never leaves the device
    assert sim.where(pipe.transformer) == "device"


# -- random sessions ------------------------------------------------------------------------------------------------------
@st.composite
def sessions(draw):
    calls = draw(st.lists(st.lists(st.sampled_from(OFFLOADED), max_size=8), min_size=1, max_size=4))
    edits = {}
    for c, trace in enumerate(calls):
        for i in range(len(trace)):
            if draw(st.integers(0, 4)) == 0:
                edits[(c, i)] = (draw(st.sampled_from(OFFLOADED)), draw(st.sampled_from(EDITS[:-1])))
    budget = FIXED + draw(st.integers(0, sum(SIZES.values())))
    keep_between = draw(st.booleans())
    return calls, edits, budget, keep_between


@HYPOTHESIS
@given(session=sessions())
def test_random_sessions_keep_the_budget_and_lose_no_change(installed, sim, session):
    calls, edits, budget, keep_between = session
    note(f"edits {[(k, n, f.__name__) for k, (n, f) in edits.items()]}")
    pipe = build()
    references = {n: copy.deepcopy(pipe.components[n]) for n in OFFLOADED}
    problems = []
    sim.reset_counters()
    pipe.enable_model_cpu_offload(device="cpu", memory_budget=budget, keep_on_device_between_generations=keep_between)
    ledger = doe.transfer_ledger(pipe)
    seen = [len(ledger)]
    for c, trace in enumerate(calls):

        def probe(index, name, c=c):
            on_device = resident(pipe)
            if name not in on_device:
                problems.append(f"{name} ran off the device")
            size = doe.module_nbytes(pipe.components[name])  # edits may have added weights
            alone = on_device - {"safety_checker"} == {name} and size + FIXED > budget
            # Checked after each onload (edits that add weights to a resident component count from the next
            # onload on: nothing can be evicted in between).
            onloaded = len(ledger) > seen[0] and ledger.records[-1].direction == "onload"
            seen[0] = len(ledger)
            if onloaded and resident_bytes(pipe) > budget and not alone:
                problems.append(f"{resident_bytes(pipe)} bytes resident > budget {budget}")
            for other in OFFLOADED:
                if (sim.where(pipe.components[other]) == "device") != (other in on_device):
                    problems.append(f"{other}: record and placement disagree at event {index} of call {c}")
            if (c, index) in edits:
                target, edit = edits[(c, index)]
                edit(pipe.components[target])
                edit(references[target])

        pipe(trace, probe=probe)
    doe.release(pipe)
    assert not problems, problems
    for name in OFFLOADED:
        assert state_equal(pipe.components[name], references[name]), name
        assert sim.where(pipe.components[name]) == "host"
