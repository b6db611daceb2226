"""Item 3 against stock diffusers itself. Only on an accelerator: on the CPU, accelerate's `CpuOffload` decides by
parameter device, which is always `cpu` there, so stock's chain evictions do not happen at all and there is
nothing to compare with (the reference model stands in for stock on the CPU)."""

import pytest
import tiny_pipelines as tiny
import torch
from harness import canonical, max_abs_diff
from spy import MoveSpy, modules_of, nbytes

pytestmark = [
    pytest.mark.plugin_only,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: stock's moves are only real there"),
]
CUDA = torch.device("cuda", 0)


def run_and_spy(name, enable, preview):
    pipe = tiny.build(name)
    spy = MoveSpy(pipe, exec_device=CUDA)
    images = []
    with spy:
        enable(pipe)
        for index in range(2):
            spy.call_index = index
            images.append(tiny.run(pipe, name, seed=0, preview=preview))
    sizes = {n: nbytes(m) for n, m in modules_of(pipe).items()}
    return [(n, d, sizes[n], c) for n, d, c in spy.moves()], images


@pytest.mark.parametrize("preview", [False, True])
@pytest.mark.parametrize("name", [n for n in tiny.PIPELINES if tiny.available(n)[0]])
def test_defaults_move_exactly_like_stock(name, preview):
    import diffusers_offload_ext as doe
    import diffusers_offload_ext.runtime.arming as mixin

    stock_moves, stock_images = run_and_spy(
        name, lambda p: mixin.STOCK["enable_model_cpu_offload"](p, device="cuda"), preview
    )
    doe.install()
    try:
        our_moves, our_images = run_and_spy(name, lambda p: p.enable_model_cpu_offload(device="cuda"), preview)
    finally:
        doe.uninstall()
    assert canonical(our_moves) == canonical(stock_moves)
    for ours, theirs in zip(our_images, stock_images):
        assert max_abs_diff(ours, theirs) <= 1e-3
