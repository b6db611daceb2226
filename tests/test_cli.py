"""`diffusers-offload`: plan against hand computations, bad input, exit codes, `--json`, output width, speed and
lazy imports, running without transformers, demo and doctor."""

import json
import re
import os
import subprocess
import sys
import time

import pytest
import torch

doe = pytest.importorskip("diffusers_offload_ext")

from diffusers_offload_ext import cli  # noqa: E402
from diffusers_offload_ext.models import plan  # noqa: E402
from diffusers_offload_ext.models.recorded import SPEC_DIR  # noqa: E402
from diffusers_offload_ext.models.specs import shipped_models  # noqa: E402

pytestmark = pytest.mark.plugin_only

GiB = 1 << 30
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Parameter counts of FLUX.1-dev's components. T5-XXL's encoder is computed here from its architecture; the others
# are the published counts.
VOCAB, D_MODEL, D_FF, LAYERS, HEADS, D_KV, BUCKETS = 32128, 4096, 10240, 24, 64, 64, 32
T5_XXL = (
    VOCAB * D_MODEL  # shared embedding (tied with encoder.embed_tokens)
    # per block: q, k, v, o; the gated feed-forward (wi_0, wi_1, wo); two layer norms
    + LAYERS * (4 * D_MODEL * HEADS * D_KV + 2 * D_MODEL * D_FF + D_FF * D_MODEL + 2 * D_MODEL)
    + BUCKETS * HEADS  # relative attention bias of the first block
    + D_MODEL  # final layer norm
)
CLIP_L = 123_060_480
FLUX_DEV = 11_901_408_320
FLUX_VAE = 83_819_683
CLIP_POSITION_IDS = 77 * 8  # an int64 buffer, not cast with the weights


def flux_bytes(transformer_bytes_per_parameter=2):
    return {
        "text_encoder": 2 * CLIP_L + CLIP_POSITION_IDS,
        "text_encoder_2": 2 * T5_XXL,
        "transformer": transformer_bytes_per_parameter * FLUX_DEV,
        "vae": 2 * FLUX_VAE,
    }


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_process(*argv, env=None, timeout=120, module="diffusers_offload_ext.cli"):
    """The command in a fresh interpreter, stdout piped (as `| less` would), `COLUMNS` unset unless given."""
    environment = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    environment["PYTHONPATH"] = os.pathsep.join([ROOT] + sys.path)
    environment.update(env or {})
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", module, *argv],
        capture_output=True,
        text=True,
        env=environment,
        timeout=timeout,
    )
    return done, time.perf_counter() - started


@pytest.fixture(scope="module")
def flux_plan():
    return plan("flux-dev", vram="24GiB", steps=28, generations=10)


# -- plan: numbers ---------------------------------------------------------------------------------------------------
def test_plan_sizes_match_the_parameter_counts(flux_plan):
    assert T5_XXL == 4_762_310_656
    components = flux_plan["components"]
    assert list(components) == ["text_encoder", "text_encoder_2", "transformer", "vae"]
    assert {n: c["parameters"] for n, c in components.items()} == {
        "text_encoder": CLIP_L,
        "text_encoder_2": T5_XXL,
        "transformer": FLUX_DEV,
        "vae": FLUX_VAE,
    }
    assert {n: c["nbytes"] for n, c in components.items()} == flux_bytes()


def test_plan_bytes_and_seconds_match_a_hand_computation(flux_plan):
    sizes = flux_bytes()
    total = sum(sizes.values())
    stock = flux_plan["strategies"]["stock"]
    # Without a preview every component goes up once and back once per generation; nothing moves at enable.
    assert stock["setup_bytes"] == 0
    assert stock["first_generation_bytes_excluding_setup"] == stock["later_generation_bytes_mean"] == 2 * total
    assert stock["all_generations_bytes_including_setup"] == 10 * 2 * total
    assert stock["h2d_bytes_including_setup"] == stock["d2h_bytes_including_setup"] == 10 * total
    assert stock["seconds_at_assumed_bandwidth"]["mean_per_generation_including_setup"] == pytest.approx(
        2 * total / 12e9
    )
    assert stock["peak_bytes"] == sizes["transformer"]
    # 22.2 GiB fits in 24 GiB, but not with 3 GiB left for activations.
    assert stock["fits_without_reserve"] and not stock["fits_with_reserve"]
    exclude = flux_plan["strategies"]["exclude_denoiser"]
    others = total - sizes["transformer"]
    # The setup (the transformer, once) and the generations are separate fields: adding them counts nothing twice.
    assert exclude["setup_bytes"] == sizes["transformer"]
    assert exclude["first_generation_bytes_excluding_setup"] == exclude["later_generation_bytes_mean"] == 2 * others
    assert exclude["all_generations_bytes_including_setup"] == sizes["transformer"] + 10 * 2 * others
    assert exclude["mean_bytes_per_generation_including_setup"] == (sizes["transformer"] + 10 * 2 * others) / 10
    assert exclude["peak_bytes"] == sizes["transformer"] + sizes["text_encoder_2"]
    keep = flux_plan["strategies"]["keep_during_generation"]
    assert keep["mean_bytes_per_generation_including_setup"] == 2 * total and keep["peak_bytes"] == total
    assert not keep["fits_without_reserve"]
    assert flux_plan["call_trace"] == ["text_encoder", "text_encoder_2"] + ["transformer"] * 28 + ["vae"]


