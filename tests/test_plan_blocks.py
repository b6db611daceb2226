"""`diffusers-offload plan` models block residency (issue 11): when the largest offloaded component does not fit the
budget, its block plan and the bytes per generation of block residency, sequential, group and stock offload. The
figures are recomputed here independently: block sizes from `doe.block_sizes` of the model built on the meta device
in its dtype, the knapsack from `policies.plan_stream`, the uses from the plan's call trace."""

import json

import pytest
import torch

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: the planner")

import diffusers_offload_ext as doe  # noqa: E402
from diffusers_offload_ext import cli  # noqa: E402
from diffusers_offload_ext.models import plan  # noqa: E402
from diffusers_offload_ext.models.specs import load_spec  # noqa: E402
from diffusers_offload_ext.policies import Item, plan_stream  # noqa: E402

pytestmark = pytest.mark.plugin_only
GiB = 1 << 30


@pytest.fixture(scope="module")
def meta_transformer_blocks():
    """FLUX.1-dev's transformer built on meta from the shipped spec's config, cast to bfloat16, split into blocks."""
    import diffusers

    config = load_spec("flux-dev")["components"]["transformer"]["config"]
    with torch.device("meta"):
        model = diffusers.FluxTransformer2DModel.from_config(
            {k: v for k, v in config.items() if not k.startswith("_")}
        ).to(torch.bfloat16)
    return doe.block_sizes(model)


@pytest.mark.parametrize("vram", ["16GiB", "8GiB"])
def test_a_denoiser_larger_than_the_budget_is_planned_block_by_block(vram, meta_transformer_blocks):
    result = plan("flux-dev", vram=vram, reserve="3GiB")
    entry = result["block_residency"]
    sizes = {n: c["nbytes"] for n, c in result["components"].items()}
    room = result["vram_bytes"] - result["reserve_bytes"]
    assert entry["needed"] and entry["available"] and entry["component"] == "transformer"
    assert entry["room_bytes"] == room and entry["device_bytes"] <= room
    assert sum(meta_transformer_blocks.values()) == sizes["transformer"]
    items = [Item(name, nbytes, 1) for name, nbytes in meta_transformer_blocks.items()]
    expected = plan_stream(items, room, forced=["<rest>"])
    assert entry["blocks"] == {"resident": list(expected.kept), "streamed": list(expected.streamed)}
    assert (entry["kept_bytes"], entry["ring_bytes"]) == (expected.kept_bytes, expected.ring_bytes)
    call = result["call_trace"]
    forwards = call.count("transformer")
    assert forwards == result["steps"] == entry["forwards_per_generation"]  # FLUX.1-dev: one forward per step
    others = sum(sizes[n] for n in ("text_encoder", "text_encoder_2", "vae"))  # each runs once, outside the loop
    moved = entry["bytes_per_generation"]
    assert moved["blocks"] == others + expected.kept_bytes + forwards * expected.streamed_bytes
    assert moved["sequential"] == moved["group"] == sum(sizes[n] for n in call)
    assert moved["blocks"] < moved["sequential"]
    assert moved["stock"] == result["strategies"]["stock"]["first_generation_bytes_excluding_setup"]
    assert entry["stock_fits"] is False  # stock loads the whole transformer: its peak exceeds the card
    rate = result["bandwidth"]["h2d_bytes_per_s"]
    assert entry["seconds_per_generation_at_assumed_bandwidth"]["blocks"] == pytest.approx(moved["blocks"] / rate)
    assert "not overlapped with compute" in entry["note"]


def test_a_smaller_budget_keeps_fewer_blocks_and_streams_more():
    big = plan("flux-dev", vram="16GiB")["block_residency"]
    small = plan("flux-dev", vram="8GiB")["block_residency"]
    assert len(small["blocks"]["resident"]) < len(big["blocks"]["resident"])
    assert small["bytes_per_generation"]["blocks"] > big["bytes_per_generation"]["blocks"]


