"""The fused fingerprint on CUDA (`transfer/fused_fingerprint.py`, one Triton kernel per fingerprint): the same sums
as the eager folding, bit for bit, and a bounded number of kernels whatever the bytes. Runs where there is a CUDA
device and Triton (the GPU check runs it: `tools/gpu_check.sh`); elsewhere it is skipped, and the suite drives the
same wiring through a fake kernel (`tests/test_change_detection.py`)."""

import pytest
import torch

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: change detection")

from diffusers_offload_ext.transfer import fingerprint  # noqa: E402

pytestmark = [
    pytest.mark.plugin_only,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the GPU check runs it)"),
]


@pytest.fixture(scope="module")
def device():
    pytest.importorskip("triton", reason="no Triton: the eager folding runs on CUDA")
    return torch.device("cuda", torch.cuda.current_device())


def test_the_fused_kernel_is_trusted_and_folds_exactly_as_the_eager_folding(device):
    engine = fingerprint._engine(device)
    assert engine is not None, "the probe refused the fused kernel on this device (see the info line)"
    generator = torch.Generator().manual_seed(3)
    for count in (1, 77, fingerprint.CHUNK - 1, fingerprint.CHUNK, 3 * fingerprint.CHUNK + 5):
        words = torch.randint(-(2**62), 2**62, (count,), dtype=torch.int64, generator=generator).to(device)
        parts = [words, words[: count // 2 + 1]]
        positions = fingerprint._position_words(device)
        assert torch.equal(engine(parts, positions), fingerprint._fold_eager(parts, positions))


def test_a_fingerprint_is_a_bounded_number_of_kernels_and_sees_one_flipped_bit(device):
    tensors = [torch.randn(3072, 3072, dtype=torch.bfloat16, device=device) for _ in range(56)]  # 1 GiB
    tensors += [torch.randn(3072, dtype=torch.bfloat16, device=device) for _ in range(100)]
    before = fingerprint.fingerprints(tensors)
    torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        again = fingerprint.fingerprints(tensors)
        torch.cuda.synchronize(device)
    kernels = [e for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) <= 12, [e.name for e in kernels]  # was about 10 per 2 MiB chunk: 5,000 per GiB
    assert bool(fingerprint.same(before, again))
    with torch.no_grad():
        tensors[17].view(torch.int16).view(-1)[12345] ^= 1 << 9
    assert not bool(fingerprint.same(before, fingerprint.fingerprints(tensors)))