def test_plan_with_a_preview_an_fp8_transformer_and_two_bandwidths(capsys):
    code, out, _ = run_cli(
        capsys, "plan", "--model", "flux-dev", "--steps", "4", "--generations", "3", "--preview", "--json",
        "--dtype", "transformer=fp8", "--h2d-bandwidth", "25GB/s", "--d2h-bandwidth", "5GB/s",
    )  # fmt: skip
    assert code == 0
    result = json.loads(out)
    sizes = flux_bytes(transformer_bytes_per_parameter=1)
    others = sum(sizes.values()) - sizes["transformer"]
    stock = result["strategies"]["stock"]
    # The preview's VAE evicts the transformer every step: it crosses twice per step.
    per_generation = 2 * others + 2 * 4 * sizes["transformer"]
    assert stock["mean_bytes_per_generation_including_setup"] == per_generation
    assert stock["seconds_at_assumed_bandwidth"]["mean_per_generation_including_setup"] == pytest.approx(
        per_generation / 2 / 25e9 + per_generation / 2 / 5e9
    )
    assert result["bandwidth"] == {
        "assumed": True,
        "h2d_bytes_per_s": 25 * 10**9,
        "d2h_bytes_per_s": 5 * 10**9,
        "pinned_h2d_bytes_per_s": 24 * 10**9,  # the assumed default: --pinned-bandwidth not given
        "note": result["bandwidth"]["note"],
    }
    keep = result["strategies"]["keep_during_generation"]
    assert keep["mean_bytes_per_generation_including_setup"] == 2 * sum(sizes.values())
    assert keep["fits_with_reserve"]


def test_plan_residency_keeps_everything_that_fits(capsys):
    code, out, _ = run_cli(
        capsys, "plan", "--model", "flux-dev", "--steps", "4", "--generations", "3", "--preview", "--json",
        "--dtype", "denoiser=fp8", "--reserve", "3GiB",
    )  # fmt: skip
    assert code == 0
    result = json.loads(out)
    sizes = flux_bytes(transformer_bytes_per_parameter=1)
    residency = result["strategies"]["residency"]
    # 20.3 GiB of weights fit in the 21 GiB budget: uploaded once (zero-copy: nothing copied back), then kept.
    assert residency["first_generation_bytes_excluding_setup"] == sum(sizes.values())
    assert residency["later_generation_bytes_mean"] == 0 and residency["d2h_bytes_including_setup"] == 0
    assert residency["budget_bytes"] == 21 * GiB
    assert result["recommended"]["strategy"] == "residency"
    assert 'memory_budget="21.0GiB"' in result["recommended"]["call"]


def test_plan_recommends_a_budget_only_where_its_weights_stay_within_it(flux_plan, capsys):
    # bf16 FLUX.1-dev: the transformer (22.2 GiB) does not fit in 24 GiB minus the 3 GiB reserve: it streams its
    # blocks within the budget, so the budget's peak fits with the reserve, unlike stock's (the whole transformer).
    residency = flux_plan["strategies"]["residency"]
    assert residency["peak_bytes"] <= residency["budget_bytes"] and residency.get("recommendable", True)
    assert flux_plan["recommended"]["strategy"] == "residency" and flux_plan["recommended"]["with_reserve"]
    assert flux_plan["block_residency"]["streaming"]["transformer"]["available"]
    # A budget too small for the transformer's rest and ring: it would run alone, over the budget.
    code, out, _ = run_cli(capsys, "plan", "--model", "flux-dev", "--vram", "3GiB", "--reserve", "2.5GiB", "--json")
    result = json.loads(out)
    residency = result["strategies"]["residency"]
    assert residency["recommendable"] is False and "cannot stream its blocks" in residency["reason"]
    assert any("cannot hold transformer" in note for note in result["notes"])
    # No strategy fits that card: no recommendation, and why.
    assert result["recommended"] is None and any("transformer alone is" in n for n in result["notes"])
    # A reserve as large as the card or larger: nothing fits, a usage error that says so (no recommendation).
    for reserve in ("30GiB", "24GiB"):
        code, out, _ = run_cli(capsys, "plan", "--model", "flux-dev", "--reserve", reserve, "--json")
        result = json.loads(out)
        assert code == 2 and result["argument"] == "--reserve" and "nothing fits" in result["error"]
        assert "recommended" not in result
    code, out, err = run_cli(capsys, "plan", "--model", "flux-dev", "--reserve", "30GiB")
    assert code == 2 and out == "" and "leaves nothing of the card's --vram 24.00 GiB" in err


