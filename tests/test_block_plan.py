"""`diffusers-offload plan` models block residency (issue 11). The figures are recomputed here independently: block
sizes from `doe.block_sizes` of the components built on the meta device in their dtype, stream plans from
`policies.choose_blocks`, uses and order from the plan's own call trace, and the bytes each strategy moves walked by
hand; the static block optimum is checked against brute force."""

import itertools
import json

import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: the planner")

import diffusers_offload_ext as doe  # noqa: E402
from diffusers_offload_ext import cli  # noqa: E402
from diffusers_offload_ext.blocks.find import REST  # noqa: E402
from diffusers_offload_ext.constants import END  # noqa: E402
from diffusers_offload_ext.models import load_model, plan  # noqa: E402
from diffusers_offload_ext.models.block_compare import global_plan  # noqa: E402
from diffusers_offload_ext.models.block_model import BlockPlans  # noqa: E402
from diffusers_offload_ext.models.specs import load_spec  # noqa: E402
from diffusers_offload_ext.models.strategies import all_strategies  # noqa: E402
from diffusers_offload_ext.blocks.choice import Item, least_room, choose_blocks  # noqa: E402

pytestmark = pytest.mark.plugin_only
GiB = 1 << 30


def meta_blocks(model: str, name: str, dtype=torch.bfloat16) -> dict:
    """`doe.block_sizes` of component `name` of shipped `model`, built on meta from its spec's config, in `dtype`."""
    import diffusers
    import transformers

    entry = load_spec(model)["components"][name]
    config = {k: v for k, v in entry["config"].items() if not k.startswith("_")}
    with torch.device("meta"):
        if entry.get("library") == "transformers":
            cls = getattr(transformers, entry["class"])
            module = cls(cls.config_class(**config))
        else:
            module = getattr(diffusers, entry["class"]).from_config(config)
    return doe.block_sizes(module.to(dtype))


@pytest.fixture(scope="module")
def flux_blocks():
    return {name: meta_blocks("flux-dev", name) for name in load_spec("flux-dev")["components"]}


def streams(blocks: dict, room: int):
    """The runtime's stream plan of one component within `room`: every block once per forward, its rest kept."""
    return choose_blocks([Item(n, b, 1) for n, b in blocks.items()], room, forced=[REST])


# -- the budget's streams ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("vram", ["16GiB", "8GiB"])
def test_a_denoiser_larger_than_the_budget_streams_as_choose_blocks_says(vram, flux_blocks):
    result = plan("flux-dev", vram=vram, reserve="3GiB")
    entry = result["block_residency"]
    sizes = {n: c["nbytes"] for n, c in result["components"].items()}
    room = result["vram_bytes"] - result["reserve_bytes"]  # 13 and 5 GiB: the budget, already whole tenths of a GiB
    assert entry["needed"] and entry["room_bytes"] == entry["budget_bytes"] == room
    assert {n: sum(b.values()) for n, b in flux_blocks.items()} == sizes
    expected = streams(flux_blocks["transformer"], room)
    stream = entry["streaming"]["transformer"]
    assert stream["blocks"] == {"resident": list(expected.kept), "streamed": list(expected.streamed)}
    assert (stream["kept_bytes"], stream["ring_bytes"]) == (expected.kept_bytes, expected.ring_bytes)
    assert stream["device_bytes"] == expected.device_bytes <= room
    assert stream["streamed_bytes_per_forward"] == expected.streamed_bytes
    # Each generation: the text encoders (whole where they fit, else streamed once), then the transformer streams
    # (everything else evicted: its kept blocks once, a pass of the others per forward), then the VAE again.
    call = result["call_trace"]
    assert call == ["text_encoder", "text_encoder_2"] + ["transformer"] * 28 + ["vae"]
    t5 = sizes["text_encoder_2"]
    if t5 > room:  # 8 GiB: T5 streams too, once
        t5 = streams(flux_blocks["text_encoder_2"], room)
        assert entry["streaming"]["text_encoder_2"]["kept_bytes"] == t5.kept_bytes
        t5 = t5.kept_bytes + t5.streamed_bytes
    per_generation = sizes["text_encoder"] + t5 + expected.kept_bytes + 28 * expected.streamed_bytes + sizes["vae"]
    budget = entry["rows"]["budget"]
    # Never more than the schedule walked here (the transformer streaming alone, T5 evicting all its kept blocks);
    # from the second generation on T5 evicts only those it needs room for, not all of them (issue 30).
    assert budget["steady_generation_bytes"] < budget["first_generation_bytes"] <= per_generation
    residency = result["strategies"]["residency"]
    assert residency["first_generation_bytes_excluding_setup"] == budget["first_generation_bytes"]
    assert residency["peak_bytes"] <= room and budget["fits"] is True
    assert result["recommended"]["strategy"] == "residency"  # the only strategy within the card
    rows = entry["rows"]
    assert (
        rows["sequential"]["first_generation_bytes"]
        == rows["group"]["first_generation_bytes"]
        == sum(sizes[n] for n in call)
    )
    assert rows["stock"]["first_generation_bytes"] == 2 * sum(sizes.values()) and rows["stock"]["fits"] is False
    assert per_generation < rows["sequential"]["first_generation_bytes"]


