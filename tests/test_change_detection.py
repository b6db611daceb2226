"""Change detection for eviction without a copy: no edit of any dtype may slip through the content fingerprint or
the host copy's checks (`transfer/fingerprint.py`, `transfer/host_copy.py`)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: zero-copy eviction is not in the upstream patch")

from diffusers_offload_ext.transfer.fingerprint import fingerprint, fingerprintable, fingerprints  # noqa: E402
from diffusers_offload_ext.transfer.host_copy import HostCopy  # noqa: E402

pytestmark = pytest.mark.plugin_only

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.bool, torch.int64]
DTYPES += [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]
WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def sample(dtype, n=64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(n, generator=generator) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(-100, 100, (n,), generator=generator).to(dtype)
    return torch.randn(n, generator=generator).to(dtype)


def bits(tensor):
    return tensor.contiguous().view(WORDS[tensor.element_size()])


def flip_bit(tensor, index, bit):
    words = bits(tensor)
    width = tensor.element_size() * 8
    flipped = (words[index].item() & ((1 << width) - 1)) ^ (1 << bit)
    if flipped >= 1 << (width - 1) and words.dtype != torch.uint8:
        flipped -= 1 << width
    words[index] = flipped


def edits(dtype):
    """(label, edit in place) pairs; each changes at least one bit of the tensor it is given."""

    def sign_flip(t):
        words = bits(t)
        top = words.element_size() * 8 - 1
        if words.dtype == torch.uint8:
            words.bitwise_xor_(1 << top)
        else:
            words.bitwise_xor_(-(1 << top))

    def swap(t):
        a, b = t[3].clone(), t[11].clone()
        t[3], t[11] = b, a

    def data_edit(t):
        t.data[5:9] = (
            torch.logical_not(t.data[5:9]) if t.dtype == torch.bool else (t.data[5:9].float() + 1).to(t.dtype)
        )

    def copy_in(t):
        t.copy_(sample(t.dtype, t.numel(), seed=99))

    return [("sign flip of every element", sign_flip), ("swap", swap), (".data edit", data_edit), ("copy_", copy_in)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_single_bit_flip_changes_the_fingerprint(dtype):
    tensor = sample(dtype)
    before = fingerprint(tensor)
    for bit in range(tensor.element_size() * 8):
        for index in (0, 17, tensor.numel() - 1):
            edited = tensor.clone()
            flip_bit(edited, index, bit)
            if torch.equal(bits(edited), bits(tensor)):
                continue  # bool: only bit 0 is a value
            assert not torch.equal(fingerprint(edited), before), (dtype, index, bit)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_structured_edits_change_the_fingerprint(dtype):
    for label, edit in edits(dtype):
        tensor = sample(dtype)
        before = fingerprint(tensor)
        edited = tensor.clone()
        edit(edited)
        if torch.equal(bits(edited), bits(tensor)):
            continue  # the edit happened to rewrite the same bits
        assert not torch.equal(fingerprint(edited), before), (dtype, label)


def test_sign_flips_that_wrap_a_plain_sum_are_caught():
    """The fault that motivated the fingerprint: negating float64 weights with an even element count flips every
    top bit, which a sum of the 64-bit words (weighted or not) wraps away."""
    tensor = torch.randn(1024, dtype=torch.float64)
    words = tensor.view(torch.int64)
    assert int(words.sum()) == int((-tensor).view(torch.int64).sum())  # the old check could not see it
    assert not torch.equal(fingerprint(tensor), fingerprint(-tensor))


def test_two_sign_flips_that_wrap_a_weighted_sum_are_caught():
    """Why the fingerprint is not the cheaper weighted sum of the words (`benchmarks/fingerprint_cost.py`): negating
    two bfloat16 elements four apart flips the top bit of two words, which any sum modulo 2**64 with odd weights
    wraps away."""
    tensor = torch.randn(4096).to(torch.bfloat16)
    edited = tensor.clone()
    edited[[3, 7]] = -edited[[3, 7]]
    weights = torch.arange(1, 1025, dtype=torch.int64) * 0x9E3779B9 | 1
    assert int(torch.dot(tensor.view(torch.int64), weights)) == int(torch.dot(edited.view(torch.int64), weights))
    assert not torch.equal(fingerprint(tensor), fingerprint(edited))


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    n=st.integers(1, 300),
    seed=st.integers(0, 2**31 - 1),
    index=st.integers(0, 10**6),
    bit=st.integers(0, 63),
)
def test_random_bit_flips(dtype, n, seed, index, bit):
    tensor = sample(dtype, n, seed)
    edited = tensor.clone()
    flip_bit(edited, index % n, bit % (tensor.element_size() * 8))
    if not torch.equal(bits(edited), bits(tensor)):
        assert not torch.equal(fingerprint(edited), fingerprint(tensor))


def test_equal_content_gives_equal_fingerprints_and_unreadable_tensors_are_refused():
    tensor = torch.randn(100)
    assert torch.equal(fingerprint(tensor), fingerprint(tensor.clone()))
    assert fingerprint(torch.empty(0)) is not None
    assert not fingerprintable(torch.randn(4).to_sparse())
    assert fingerprint(torch.randn(4).to_sparse()) is None
    assert not fingerprintable(torch.empty(4, device="meta"))


class Subclass(torch.Tensor):
    pass


def test_a_tensor_subclass_is_never_fingerprinted():
    assert not fingerprintable(torch.randn(4).as_subclass(Subclass))


def module(dtype):
    layer = torch.nn.Linear(4, 4)
    layer.weight = torch.nn.Parameter(sample(dtype, 16, seed=3).reshape(4, 4), requires_grad=False)
    layer.register_buffer("scale", sample(dtype, 4, seed=4))
    return layer


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_host_copy_sees_every_edit(dtype):
    def check(edit):
        layer = module(dtype)
        copy = HostCopy(layer)
        copy.seal(layer)
        assert copy.unchanged(layer)
        edit(layer)
        return copy.unchanged(layer)

    assert not check(lambda m: flip_bit(m.weight.data.view(-1), 5, 0))
    assert not check(lambda m: edits(dtype)[0][1](m.scale.data))
    assert not check(lambda m: setattr(m.weight, "data", m.weight.data.clone()))  # replaced tensor
    assert not check(lambda m: m.register_buffer("scale", m.scale.clone()))
    assert not check(lambda m: m.add_module("extra", torch.nn.Linear(1, 1)))  # structure
    assert check(lambda m: None)


def test_host_copy_refuses_what_it_cannot_read():
    layer = module(torch.float32)
    layer.register_buffer("sparse", torch.randn(4).to_sparse())
    copy = HostCopy(layer)
    copy.seal(layer)
    assert not copy.unchanged(layer)  # evict with a copy


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fingerprinting_leaves_the_tensor_untouched(dtype):
    tensor = sample(dtype, 1000)
    before = tensor.clone()
    first, second = fingerprint(tensor), fingerprint(tensor)
    assert torch.equal(bits(tensor), bits(before))
    assert torch.equal(first, second)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.bool], ids=str)
def test_every_bit_flip_in_a_batch_of_small_tensors_changes_the_vector(dtype):
    """Small tensors are fingerprinted together (a few kernels for all): a flip in any of them, at any bit, an odd
    byte count (the tail read byte by byte) and a view whose bytes are not 8-aligned (read byte by byte) included."""
    base = sample(dtype, 67, seed=3)
    tensors = [sample(dtype, 13, seed=1), base[1:], sample(dtype, 40, seed=2)]  # base[1:]: unaligned, odd length
    before = fingerprints(tensors)
    for which, tensor in enumerate(tensors):
        for index in range(tensor.numel()):
            for bit in range(tensor.element_size() * 8):
                edited = [t.clone() for t in tensors]
                flip_bit(edited[which], index, bit)
                assert not torch.equal(fingerprints(edited), before), (which, index, bit)


def test_batched_fingerprints_see_contents_moved_between_tensors():
    a, b = sample(torch.float32, 16, seed=1), sample(torch.float32, 16, seed=2)
    assert not torch.equal(fingerprints([a, b]), fingerprints([b, a]))
    large = sample(torch.float32, (1 << 20) // 4 + 1, seed=4)  # over the small-tensor threshold: folded alone
    assert torch.equal(fingerprints([large, a]), torch.cat([fingerprint(large), fingerprint(a)]))  # folded alone
    edited = large.clone()
    edited[-1] += 1
    assert not torch.equal(fingerprints([large, a]), fingerprints([edited, a]))
    assert fingerprints([a, torch.randn(3).to_sparse()]) is None


class WeightReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts, over the operations run inside it, the bytes read from the storages of `weights` by operations that
    are not views, and the bytes of every storage they allocate."""

    def __init__(self, weights):
        super().__init__()
        self.weights = {t.untyped_storage().data_ptr() for t in weights}
        self.read, self.allocated, self.known = 0, 0, set(self.weights)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not func.is_view:
            for t in inputs:
                if t.untyped_storage().data_ptr() in self.weights:
                    self.read += t.numel() * t.element_size()
        self.known |= {t.untyped_storage().data_ptr() for t in inputs}
        out = func(*args, **kwargs)
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.known:
                self.known.add(t.untyped_storage().data_ptr())
                self.allocated += t.untyped_storage().nbytes()
        return out