def test_many_generations_are_extrapolated_exactly_from_their_period():
    from diffusers_offload_ext.constants import COPY, END, ONLOAD, STREAM
    from diffusers_offload_ext.models import load_model
    from diffusers_offload_ext.models.block_model import BlockPlans, replay_streaming
    from diffusers_offload_ext.models.strategies import all_strategies

    periods = set()
    cases = [("flux-dev", "30GiB", True), ("sd3.5-large", "24GiB", False), ("wan2.2-t2v-a14b", "60GiB", True)]
    for model, vram, preview in cases:
        # 41: the extrapolated generations end inside a period of two (Wan 2.2's experts alternate).
        result = plan(model, vram=vram, steps=6, generations=41, preview=preview, reserve="0")
        loaded = load_model(model)
        call = loaded.call_trace(6, preview)
        budget = result["vram_bytes"]
        for name, strategy in all_strategies(loaded.layout, loaded.sizes, loaded.denoisers, budget).items():
            entry = result["strategies"][name]
            assert entry["replay"]["extrapolated"] and entry["replay"]["period"] is not None
            periods.add(entry["replay"]["period"])
            trace = (call + [END]) * 41
            if name == "residency":  # streams counted block by block, as the plan counts them
                plans = BlockPlans(model, {n: c["dtype"] for n, c in result["components"].items()})
                moves, peak = replay_streaming(strategy.policy, trace, loaded.sizes, plans, zero_copy=True)
            else:
                full = doe.replay_trace(strategy.policy, trace, loaded.sizes, zero_copy=strategy.zero_copy)
                moves, peak = full.moves, full.peak
            copied = [m for m in moves if m.kind in (COPY, STREAM)]
            assert entry["all_generations_bytes_including_setup"] == sum(m.nbytes for m in copied), (model, name)
            assert entry["h2d_bytes_including_setup"] == sum(m.nbytes for m in copied if m.direction == ONLOAD)
            assert entry["peak_bytes"] == peak
    assert periods == {1, 2}


def test_period_detection_and_extrapolation():
    from diffusers_offload_ext.models.generations import Moved, extrapolate, find_period

    calls = [Moved(9, 0, 1), Moved(5, 0, 1)] + [Moved(1, 0, 1), Moved(2, 0, 1), Moved(3, 0, 1)] * 3
    assert find_period(calls) == 3 and find_period(calls[:-1]) is None and find_period([calls[0]] * 3) == 1
    # Continues the cycle in order: 1, 2, 3, 1, 2 for five more.
    assert extrapolate(calls, 3, 5) == Moved(9, 0, 5)
    # Without a period: the mean of the last four, in whole numbers.
    assert extrapolate(calls, None, 4) == Moved(1 + 2 + 3 + 3, 0, 4)


def test_the_recommended_budget_is_rounded_down():
    result = plan("flux-dev", vram="23.96GiB", reserve="0", dtypes=["denoiser=fp8"])
    entry = result["strategies"]["residency"]
    assert 'memory_budget="23.9GiB"' in entry["call"] and entry["budget_bytes"] <= result["vram_bytes"]


def test_plan_table_output(capsys):
    code, out, _ = run_cli(
        capsys, "plan", "--model", "flux-schnell", "--steps", "4", "--generations", "2", "--details"
    )
    assert code == 0
    assert "FLUX.1 [schnell]" in out and "11,891,178,560" in out  # schnell has no guidance embedding
    for label, call in [
        ("stock", "pipe.enable_model_cpu_offload()"),
        ("exclude", 'exclude_from_offload=["transformer"]'),
        ("keep", "keep_on_device_during_generation=True"),
    ]:
        assert any(line.startswith(label) and call in line for line in out.splitlines()), label
    assert "Use (" in out and "Runner-up (" in out and "ASSUMED" in out and "GiB" in out and " GB " not in out