def test_every_expert_of_wan_2_2_streams_with_its_own_kept_blocks():
    """Wan 2.2 on a 16 GiB card: both 26.6 GiB experts stream, each with its own kept blocks once per generation."""
    import diffusers

    if not hasattr(diffusers, "WanTransformer3DModel"):  # the plan needs no Wan class; this check builds one on meta
        pytest.skip("this diffusers has no WanTransformer3DModel to build the expected blocks from (before 0.33)")
    result = plan("wan2.2-t2v-a14b", vram="16GiB", generations=3, reserve="3GiB")
    entry = result["block_residency"]
    sizes = {n: c["nbytes"] for n, c in result["components"].items()}
    assert set(entry["streaming"]) == {"transformer", "transformer_2"}
    expected = streams(meta_blocks("wan2.2-t2v-a14b", "transformer"), entry["room_bytes"])
    call = result["call_trace"]
    forwards = call.count("transformer") + call.count("transformer_2")
    per_generation = sizes["text_encoder"] + 2 * expected.kept_bytes + forwards * expected.streamed_bytes
    per_generation += sizes["vae"]
    # Each expert keeps at least what it keeps streaming alone (more where the other's room is free: issue 30).
    assert entry["rows"]["budget"]["first_generation_bytes"] <= per_generation
    assert entry["rows"]["budget"]["steady_generation_bytes"] <= per_generation


def test_a_preview_between_steps_no_longer_reloads_the_kept_blocks_at_every_step(flux_blocks):
    """The cliff of issue 30: with a VAE preview decoded between steps, the transformer streaming in the room left,
    the VAE's room was made by evicting the transformer (its kept blocks came back at every step). Now the VAE takes
    its ring's room and a few blocks: far less than the old schedule, walked here by hand."""
    result = plan("flux-dev", vram="16GiB", steps=4, preview=True, generations=1)
    sizes = {n: c["nbytes"] for n, c in result["components"].items()}
    plan_ = streams(flux_blocks["transformer"], result["block_residency"]["room_bytes"])
    moved, on_device, streaming = 0, set(), False
    for name in result["call_trace"]:  # the old schedule: anything else that runs stops the transformer's stream
        if name == "transformer":
            moved += (0 if streaming else plan_.kept_bytes) + plan_.streamed_bytes
            on_device, streaming = set(), True
        elif name not in on_device:
            moved += sizes[name]
            on_device.add(name)
            streaming = False
    assert result["call_trace"].count("vae") == 5
    now = result["block_residency"]["rows"]["budget"]["first_generation_bytes"]
    assert now < moved - 2 * plan_.kept_bytes  # at least two steps' kept blocks not copied again
    assert result["block_residency"]["rows"]["budget"]["steady_generation_bytes"] is None  # one generation


