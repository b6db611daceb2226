"""`torch.compile` under every offload option (issue 20, item 6): a transformer compiled whole (`torch.compile(module)`,
and in place with `module.compile()`) and diffusers' regional compilation (`compile_repeated_blocks()`), with the
images of the same compiled transformer without offload, and the recompilations and graph breaks our hooks add,
counted from `torch._dynamo.utils.counters` and asserted: none after the first call (no frame compiled again, no new
graph), and breaks only at the functions excluded from tracing, as many as the README's "torch.compile" paragraph says
(none by region, where the block streamer's code runs around each compiled block).

On the plain CPU with `backend="eager"` (Dynamo's tracing, guards and graph breaks; no code generation). Not on the
simulated accelerator: Dynamo traces into its torch function mode, whose tags follow tensor objects that compiled
graphs replace."""

import pytest
import torch

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: the residency options")

import diffusers_offload_ext as doe  # noqa: E402
from diffusers_offload_ext.blocks.find import block_sizes  # noqa: E402
from diffusers_offload_ext.testing import tiny  # noqa: E402
from test_quantized_matrix import OPTIONS as MATRIX  # noqa: E402

pytestmark = [pytest.mark.plugin_only, pytest.mark.usefixtures("installed")]
NAME = "flux"
STREAM = "stream"
#: The quantized matrix's options (`pin_memory="auto"` is nothing on the CPU), and a budget 0.8x the transformer.
OPTIONS = {name: MATRIX[name] for name in ("defaults", "exclude", "keep-during", "keep-between-budget", "zero-copy")}
OPTIONS[STREAM] = {"memory_budget": STREAM}
HOOK = "DeferredCpuOffload.pre_forward"  # the component hook, where Dynamo meets it (in-place compilation)
STREAMER = ("BlockStreamer.enter", "BlockStreamer.leave", "BlockStreamer._count")  # the streamed blocks' hooks


def compiled(mode, deep):
    """The tiny FLUX pipeline (`deep`: its transformer deep enough to stream) with its transformer compiled."""
    from test_block_streaming import deep_flux

    pipe = deep_flux() if deep else tiny.build(NAME)
    if mode == "whole":
        pipe.transformer = torch.compile(pipe.transformer, backend="eager")
    elif mode == "in-place":
        pipe.transformer.compile(backend="eager")
    else:
        if not hasattr(pipe.transformer, "compile_repeated_blocks"):
            pytest.skip("this diffusers has no compile_repeated_blocks() (regional compilation)")
        # fullgraph=True, as diffusers recommends it: a break inside a block would raise.
        pipe.transformer.compile_repeated_blocks(backend="eager", fullgraph=True)
    return pipe


def counts():
    """`(frames compiled, graphs, graph breaks by reason)` so far."""
    from torch._dynamo.utils import counters

    return counters["frames"]["total"], counters["stats"]["unique_graphs"], dict(counters["graph_break"])


def run_twice(pipe, options=None):
    """Two calls from a clean compile cache: `(images, counts after the first call, counts after the second)`."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    if options is not None:
        pipe.enable_model_cpu_offload(device="cpu", **options)
    images, seen = [], []
    for _ in range(2):
        images.append(tiny.run(pipe, NAME))
        seen.append(counts())
    return images, seen[0], seen[1]


_REFERENCES = {}


def reference(mode, deep):
    if (mode, deep) not in _REFERENCES:
        images, first, second = run_twice(compiled(mode, deep))
        assert first == second and not first[2]  # compiled once, in one piece per compiled region
        _REFERENCES[mode, deep] = images[0], first
    return _REFERENCES[mode, deep]


def breaks_at(reasons):
    """The functions the graph breaks of `reasons` are at (`Class.method`)."""
    found = []
    for reason in reasons:
        assert "torch.compiler.disable" in reason, reason  # never inside our hooks' code
        found += [name for name in (HOOK,) + STREAMER if name in reason]
    return sorted(found)


def cases():
    """Every option compiled whole and by region; in place (what differs there: the component hook's break), with
    the defaults and excluded (streaming in place: `tests/test_compile_streaming.py`)."""
    for mode in ("whole", "regional", "in-place"):
        for option in OPTIONS if mode != "in-place" else ("defaults", "exclude"):
            yield pytest.param(mode, option, id=f"{mode}-{option}")


@pytest.mark.parametrize("mode, option", list(cases()))
def test_a_compiled_transformer_under_every_option(mode, option):
    expected, (frames, graphs, _) = reference(mode, option == STREAM)
    pipe = compiled(mode, option == STREAM)
    options = OPTIONS[option]
    if option == STREAM:
        options = {"memory_budget": int(sum(block_sizes(pipe.transformer).values()) * 0.8)}
    try:
        images, first, second = run_twice(pipe, options)
    finally:
        torch._dynamo.reset()
    assert all(torch.equal(image, expected) for image in images)
    assert second == first  # after the first call: no recompilation, no new graph, no new break
    streamed = [r for r in doe.transfer_ledger(pipe).records if r.block is not None]
    assert bool(streamed) == (option == STREAM)
    # Dynamo traces into the hooked forward; an excluded component is hooked too (it evicts its predecessor).
    hook = [HOOK] if mode == "in-place" else []
    if option != STREAM:
        assert breaks_at(first[2]) == hook and first[:2] == (frames + len(hook), graphs)
        return
    if mode == "regional":  # the streamer's code runs around each compiled block, outside its graph
        assert breaks_at(first[2]) == [] and first[:2] == (frames, graphs)
        return
    # Compiled whole, a graph ends at each streamed or kept block's hooks (the weights arrive between blocks): the
    # transformer's one graph becomes several.
    assert set(breaks_at(first[2])) == set(hook) | set(STREAMER)
    assert first[1] > graphs