def test_every_shipped_model_has_a_valid_spec():
    assert {"flux-dev", "flux-schnell", "sdxl", "sd3.5-large", "wan2.1-t2v-14b", "wan2.2-t2v-a14b"} <= set(
        shipped_models()
    )
    for name in shipped_models():
        with open(os.path.join(SPEC_DIR, f"{name}.json"), encoding="utf-8") as f:
            spec = json.load(f)
        assert spec["name"] == name and spec["denoisers"] and spec["tiny"]
        assert set(spec["denoisers"]) <= set(spec["components"])


def test_plan_sdxl_and_sd35_sizes(capsys):
    code, out, _ = run_cli(capsys, "plan", "--model", "sdxl", "--steps", "2", "--generations", "1", "--json")
    assert code == 0
    parameters = {n: c["parameters"] for n, c in json.loads(out)["components"].items()}
    assert parameters == {
        "text_encoder": 123_060_480,
        "text_encoder_2": 694_659_840,
        "unet": 2_567_463_684,
        "vae": 83_653_863,
    }


def test_wan_plans_need_no_wan_classes(capsys, monkeypatch):
    # The shipped data holds everything: the plan works even where diffusers has no Wan classes.
    import diffusers

    monkeypatch.delattr(diffusers, "WanTransformer3DModel", raising=False)
    code, out, _ = run_cli(
        capsys, "plan", "--model", "wan2.2-t2v-a14b", "--steps", "40", "--generations", "2", "--json"
    )
    assert code == 0
    result = json.loads(out)
    assert result["components"]["transformer"]["parameters"] == 14_288_491_584
    assert result["components"]["transformer_2"]["parameters"] == 14_288_491_584
    assert result["components"]["text_encoder"]["parameters"] == 5_680_910_336
    trace = result["call_trace"]
    # Each step runs its expert twice (classifier-free guidance); the high-noise one runs the first steps.
    high, low = trace.count("transformer"), trace.count("transformer_2")
    assert high + low == 80 and high > 0 and low > 0
    assert trace.index("transformer_2") > max(i for i, n in enumerate(trace) if n == "transformer")
    call = result["strategies"]["exclude_denoiser"]["call"]
    assert 'exclude_from_offload=["transformer", "transformer_2"]' in call


TINY_VAE = {
    "_class_name": "AutoencoderKL",
    "block_out_channels": [8, 16],
    "down_block_types": ["DownEncoderBlock2D", "DownEncoderBlock2D"],
    "up_block_types": ["UpDecoderBlock2D", "UpDecoderBlock2D"],
    "latent_channels": 4,
    "layers_per_block": 1,
    "norm_num_groups": 4,
}


def _tiny_vae_parameters():
    import diffusers

    config = {k: v for k, v in TINY_VAE.items() if not k.startswith("_")}
    return sum(p.numel() for p in diffusers.AutoencoderKL(**config).parameters())


def test_any_model_class_and_config_by_path(tmp_path, capsys):
    (tmp_path / "vae.json").write_text(json.dumps(TINY_VAE))
    with open(os.path.join(SPEC_DIR, "flux-dev.json"), encoding="utf-8") as f:
        spec = json.load(f)
    spec["components"]["vae"] = {"class": "AutoencoderKL", "dtype": "float32", "config_path": "vae.json"}
    spec_path = tmp_path / "my-flux.json"
    spec_path.write_text(json.dumps(spec))
    expected = _tiny_vae_parameters()
    code, out, _ = run_cli(capsys, "plan", "--model", str(spec_path), "--steps", "2", "--generations", "1", "--json")
    assert code == 0
    result = json.loads(out)
    vae = result["components"]["vae"]
    assert (vae["parameters"], vae["nbytes"]) == (expected, 4 * expected)
    # The other components reuse the recorded counts of the shipped flux-dev.
    assert result["components"]["transformer"]["parameters"] == FLUX_DEV
    code, out, _ = run_cli(
        capsys, "plan", "--model", "flux-dev", "--steps", "2", "--generations", "1", "--json",
        "--component", f"vae={tmp_path / 'vae.json'}",
    )  # fmt: skip
    assert code == 0
    vae = json.loads(out)["components"]["vae"]
    assert (vae["class"], vae["parameters"], vae["nbytes"]) == ("AutoencoderKL", expected, 2 * expected)