def test_nothing_streams_when_the_denoiser_fits_and_a_budget_too_small_says_why():
    fits = plan("flux-dev", vram="80GiB")["block_residency"]
    assert fits["needed"] is False and "fits in the budget" in fits["reason"]
    tiny_room = plan("flux-dev", vram="3GiB", reserve="2.5GiB")["block_residency"]
    assert tiny_room["needed"] and tiny_room["available"] is False
    assert "do not fit" in tiny_room["reason"] and "--vram" in tiny_room["reason"]


def test_the_cli_prints_block_residency_beside_sequential_group_and_stock(capsys):
    assert cli.main(["plan", "--model", "flux-dev", "--vram", "16GiB"]) == 0
    out = capsys.readouterr().out
    assert "Block residency: transformer" in out and "blocks (ours)" in out
    assert "sequential" in out and "group (block level)" in out and "stock (does not fit)" in out
    assert "not overlapped with compute" in out.replace("\n  ", " ")
    assert cli.main(["plan", "--model", "flux-dev", "--vram", "80GiB"]) == 0
    assert "Block residency" not in capsys.readouterr().out
    assert cli.main(["plan", "--model", "flux-dev", "--vram", "16GiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["block_residency"]["available"] is True


def test_the_shipped_block_counts_are_those_of_a_build_on_meta():
    """Stale data is refreshed with `python -m diffusers_offload_ext.testing.record_model_data --blocks`."""
    from diffusers_offload_ext.models.block_model import BLOCKS_FILE, block_counts
    from diffusers_offload_ext.models.errors import PlanError
    from diffusers_offload_ext.models.recorded import config_key
    from diffusers_offload_ext.models.specs import shipped_models

    with open(BLOCKS_FILE, encoding="utf-8") as f:
        shipped = json.load(f)["components"]
    from importlib.metadata import version

    from diffusers_offload_ext.models.recorded import load_recorded

    libraries = load_recorded("flux-dev")["recorded_with"]
    same_libraries = all(version(p) == libraries[p] for p in ("diffusers", "transformers"))
    compared = set()
    for model in shipped_models():
        for entry in load_spec(model)["components"].values():
            try:
                built = block_counts(entry["class"], entry.get("library"), entry["config"])
            except PlanError:  # a class this diffusers lacks (Wan before 0.33)
                continue
            recorded = shipped[config_key(entry["class"], entry["config"])]
            assert [b[1:] for b in recorded] == [b[1:] for b in built], (model, entry["class"])  # the sizes
            if same_libraries:  # module names may differ between library versions (CLIP in transformers 4 and 5)
                assert [b[0] for b in recorded] == [b[0] for b in built], (model, entry["class"])
            compared.add(entry["class"])
    assert {"FluxTransformer2DModel", "T5EncoderModel", "CLIPTextModel", "AutoencoderKL"} <= compared


def test_the_residency_benchmarks_block_column():
    """`benchmarks/residency.py`'s modelled block residency: within the budget by construction, everything kept once
    when everything fits, and fewer bytes than the whole-component optimum where the denoiser fits but not beside
    the text encoder (FLUX.1-dev at 24 GiB)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "residency.py"
    spec = importlib.util.spec_from_file_location("residency_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    sizes = bench.sizes_of("flux")
    from diffusers_offload_ext.models import load_model

    call = load_model("flux-dev").call_trace(28)
    items = bench.block_items("flux", sizes, call)
    assert sum(i.nbytes for i in items) == pytest.approx(sum(sizes.values()), abs=len(items))
    assert bench.block_optimum(items, 80 * GiB, 10) == sum(i.nbytes for i in items)  # all kept, copied once
    plan = plan_stream(items, 16 * GiB)
    assert plan.device_bytes <= 16 * GiB
    trace = bench.workload_trace(call, 10)
    row = bench.evaluate("flux", trace, 10, 24 * GiB, sizes)
    assert row["blocks"] < row["optimum"]
