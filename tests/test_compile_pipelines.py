"""A denoiser compiled whole (`pipe.unet = torch.compile(pipe.unet)`, `pipe.transformer = torch.compile(...)`) in the
tiny SD 1.5, SDXL and Wan 2.1 pipelines, under every option (issue 33, fault 3; FLUX: `tests/test_compile.py`, the
same options): the images of the same compiled
pipeline without offload, nothing compiled again after the first call, and, where the denoiser does not stream, no
graph break and as many graphs as without offload (stock runs it in one graph; our hooks and the book's registration
hooks add nothing to it, though a UNet's mid block builds a `ModuleList` inside the compiled forward). Streaming (a
budget below the denoiser), the block hooks break the graph between blocks (`tests/test_compile.py` counts them).

On the plain CPU with `backend="eager"`, as `tests/test_compile.py` (which also covers compilation in place and by
region, on FLUX)."""

import pytest
import torch

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: the residency options")

from diffusers_offload_ext.blocks.find import block_sizes  # noqa: E402
from diffusers_offload_ext.testing import tiny  # noqa: E402
from test_compile import breaks_at, counts  # noqa: E402

pytestmark = [pytest.mark.plugin_only, pytest.mark.usefixtures("installed")]
NAMES = ("sd15", "sdxl", "wan21")
STREAM = "stream"
OPTIONS = {
    "defaults": {},
    "exclude": "the denoiser",
    "keep-during": {"keep_on_device_during_generation": True},
    "keep-between-budget": {"keep_on_device_between_generations": True, "memory_budget": "1GiB"},
    "zero-copy": {"zero_copy_eviction": True},
    STREAM: "0.8 of the denoiser",
}


def denoiser(pipe) -> str:
    return "unet" if hasattr(pipe, "unet") else "transformer"


def compiled(name):
    ok, why = tiny.available(name)
    if not ok:
        pytest.skip(why)
    pipe = tiny.build(name)
    setattr(pipe, denoiser(pipe), torch.compile(getattr(pipe, denoiser(pipe)), backend="eager"))
    return pipe


def options_for(pipe, option):
    model = getattr(pipe, denoiser(pipe))
    if option == "exclude":
        return {"exclude_from_offload": [denoiser(pipe)]}
    if option == STREAM:
        return {"memory_budget": int(sum(block_sizes(model._orig_mod).values()) * 0.8)}
    return OPTIONS[option]


def run_twice(pipe, name, options=None):
    """Two calls from a clean compile cache: `(images, counts after the first call, counts after the second)`."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    if options is not None:
        pipe.enable_model_cpu_offload(device="cpu", **options)
    images, seen = [], []
    try:
        for _ in range(2):
            images.append(tiny.run(pipe, name))
            seen.append(counts())
    finally:
        torch._dynamo.reset()
    return images, seen[0], seen[1]


_REFERENCES = {}


def reference(name):
    if name not in _REFERENCES:
        images, first, second = run_twice(compiled(name), name)
        assert first == second and not first[2]  # compiled once, in one piece
        _REFERENCES[name] = images[0], first
    return _REFERENCES[name]


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("name", NAMES)
def test_a_denoiser_compiled_whole_runs_under_every_option(name, option):
    expected, (frames, graphs, _) = reference(name)
    pipe = compiled(name)
    images, first, second = run_twice(pipe, name, options_for(pipe, option))
    assert all(torch.equal(image, expected) for image in images)
    assert second == first  # after the first call: no recompilation, no new graph, no new break
    if option != STREAM:
        assert first == (frames, graphs, {}), first  # no break: the graphs of no offload
    else:
        assert set(breaks_at(first[2])) <= {"BlockStreamer.enter", "BlockStreamer.leave", "BlockStreamer._count"}