# -- bad input -------------------------------------------------------------------------------------------------------
BAD = [
    (["plan", "--model", "flux-deev"], "Unknown model 'flux-deev'"),
    (["plan", "--model", "flux-dev", "--vram", "24 parsecs"], "--vram: '24 parsecs' is not a size"),
    (["plan", "--model", "flux-dev", "--vram", "1e99999999"], "--vram: '1e99999999' is too large"),
    (["plan", "--model", "flux-dev", "--vram", "9" * 5000], "--vram"),
    (["plan", "--model", "flux-dev", "--vram", "0GiB"], "--vram must be more than 0"),
    (["plan", "--model", "flux-dev", "--reserve=-1GiB"], "--reserve: '-1GiB' is negative"),
    (["plan", "--model", "flux-dev", "--bandwidth", "fast"], "--h2d-bandwidth: 'fast' is not a rate"),
    (["plan", "--model", "flux-dev", "--d2h-bandwidth", "0GB/s"], "--d2h-bandwidth: '0GB/s' is not a rate"),
    (["plan", "--model", "flux-dev", "--pinned-bandwidth", "fast"], "--pinned-bandwidth: 'fast' is not a rate"),
    (["plan", "--model", "flux-dev", "--step-seconds", "0"], "`--step-seconds` must be seconds above 0"),
    (["plan", "--model", "flux-dev", "--step-seconds", "nan"], "`--step-seconds` must be seconds above 0"),
    (["plan", "--model", "flux-dev", "--step-seconds", "1e9"], "at most 3600, got '1e9'"),
    (["plan", "--model", "flux-dev", "--step-seconds", "fast"], "got 'fast': give the seconds one denoiser forward"),
    (["plan", "--model", "flux-dev", "--dtype", "transformer=fp7"], "unknown dtype 'fp7'"),
    (["plan", "--model", "flux-dev", "--dtype", "unet=fp8"], "unknown component 'unet'"),
    (["plan", "--model", "flux-dev", "--steps", "0"], "--steps must be a whole number from 1 to 1,000"),
    (["plan", "--model", "flux-dev", "--steps", "1001"], "--steps must be a whole number from 1 to 1,000"),
    (["plan", "--model", "flux-dev", "--steps", "abc"], "--steps must be a whole number"),
    (["plan", "--model", "flux-dev", "--generations", "10000000"], "--generations must be a whole number"),
    (["plan", "--model", "flux-dev", "--generations", str(10**9)], "--generations must be a whole number"),
    (["plan", "--model", "flux-dev", "--generations", "1" * 100000], "--generations must be a whole number"),
    (["plan", "--steps", "abc"], "--steps must be a whole number"),
    (["plan", "--model", "/nonexistent/spec.json"], "Cannot read model spec"),
    (["plan"], "plan needs --model"),
    (["plan", "--model", "flux-dev", "--bogus"], "unrecognized arguments: --bogus"),
    (["plan", "--model"], "expected one argument"),
    ([], "the following arguments are required"),
    (["fly"], "invalid choice: 'fly'"),
    (["demo", "--generations", "0"], "--generations must be a whole number from 1 to 20"),
    (["demo", "--steps", "1e9"], "--steps must be a whole number"),
    (["demo", "--png", "/nonexistent/folder/timeline.png"], "--png /nonexistent/folder/timeline.png"),
]


@pytest.mark.parametrize("argv, message", BAD)
def test_errors_exit_with_code_2_in_a_second_with_one_line(capsys, argv, message):
    started = time.perf_counter()
    code, out, err = run_cli(capsys, *argv)
    assert time.perf_counter() - started < 1.0
    assert code == 2 and message in err and out == ""
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    code, out, err = run_cli(capsys, *argv, "--json")
    document = json.loads(out)  # exactly one document: anything more and this raises
    assert code == 2 and document["exit_code"] == 2 and message in document["error"]


def test_steps_abc_json_prints_one_document_and_exits_2_as_a_process():
    done, _ = run_process("plan", "--steps", "abc", "--json")
    assert done.returncode == 2
    assert json.loads(done.stdout) == {
        "error": "--steps must be a whole number from 1 to 1,000, got 'abc'.",
        "exit_code": 2,
        "argument": "--steps",
    }
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def test_png_into_a_missing_or_unusable_folder(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for path, reason in [
        (tmp_path / "missing" / "t.png", "does not exist"),
        (blocker / "t.png", "does not exist"),
        (tmp_path, "is a folder"),
    ]:
        code, out, err = run_cli(capsys, "demo", "--png", str(path), "--steps", "1", "--generations", "1")
        assert code == 2 and str(path) in err and reason in err and len(err.splitlines()) == 1


def test_unreadable_configs_exit_with_code_2(tmp_path, capsys):
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    code, _, err = run_cli(capsys, "plan", "--model", str(broken))
    assert code == 2 and "not valid JSON" in err
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"components": {"vae": {"class": "AutoencoderKL", "config_path": "missing.json"}}}))
    code, _, err = run_cli(capsys, "plan", "--model", str(spec))
    assert code == 2 and "Cannot read config of 'vae'" in err
    code, _, err = run_cli(capsys, "plan", "--model", "flux-dev", "--component", f"vae={broken}")
    assert code == 2 and "not valid JSON" in err
    spec.write_text(json.dumps({"components": {"vae": {"class": "NoSuchModel", "config": {}}}, "tiny": "flux"}))
    code, _, err = run_cli(capsys, "plan", "--model", str(spec))
    assert code == 2 and "'NoSuchModel' is not in the installed diffusers" in err
    spec.write_text(json.dumps({"components": {"vae": {"class": "AutoencoderKL", "config": {}}}, "tiny": "nope"}))
    code, _, err = run_cli(capsys, "plan", "--model", str(spec))
    assert code == 2 and "No call trace is recorded for pipeline 'nope'" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--model", "flux-dev"],
        ["plan", "--list"],
        ["plan", "--model", "nope"],
        ["plan", "--help"],
        ["--help"],
        ["doctor"],
        ["plan", "--model", "sdxl", "--vram", "1e99999999"],
    ],
)
def test_json_is_always_exactly_one_document(capsys, argv):
    code, out, _ = run_cli(capsys, *argv, "--json")
    assert isinstance(json.loads(out), dict) and code in (0, 2)


