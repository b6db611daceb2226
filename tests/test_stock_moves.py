"""Item 3 against stock diffusers itself: with both options unset, this extension moves exactly what stock's chain
of accelerate hooks moves. On CUDA when there is one; otherwise on the simulated accelerator, where accelerate's
`CpuOffload` sees its modules leave the device (on the plain CPU it cannot: every tensor says `cpu`, so stock's chain
evictions do not happen at all there). Stock's moves are what a spy on `Module.to` sees; ours are the transfer ledger's,
since on an accelerator our evictions of unchanged weights are drops by default (issue 31), which call no `.to()`:
the same evictions, at the same points, without the copy back."""

import contextlib

import pytest
import tiny_pipelines as tiny
import torch
from harness import canonical, ledger_moves, max_abs_diff
from simulated_accelerator import SimulatedAccelerator
from spy import MoveSpy, modules_of, nbytes

pytestmark = pytest.mark.plugin_only
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
EXEC = torch.device(DEVICE, 0)


def run_and_spy(name, enable, preview):
    pipe = tiny.build(name)
    spy = MoveSpy(pipe, exec_device=EXEC)
    images = []
    with spy:
        enable(pipe)
        for index in range(2):
            spy.call_index = index
            images.append(tiny.run(pipe, name, seed=0, preview=preview))
    sizes = {n: nbytes(m) for n, m in modules_of(pipe).items()}
    return [(n, d, sizes[n], c) for n, d, c in spy.moves()], images, pipe


@pytest.mark.parametrize("preview", [False, True])
@pytest.mark.parametrize("name", [n for n in tiny.PIPELINES if tiny.available(n)[0]])
def test_defaults_move_exactly_like_stock(name, preview):
    import diffusers_offload_ext as doe
    from diffusers_offload_ext import marks

    with contextlib.nullcontext() if CUDA else SimulatedAccelerator():
        stock_moves, stock_images, _ = run_and_spy(
            name, lambda p: marks.STOCK["enable_model_cpu_offload"](p, device=DEVICE), preview
        )
        doe.install()
        try:
            _, our_images, pipe = run_and_spy(name, lambda p: p.enable_model_cpu_offload(device=DEVICE), preview)
        finally:
            doe.uninstall()
    records = doe.transfer_ledger(pipe).records
    our_moves = ledger_moves(doe.transfer_ledger(pipe))
    assert any(d == "offload" and c is not None for _, d, _, c in stock_moves)  # stock's chain did evict mid-call
    assert canonical(our_moves) == canonical(stock_moves)
    assert {r.kind for r in records if r.direction == "offload"} == {"drop"}  # the same evictions, no copy back
    for ours, theirs in zip(our_images, stock_images):
        assert max_abs_diff(ours, theirs) <= 1e-3