def test_the_26_gib_case_streams_t5_beside_the_resident_transformer(flux_blocks):
    """FLUX.1-dev under a 26 GiB budget: the transformer fits, but not beside T5. From the third generation on, T5
    streams once beside it and the transformer never moves; with `keep_on_device_between_generations=True` T5's
    stream stays between generations too (issue 22, second phase): only its streamed blocks cross, once per
    generation, not the whole T5 (as before), nor T5 and the transformer (whole components)."""
    result = plan("flux-dev", vram="26GiB", reserve="0", generations=6)
    sizes = {n: c["nbytes"] for n, c in result["components"].items()}
    budget = result["block_residency"]["rows"]["budget"]
    room = 26 * GiB - sum(sizes[n] for n in ("transformer", "text_encoder", "vae"))  # what the others leave T5
    t5 = streams(flux_blocks["text_encoder_2"], room)
    assert 0 < t5.kept_bytes and t5.device_bytes <= room < sizes["text_encoder_2"]
    # At most T5's streamed blocks alone (its kept set chosen exactly within the room, whose ring may differ).
    assert 0 < budget["steady_generation_bytes"] <= t5.streamed_bytes < sizes["text_encoder_2"]
    assert result["strategies"]["residency"]["peak_bytes"] <= 26 * GiB
    # On a 16 GiB card the transformer's stream takes the whole room: T5 evicts it at each generation's start (with
    # no reserve it is still on the device at the end of each, the VAE fitting beside it), so its kept blocks cross
    # at every generation.
    for reserve in ("3GiB", "0"):
        stream = plan("flux-dev", vram="16GiB", reserve=reserve)["block_residency"]["streaming"]["transformer"]
        assert stream["kept_between_generations"] is False
    loaded = load_model("flux-dev")
    whole = all_strategies(loaded.layout, loaded.sizes, loaded.denoisers, 26 * GiB)["residency"]
    replayed = doe.replay_trace(whole.policy, (result["call_trace"] + [END]) * 6, loaded.sizes, zero_copy=True)
    assert (
        replayed.per_call[-1] == sizes["text_encoder_2"] + sizes["transformer"]
    )  # whole components: both, every call


@pytest.mark.parametrize(
    "model, vram, preview",
    [("flux-dev", "29GiB", False), ("sd3.5-large", "20GiB", True), ("wan2.1-t2v-14b", "32GiB", False)],
)
def test_block_residency_never_moves_more_than_whole_component_residency_once_calls_repeat(model, vram, preview):
    """Where the denoiser fits the budget, streaming changes nothing but what it saves (the steady generation)."""
    result = plan(model, vram=vram, reserve="0", preview=preview, generations=8)
    budget = result["strategies"]["residency"]["budget_bytes"]
    loaded = load_model(model)
    assert max(loaded.sizes[d] for d in loaded.denoisers) <= budget
    whole = all_strategies(loaded.layout, loaded.sizes, loaded.denoisers, budget)["residency"]
    replayed = doe.replay_trace(whole.policy, (result["call_trace"] + [END]) * 8, loaded.sizes, zero_copy=True)
    steady = result["block_residency"]["rows"]["budget"]["steady_generation_bytes"]
    period = result["strategies"]["residency"]["replay"]["period"] or 1
    assert steady <= sum(replayed.per_call[-period:]) / period


def deep_flux():
    """The tiny FLUX pipeline with a transformer of 3 double and 4 single blocks, enough to stream."""
    import diffusers

    from diffusers_offload_ext.testing import tiny

    pipe = tiny.build("flux")
    config = dict(pipe.transformer.config, num_layers=3, num_single_layers=4)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        pipe.transformer = diffusers.FluxTransformer2DModel.from_config(config).eval()
    return pipe