# -- output width, speed, imports ---------------------------------------------------------------------------------
@pytest.mark.parametrize("columns", [None, "80", "60"])
def test_output_fits_80_columns_when_piped_and_honours_columns(columns):
    env = {"COLUMNS": columns} if columns else {}
    limit = int(columns or 80)
    for argv in (["plan", "--model", "sd3.5-large", "--preview"], ["plan", "--model", "wan2.2-t2v-a14b"], ["doctor"]):
        done, _ = run_process(*argv, env=env)
        assert done.returncode == 0, done.stderr
        widest = max(done.stdout.splitlines(), key=len)
        assert len(widest) <= limit, (argv, widest)
    # The strategies stay apart at 80 columns: short labels, each with its call in the legend.
    done, _ = run_process("plan", "--model", "flux-dev", "--details", env=env)
    labels = [line.split()[0] for line in done.stdout.splitlines() if line.startswith(("stock ", "exclude ", "keep "))]
    assert set(labels) == {"stock", "exclude", "keep"}


def test_output_is_wider_when_columns_says_so(capsys, monkeypatch):
    from diffusers_offload_ext.cli import plan as plan_command

    result = plan("flux-dev")
    narrow, wide = plan_command.render(result, 60, details=True), plan_command.render(result, 200, details=True)
    assert max(map(len, narrow)) <= 60 < max(map(len, wide)) and len(wide) < len(narrow)
    monkeypatch.setenv("COLUMNS", "132")
    assert cli.output.width() == 132