def test_a_fingerprint_reads_each_weight_once_and_copies_none_of_them():
    """Issue 22, item 3: the weights are read once, in place (no clone, no copy of them made first), whatever their
    dtype; what it allocates is bounded by its scratch, not by the weights' size (25 MB here)."""
    weights = [torch.randn(1 << 20).to(dtype) for dtype in (torch.bfloat16, torch.float32) for _ in range(4)]
    weights += [torch.randn(1000).to(torch.float16) for _ in range(5)]  # small ones, packed once into one buffer
    fingerprints(weights)  # made once per device: the positions' words
    nbytes = sum(t.numel() * t.element_size() for t in weights)
    with WeightReads(weights) as spy:
        fingerprints(weights)
    assert spy.read == nbytes
    assert spy.allocated < nbytes // 4


# -- issue 31: one fused pass per eviction, one host read --------------------------------------------------------------
class _Counting(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the operations dispatched, and the host reads of device values among them (`_local_scalar_dense`)."""

    def __init__(self):
        super().__init__()
        self.ops, self.reads = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def _release_counted(extra_words):
    """A resident sd15 pipeline on the simulated accelerator, its unet carrying `extra_words` more int64 words;
    `(ops, host reads, fused launches, evicted components)` while `doe.release` drops them all."""
    import diffusers_offload_ext as doe
    from diffusers_offload_ext.testing import tiny
    from diffusers_offload_ext.testing.fused import fake_fused_fingerprints
    from diffusers_offload_ext.testing.simulated_accelerator import SimulatedAccelerator

    pipe = tiny.build("sd15")
    pipe.unet.register_buffer("extra", torch.arange(extra_words, dtype=torch.int64))
    doe.install()
    try:
        with SimulatedAccelerator(), fake_fused_fingerprints() as launches:
            pipe.enable_model_cpu_offload(device="cpu", keep_on_device_between_generations=True)
            tiny.run(pipe, "sd15")
            before, counting = launches.count, _Counting()
            with counting:
                doe.release(pipe)
            evicted = [r for r in doe.transfer_ledger(pipe).records if r.call_index is None and r.kind == "drop"]
    finally:
        doe.uninstall()
    return counting.ops, counting.reads, launches.count - before, len(evicted)


def test_an_eviction_fingerprints_in_one_fused_pass_and_reads_the_host_once():
    """Whatever a component's bytes, its eviction's content check is one fused kernel and one read of one device flag
    (before: about ten kernels per 2 MiB chunk, 4,900 per GB), and nothing else it runs grows with the bytes."""
    small = _release_counted(2 * (1 << 18))  # 4 MiB more: two chunks
    large = _release_counted(14 * (1 << 18))  # 28 MiB more: fourteen chunks
    ops, reads, launches, evicted = small
    assert evicted == 3 and reads == evicted and launches == evicted
    assert large == small  # the same operations for twelve more chunks


def test_a_fused_kernel_that_disagrees_with_the_eager_folding_is_never_trusted(caplog):
    from harness import diffusers_logs

    from diffusers_offload_ext.testing.fused import fake_fused_fingerprints

    tensors = [sample(torch.float32, n=3000, seed=s) for s in range(3)]
    eager = fingerprints(tensors)
    with diffusers_logs(caplog, "INFO"), fake_fused_fingerprints(wrong=True) as launches:
        found = fingerprints(tensors)
    assert torch.equal(found, eager) and launches.count == 1  # the probe only
    assert any("fused fingerprint is off" in r.getMessage() for r in caplog.records)