@pytest.mark.parametrize("share", [1.0, 0.75])
def test_the_plan_replay_predicts_the_runtime_ledger_of_a_streaming_transformer(share):
    """The runtime on the simulated accelerator, its ledger per call, against the planner's replay of the same calls
    with the same sizes: equal but for the ring's 256-byte alignment of each tensor, which the planner leaves out."""
    from simulated_accelerator import SimulatedAccelerator

    from diffusers_offload_ext.models.block_model import BlockPlans
    from diffusers_offload_ext.models.generations import replay_generations
    from diffusers_offload_ext.models.strategies import residency_strategy
    from diffusers_offload_ext.testing import tiny

    pipe = deep_flux()
    modules = {n: m for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    sizes = {n: doe.module_nbytes(m) for n, m in modules.items()}
    budget = int(sizes["transformer"] * share) - 1
    ours = type("Offload", (doe.OffloadMixin, type(pipe)), {})(**pipe.components)
    ours.set_progress_bar_config(disable=True)
    with SimulatedAccelerator():
        ours.enable_model_cpu_offload(device="cpu", memory_budget=budget, keep_on_device_between_generations=True)
        for _ in range(3):
            tiny.run(ours, "flux")
        calls = [list(call) for call in doe.offload_status(ours).recent_calls]
        doe.release(ours)
    ledger = doe.transfer_ledger(ours)
    assert "transformer" in {r.component for r in ledger.records if r.block is not None}
    layout = doe.PipelineLayout.from_pipeline(ours)
    plans = BlockPlans.of({n: doe.block_sizes(m) for n, m in modules.items()})
    moved = replay_generations(residency_strategy(layout, sizes, budget).policy, calls[-1], sizes, 3,
                               zero_copy=True, plans=plans)  # fmt: skip
    assert all(call == calls[-1] for call in calls) and calls[-1].count("transformer") == 2
    for index, predicted in enumerate(moved.calls):
        measured = ledger.copied_bytes(call_index=index)
        assert predicted.nbytes == pytest.approx(measured, rel=0.01), index
    assert moved.passes[0]["transformer"][0] == 2  # one pass per forward


def test_nothing_streams_when_everything_fits_and_a_budget_too_small_says_why(flux_blocks):
    from diffusers_offload_ext.units import format_size

    fits = plan("flux-dev", vram="80GiB")["block_residency"]
    assert fits["needed"] is False and "fits the budget together" in fits["reason"]
    small = plan("flux-dev", vram="3GiB", reserve="2.5GiB")
    entry = small["block_residency"]
    stream = entry["streaming"]["transformer"]
    least = least_room([Item(n, b, 1) for n, b in flux_blocks["transformer"].items()], forced=[REST])
    assert entry["room_bytes"] < least and f"needs at least {format_size(least)}" in stream["reason"]
    assert stream["available"] is False and "do not fit" in stream["reason"] and "--vram" in stream["reason"]
    assert entry["rows"]["budget"]["fits"] is False  # the runtime loads it alone, over the budget
    assert small["strategies"]["residency"]["recommendable"] is False
    assert any("cannot stream its blocks" in note for note in small["notes"])


# -- seconds -------------------------------------------------------------------------------------------------------
def test_seconds_use_each_strategy_s_bandwidth_and_hide_streamed_copies_behind_compute_up_to_it(flux_blocks):
    room = 13 * GiB
    expected = streams(flux_blocks["transformer"], room)
    sizes = {n: sum(b.values()) for n, b in flux_blocks.items()}
    others = sizes["text_encoder"] + sizes["text_encoder_2"] + sizes["vae"]
    pinned, pageable = 20e9, 10e9
    options = dict(
        vram="16GiB",
        pinned_bandwidth="20GB/s",
        h2d_bandwidth="10GB/s",
        d2h_bandwidth="5GB/s",
        generations=2,
        reserve="3GiB",
    )
    copies = plan("flux-dev", **options)["block_residency"]
    rows = copies["rows"]
    serial = others + expected.kept_bytes  # the first generation (the steady ones evict fewer kept blocks)
    assert rows["budget_pinned"]["seconds_first"] == pytest.approx((serial + 28 * expected.streamed_bytes) / pinned)
    # The budget as recommended (no pin_memory, no prefetch): the same bytes, pageable, none hidden.
    assert rows["budget"]["seconds_first"] == pytest.approx((serial + 28 * expected.streamed_bytes) / pageable)
    assert rows["sequential"]["seconds_steady"] == pytest.approx(
        rows["sequential"]["steady_generation_bytes"] / pageable
    )
    assert rows["group"]["seconds_steady"] == pytest.approx(rows["group"]["steady_generation_bytes"] / pinned)
    total = sum(sizes.values())  # stock: every component up (pageable) and back (device-to-host) once
    assert rows["stock"]["seconds_steady"] == pytest.approx(total / pageable + total / 5e9)
    assert "copies alone" in copies["assumptions"]["overlap"] and copies["assumptions"]["step_seconds"] is None
    for step in (0.01, 10.0):  # copies longer than compute, then hidden behind it
        timed = plan("flux-dev", step_seconds=step, **options)["block_residency"]
        rows = timed["rows"]
        assert rows["budget_pinned"]["seconds_first"] == pytest.approx(
            28 * step + serial / pinned + 28 * max(0.0, expected.streamed_bytes / pinned - step)
        )
        assert rows["budget"]["seconds_first"] == pytest.approx(
            28 * step + (serial + 28 * expected.streamed_bytes) / pageable
        )
        group = 28 * max(step, sizes["transformer"] / pinned) + others / pinned
        assert rows["group"]["seconds_steady"] == pytest.approx(group)
        assert rows["sequential"]["seconds_steady"] == pytest.approx(
            28 * step + sum(sizes.values()) / pageable + 27 * sizes["transformer"] / pageable
        )
        assert "hidden behind its compute" in timed["assumptions"]["overlap"]


# -- the static block optimum --------------------------------------------------------------------------------------
def test_the_static_block_optimum_keeps_the_most_used_blocks_within_the_room(flux_blocks):
    result = plan("flux-dev", vram="24GiB", generations=3)
    entry = result["block_residency"]
    optimum, room, call = entry["optimum"], entry["room_bytes"], result["call_trace"]
    kept = {(n, b) for n, blocks in optimum["blocks"].items() for b in blocks["kept"]}
    every = {(n, b): size for n, blocks in flux_blocks.items() for b, size in blocks.items()}
    streamed = {key: size for key, size in every.items() if key not in kept}
    assert optimum["kept_bytes"] == sum(every[key] for key in kept)
    assert optimum["streamed_bytes_per_generation"] == sum(s * call.count(n) for (n, _), s in streamed.items())
    blocks = [s for (n, b), s in streamed.items() if b != REST]
    assert optimum["ring_bytes"] == max(blocks, default=0) * min(3, len(blocks))
    rests = [s for (n, b), s in streamed.items() if b == REST and call.count(n)]
    assert optimum["rest_bytes"] == max(rests, default=0)
    assert optimum["device_bytes"] == optimum["kept_bytes"] + optimum["ring_bytes"] + optimum["rest_bytes"] <= room
    # Every kept transformer block is used 28 times a generation; T5's once: none of T5's is kept before them.
    assert optimum["blocks"]["transformer"]["of"] == 58 and len(optimum["blocks"]["transformer"]["kept"]) > 40
    row = entry["rows"]["optimum"]
    assert row["first_generation_bytes"] == optimum["kept_bytes"] + optimum["streamed_bytes_per_generation"]
    assert row["steady_generation_bytes"] == optimum["streamed_bytes_per_generation"]


def brute_force_global(items, room, rests):
    best = None
    for r in range(len(items) + 1):
        for subset in itertools.combinations(items, r):
            streamed = [i for i in items if i not in subset]
            blocks = [i.nbytes for i in streamed if i.key not in rests]
            held = max((i.nbytes for i in streamed if i.key in rests and i.uses), default=0)
            if sum(i.nbytes for i in subset) + max(blocks, default=0) * min(3, len(blocks)) + held <= room:
                cost = sum(i.nbytes * i.uses for i in streamed)
                best = cost if best is None else min(best, cost)
    return best


@settings(max_examples=200, deadline=None)
@given(
    pairs=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 40), st.integers(0, 20)), min_size=0, max_size=8),
    room=st.integers(0, 250),
)
def test_the_static_block_optimum_is_within_one_block_of_brute_force(pairs, room):
    items = [Item((f"c{c}", "<rest>" if i < 3 and c == i else f"b{i}"), size, uses) for i, (c, size, uses) in
             enumerate(pairs)]  # fmt: skip
    rests = {i.key for i in items if i.key[1] == "<rest>"}
    found = global_plan(items, room, rests)
    best = brute_force_global(items, room, rests)
    note(f"plan {found}, optimum {best}")
    assert (found is None) == (best is None)
    if found is None:
        return
    assert set(found.kept) | set(found.streamed) == {i.key for i in items} and not set(found.kept) & set(
        found.streamed
    )
    assert found.device_bytes <= room
    assert best <= found.streamed_bytes <= best + max((i.nbytes * i.uses for i in items), default=0)