def test_plan_is_fast_and_loads_no_torch_diffusers_or_rich():
    started = time.perf_counter()
    done, elapsed = run_process("plan", "--model", "flux-dev", "--steps", "50", "--preview")
    assert done.returncode == 0 and elapsed < 2.0, elapsed
    code = (
        "import sys, io, contextlib\n"
        "import diffusers_offload_ext\n"
        "assert not {'torch', 'diffusers', 'rich', 'matplotlib'} & set(sys.modules), 'import'\n"
        "from diffusers_offload_ext.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['plan', '--model', 'wan2.2-t2v-a14b', '--preview']) == 0\n"
        "    try:\n"
        "        main(['--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(sorted({'torch', 'diffusers', 'transformers', 'rich', 'matplotlib', 'numpy'} & set(sys.modules)))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + sys.path))
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert loaded.returncode == 0 and loaded.stdout.strip() == "[]", loaded.stdout + loaded.stderr
    assert time.perf_counter() - started < 60


def test_help_is_fast():
    done, elapsed = run_process("--help")
    assert done.returncode == 0 and "plan" in done.stdout and elapsed < 2.0
    done, _ = run_process("plan", "--help")
    assert "extrapolated" in done.stdout and "ASSUMED" in done.stdout


# -- without transformers --------------------------------------------------------------------------------------------
@pytest.fixture
def no_transformers(monkeypatch):
    """An interpreter where `import transformers` fails and `find_spec('transformers')` is `None`."""
    for name in [m for m in sys.modules if m == "transformers" or m.startswith("transformers.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "transformers", None)


def test_plan_needs_no_transformers_and_no_torch(no_transformers, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # nothing of the plan may import it
    for model in shipped_models():
        code, out, err = run_cli(capsys, "plan", "--model", model, "--json")
        assert code == 0, err
        assert json.loads(out)["recommended"] is not None or json.loads(out)["notes"]


def test_a_transformers_component_without_transformers_names_the_package(no_transformers, tmp_path, capsys):
    config = tmp_path / "clip.json"
    config.write_text(json.dumps({"architectures": ["CLIPTextModel"], "hidden_size": 64}))
    code, out, err = run_cli(capsys, "plan", "--model", "flux-dev", "--component", f"text_encoder={config}", "--json")
    assert code == 1 and "transformers is not installed" in err and "pip install transformers" in err
    assert json.loads(out)["exit_code"] == 1 and "Traceback" not in err


def test_demo_without_transformers_names_the_package_and_the_command(no_transformers, capsys):
    code, out, err = run_cli(capsys, "demo", "--steps", "1", "--generations", "1")
    assert code == 1 and out == ""
    assert "transformers is not installed" in err and "pip install" in err and "[demo]" in err
    code, out, _ = run_cli(capsys, "doctor", "--json")
    assert code == 0 and json.loads(out)["demo"]["missing"] == "transformers"


# -- demo and doctor -------------------------------------------------------------------------------------------------
def test_demo(capsys):
    pytest.importorskip("transformers")
    code, out, _ = run_cli(capsys, "demo", "--steps", "3", "--generations", "2", "--json")
    assert code == 0
    result = json.loads(out)
    configs = result["configurations"]
    assert set(configs) == {"stock", "exclude_transformer", "keep_during_generation", "memory_budget"}
    # Stock with a preview: text encoders, the VAE once, the transformer at each of the 3 steps.
    assert configs["stock"]["onloads_per_generation"] == 6
    assert configs["exclude_transformer"]["onloads_per_generation"] == 3
    assert configs["keep_during_generation"]["onloads_per_generation"] == 4
    real = flux_bytes(transformer_bytes_per_parameter=1)
    others = sum(real.values()) - real["transformer"]
    assert configs["stock"]["real_bytes_per_generation"] == 2 * others + 2 * 3 * real["transformer"]
    assert configs["exclude_transformer"]["real_bytes_per_generation"] == 2 * others
    assert configs["exclude_transformer"]["real_bytes_at_enable"] == real["transformer"]
    assert configs["keep_during_generation"]["real_peak_bytes"] == sum(real.values())
    assert configs["stock"]["real_peak_bytes"] == real["transformer"] + real["vae"]
    assert all(c["real_fits_card"] for c in configs.values())
    assert {c["real_card_bytes"] for k, c in configs.items() if k != "memory_budget"} == {24 * GiB}
    # The budget (issue 34, point 7): the tiny pipeline keeps all but T5 between calls, so from the second call on
    # only T5 moves; the real figures are the plan's on a 16 GiB card.
    budget = configs["memory_budget"]
    assert budget["tiny_bytes_per_generation"] < configs["exclude_transformer"]["tiny_bytes_per_generation"]
    planned = plan("flux-dev", vram="16GiB", dtypes=["transformer=fp8"], steps=3, generations=2, preview=True)
    assert (
        budget["real_call"] == planned["strategies"]["residency"]["call"] and "memory_budget=" in budget["real_call"]
    )
    assert budget["real_card_bytes"] == 16 * GiB and budget["real_peak_bytes"] < 16 * GiB
    assert result["bandwidth"]["assumed"] is True
    code, out, _ = run_cli(capsys, "demo", "--steps", "2", "--generations", "1")
    assert code == 0 and "keep_on_device_during_generation=True" in out and "ASSUMED" in out
    assert "memory_budget" in out and "transformers" not in out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert not doe.is_installed()


def test_demo_png(tmp_path, capsys):
    pytest.importorskip("transformers")
    png = tmp_path / "demo.png"
    code, out, err = run_cli(capsys, "demo", "--steps", "2", "--generations", "1", "--png", str(png), "--json")
    assert code == 0, err
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 10_000
    assert json.loads(out)["png"] == str(png)


def test_doctor(capsys, monkeypatch):
    from diffusers_offload_ext import marks
    from diffusers_offload_ext.runtime.methods import METHODS

    code, out, _ = run_cli(capsys, "doctor", "--json")
    assert code == 0
    report = json.loads(out)
    assert set(report["versions"]) >= {"torch", "diffusers", "accelerate", "transformers", "diffusers-offload-ext"}
    assert "plugin_installed" not in report  # the CLI's own state is not the user's
    assert report["upstream_patch"] == {"exclude_from_offload": False, "keep_on_device_during_generation": False}
    assert report["install_would"]["replace_on_DiffusionPipeline"] == sorted(METHODS)
    import diffusers

    overrides = report["install_would"]["own_enable_model_cpu_offload"]
    assert all("enable_model_cpu_offload" in vars(getattr(diffusers, name)) for name in overrides)
    assert overrides["StableCascadeCombinedPipeline"].startswith("adapted: a combined pipeline")
    assert overrides["AudioLDM2Pipeline"].startswith("rejects the options: ")

    def patched(self, gpu_id=None, device=None, *, exclude_from_offload=None, keep_on_device_during_generation=None):
        pass

    monkeypatch.setitem(marks.STOCK, "enable_model_cpu_offload", patched)
    code, out, _ = run_cli(capsys, "doctor", "--json")
    assert json.loads(out)["upstream_patch"] == {
        "exclude_from_offload": True,
        "keep_on_device_during_generation": True,
    }
    code, out, _ = run_cli(capsys, "doctor")
    assert code == 0 and re.search(r"diffusers has the patch\s+yes", out) and "plugin installed" not in out


def test_the_console_entry_point_and_the_module_agree():
    done, _ = run_process("plan", "--model", "nope", "--json")
    assert done.returncode == 2 and json.loads(done.stdout)["exit_code"] == 2
    # `python -m diffusers_offload_ext` is the same command (issue 34, point 7).
    done, _ = run_process("plan", "--model", "nope", "--json", module="diffusers_offload_ext")
    assert done.returncode == 2 and json.loads(done.stdout)["exit_code"] == 2, done.stderr
    with open(os.path.join(ROOT, "setup.py"), encoding="utf-8") as f:
        assert '"diffusers-offload=diffusers_offload_ext.cli:main"' in f.read()


def test_doctor_says_nothing_before_its_report():
    """transformers warns at import when torchvision is missing (diffusers' pipelines import its image processors):
    not a line about offload, and not the report's first (issue 34, point 7)."""
    done, _ = run_process("doctor", "--no-bandwidth")
    assert done.returncode == 0 and done.stdout.splitlines()[0] == "diffusers-offload doctor"
    assert "transformers" not in done.stderr and "torchvision" not in done.stderr, done.stderr


def test_bandwidth_measures_real_copies_on_the_simulated_accelerator():
    from simulated_accelerator import SimulatedAccelerator

    from diffusers_offload_ext.pinning import bandwidth

    assert bandwidth.measure(torch.device("cpu", 0)) is None  # not CUDA, no way to wait for it: nothing measured
    with SimulatedAccelerator() as sim:
        rates = bandwidth.measure(sim.device, nbytes=1 << 20, repeats=2, synchronize=lambda: None, page_locked=False)
        assert sim.h2d_bytes >= 3 << 20 and sim.d2h_bytes >= 3 << 20  # warm-up and two copies each way crossed
    assert set(rates) == {"h2d_pageable", "d2h_fresh"} and all(r > 0 for r in rates.values())
    for bad in (dict(nbytes=1), dict(repeats=0), dict(nbytes=5 << 30)):
        with pytest.raises(ValueError, match="`nbytes` must be 1 MiB to 4 GiB and `repeats` 1 to 20"):
            bandwidth.measure(sim.device, synchronize=lambda: None, **bad)


def test_doctor_reports_measured_bandwidth_on_a_cuda_machine(capsys, monkeypatch):
    """CUDA is faked (no GPU here): the device list and the measurement; the report and its plan flags are real."""
    from diffusers_offload_ext.models.bounds import parse_rate
    from diffusers_offload_ext.pinning import bandwidth

    class Properties:
        name, total_memory = "Fake GPU", 80 << 30

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Properties)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=None: (70 << 30, 80 << 30))
    rates = dict(h2d_pageable=6.7e9, h2d_page_locked=52e9, d2h_fresh=2.3e9, d2h_page_locked=50e9)
    seen = []
    monkeypatch.setattr(bandwidth, "measure", lambda device: seen.append(device) or rates)
    code, out, _ = run_cli(capsys, "doctor", "--json")
    assert code == 0 and seen == [torch.device("cuda:0")]
    assert json.loads(out)["bandwidth"] == {"measured": True, "device": "cuda:0", "name": "Fake GPU", **rates}
    code, out, _ = run_cli(capsys, "doctor")
    out = " ".join(out.split())  # lines wrap at the terminal's width
    flags = re.search(r"--h2d-bandwidth (\S+) --d2h-bandwidth (\S+) --pinned-bandwidth (\S+)", out)
    assert flags and "measured on Fake GPU" in out
    assert parse_rate(flags.group(1), argument="h2d") == pytest.approx(6.7e9, rel=0.01)
    assert parse_rate(flags.group(2), argument="d2h") == pytest.approx(2.3e9, rel=0.01)
    assert parse_rate(flags.group(3), argument="pinned") == pytest.approx(52e9, rel=0.01)
    code, out, _ = run_cli(capsys, "doctor", "--json", "--no-bandwidth")
    assert json.loads(out)["bandwidth"] == {"measured": False, "reason": "skipped (--no-bandwidth)"} and len(seen) == 2