# -- the command ---------------------------------------------------------------------------------------------------
def test_the_cli_prints_block_residency_with_its_assumptions(capsys):
    assert cli.main(["plan", "--model", "flux-dev", "--vram", "16GiB", "--details"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Block residency: the components do not fit" in out and "budget, pin_memory=False" in out
    assert "static block optimum (modelled)" in out and "sequential" in out and "group (block level)" in out
    assert "Rates: page-locked 50.29 GiB/s" in out and "Rates measured: profile h200" in out  # 54 GB/s
    assert "Seconds are the copies alone: no compute, nothing overlapped" in out
    assert cli.main(["plan", "--model", "flux-dev", "--vram", "16GiB", "--step-seconds", "0.08", "--details"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "28 denoiser forwards x 0.08 s (--step-seconds" in out and "ASSUMED overlap" in out
    assert cli.main(["plan", "--model", "flux-dev", "--vram", "80GiB", "--details"]) == 0
    assert "Block residency" not in capsys.readouterr().out
    assert cli.main(["plan", "--model", "flux-dev", "--vram", "16GiB", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["block_residency"]["streaming"]["transformer"]["available"] is True
    assert document["bandwidth"]["pinned_h2d_bytes_per_s"] == 54 * 10**9  # the H200 profile's, measured


def test_the_shipped_block_counts_are_those_of_a_build_on_meta():
    """Stale data is refreshed with `python -m diffusers_offload_ext.testing.record_model_data --blocks`."""
    from importlib.metadata import version

    from diffusers_offload_ext.models import block_model
    from diffusers_offload_ext.models.block_model import BLOCKS_FILE, block_counts
    from diffusers_offload_ext.models.errors import PlanError
    from diffusers_offload_ext.models.recorded import config_key, load_recorded
    from diffusers_offload_ext.models.specs import shipped_models

    assert block_model.REST == REST  # the planner's copy of the name (it imports no torch)
    with open(BLOCKS_FILE, encoding="utf-8") as f:
        shipped = json.load(f)["components"]
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
    """`benchmarks/residency.py`'s modelled block column: the static block optimum of the plan, within the budget,
    everything kept once when everything fits, and fewer bytes than the whole-component optimum where the denoiser
    fits but not beside the text encoder (FLUX.1-dev at 24 GiB)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "residency.py"
    spec = importlib.util.spec_from_file_location("residency_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    sizes = bench.sizes_of("flux")
    call = load_model("flux-dev").call_trace(28)
    items = bench.block_items("flux", sizes, call)
    assert sum(i.nbytes for i in items) == pytest.approx(sum(sizes.values()), abs=len(items))
    assert bench.block_optimum(items, 80 * GiB, 10) == sum(i.nbytes for i in items)  # all kept, copied once
    rests = [i.key for i in items if i.key[1] == REST]
    static = global_plan(items, 16 * GiB, rests)
    assert static.device_bytes <= 16 * GiB
    assert bench.block_optimum(items, 16 * GiB, 10) == static.kept_bytes + 10 * static.streamed_bytes
    trace = bench.workload_trace(call, 10)
    row = bench.evaluate("flux", trace, 10, 24 * GiB, sizes)
    assert row["blocks"] < row["optimum"]
    # Its manager (streams) column: at 24 GiB T5 streams beside the resident transformer from the second call on,
    # and its stream stays between calls: its kept blocks cross once, its streamed blocks once per call.
    first = bench.evaluate("flux", bench.workload_trace(call, 1), 1, 24 * GiB, sizes)["streams"]
    room = 24 * GiB - sum(sizes[n] for n in ("transformer", "text_encoder", "vae"))
    t5 = BlockPlans.of(bench.scaled_blocks("flux", sizes)).plan("text_encoder_2", room)
    assert first == (sum(sizes.values()), False) and not row["streams"][1]
    assert row["streams"][0] - first[0] == t5.kept_bytes + 9 * t5.streamed_bytes
