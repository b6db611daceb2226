"""`diffusers-offload`: plan against hand computations, demo, doctor, errors and exit codes."""

import json
import os
import subprocess
import sys

import pytest

doe = pytest.importorskip("diffusers_offload_ext")

from diffusers_offload_ext import _mixin, cli  # noqa: E402
from diffusers_offload_ext._models import (  # noqa: E402
    CONFIG_DIR,
    PlanError,
    parse_bandwidth,
    parse_size,
    shipped_models,
)

pytestmark = pytest.mark.plugin_only

GiB = 1 << 30

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


def residency_present():
    try:
        from diffusers_offload_ext import _residency  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def flux_plan():
    from diffusers_offload_ext._models import plan

    return plan("flux-dev", vram="24GiB", steps=28, generations=10)


def test_plan_sizes_match_the_parameter_counts(flux_plan):
    assert T5_XXL == 4_762_310_656
    components = flux_plan["components"]
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
    # Without a preview every component goes up once and back once per generation.
    assert stock["bytes_per_generation"] == 2 * total
    assert stock["first_generation_bytes"] == stock["later_generation_bytes"] == 2 * total
    assert stock["seconds_per_generation"] == pytest.approx(2 * total / 12e9)
    assert stock["peak_bytes"] == sizes["transformer"]
    # 23.8 GB fits in 24 GiB, but not with 3 GiB left for activations.
    assert stock["fits_without_reserve"] and not stock["fits"]
    exclude = flux_plan["strategies"]["exclude_denoiser"]
    others = total - sizes["transformer"]
    assert exclude["later_generation_bytes"] == 2 * others
    assert exclude["first_generation_bytes"] == sizes["transformer"] + 2 * others
    assert exclude["total_bytes"] == sizes["transformer"] + 10 * 2 * others
    assert exclude["peak_bytes"] == sizes["transformer"] + sizes["text_encoder_2"]
    keep = flux_plan["strategies"]["keep_during_generation"]
    assert keep["bytes_per_generation"] == 2 * total and keep["peak_bytes"] == total and not keep["fits"]
    assert flux_plan["call_trace"] == ["text_encoder", "text_encoder_2"] + ["transformer"] * 28 + ["vae"]


def test_plan_with_a_preview_and_an_fp8_transformer(capsys):
    code, out, _ = run_cli(
        capsys, "plan", "--model", "flux-dev", "--steps", "4", "--generations", "3", "--preview", "--json",
        "--dtype", "transformer=fp8", "--bandwidth", "25GB/s",
    )  # fmt: skip
    assert code == 0
    result = json.loads(out)
    sizes = flux_bytes(transformer_bytes_per_parameter=1)
    others = sum(sizes.values()) - sizes["transformer"]
    stock = result["strategies"]["stock"]
    # The preview's VAE evicts the transformer every step: it crosses twice per step.
    assert stock["bytes_per_generation"] == 2 * others + 2 * 4 * sizes["transformer"]
    assert stock["seconds_per_generation"] == pytest.approx(stock["bytes_per_generation"] / 25e9)
    keep = result["strategies"]["keep_during_generation"]
    assert keep["bytes_per_generation"] == 2 * sum(sizes.values()) and keep["fits"]
    assert result["recommended"] is not None


@pytest.mark.xfail(
    not residency_present(), reason="the residency manager (_residency.py) is not in this build", strict=True
)
def test_plan_residency_keeps_everything_that_fits(capsys):
    code, out, _ = run_cli(
        capsys, "plan", "--model", "flux-dev", "--steps", "4", "--generations", "3", "--preview", "--json",
        "--dtype", "denoiser=fp8",
    )  # fmt: skip
    assert code == 0
    result = json.loads(out)
    sizes = flux_bytes(transformer_bytes_per_parameter=1)
    residency = result["strategies"]["residency"]
    assert residency["available"]
    # 20.3 GiB of weights fit in the 21 GiB budget: uploaded once (zero-copy: nothing copied back), then kept.
    assert residency["first_generation_bytes"] == sum(sizes.values())
    assert residency["later_generation_bytes"] == 0
    assert result["recommended"]["strategy"] == "residency"
    assert 'memory_budget="21.0GiB"' in result["recommended"]["call"]


def test_plan_table_output(capsys):
    code, out, _ = run_cli(capsys, "plan", "--model", "flux-schnell", "--steps", "4", "--generations", "2")
    assert code == 0
    assert "FLUX.1 [schnell]" in out and "stock (no options)" in out
    assert 'exclude_from_offload=["transformer"]' in out and "Recommended" in out
    assert "11,891,178,560" in out  # schnell has no guidance embedding


def test_every_shipped_model_has_a_valid_spec():
    assert {"flux-dev", "flux-schnell", "sdxl", "sd3.5-large", "wan2.1-t2v-14b", "wan2.2-t2v-a14b"} <= set(
        shipped_models()
    )
    for name in shipped_models():
        with open(os.path.join(CONFIG_DIR, f"{name}.json"), encoding="utf-8") as f:
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


def test_wan_plans_need_a_diffusers_with_wan(capsys):
    import diffusers

    code, out, err = run_cli(
        capsys, "plan", "--model", "wan2.2-t2v-a14b", "--steps", "3", "--generations", "2", "--json"
    )
    if not hasattr(diffusers, "WanTransformer3DModel"):
        assert code == 2 and "WanTransformer3DModel" in err and json.loads(out)["exit_code"] == 2
        return
    assert code == 0
    result = json.loads(out)
    assert result["components"]["transformer"]["parameters"] == 14_288_491_584
    assert result["components"]["transformer_2"]["parameters"] == 14_288_491_584
    assert result["components"]["text_encoder"]["parameters"] == 5_680_910_336
    assert {"transformer", "transformer_2"} <= set(result["call_trace"])
    assert 'exclude_from_offload=["transformer", "transformer_2"]' in result["strategies"]["exclude_denoiser"]["call"]


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
    with open(os.path.join(CONFIG_DIR, "flux-dev.json"), encoding="utf-8") as f:
        spec = json.load(f)
    spec["components"]["vae"] = {"class": "AutoencoderKL", "dtype": "float32", "config_path": "vae.json"}
    spec_path = tmp_path / "my-flux.json"
    spec_path.write_text(json.dumps(spec))
    expected = _tiny_vae_parameters()
    code, out, _ = run_cli(capsys, "plan", "--model", str(spec_path), "--steps", "2", "--generations", "1", "--json")
    assert code == 0
    vae = json.loads(out)["components"]["vae"]
    assert (vae["parameters"], vae["nbytes"]) == (expected, 4 * expected)
    code, out, _ = run_cli(
        capsys, "plan", "--model", "flux-dev", "--steps", "2", "--generations", "1", "--json",
        "--component", f"vae={tmp_path / 'vae.json'}",
    )  # fmt: skip
    assert code == 0
    vae = json.loads(out)["components"]["vae"]
    assert (vae["class"], vae["parameters"], vae["nbytes"]) == ("AutoencoderKL", expected, 2 * expected)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "--model", "flux-deev"], "Unknown model 'flux-deev'"),
        (["plan", "--model", "flux-dev", "--vram", "24 parsecs"], "Cannot read VRAM size"),
        (["plan", "--model", "flux-dev", "--vram", "0GiB"], "must be positive"),
        (["plan", "--model", "flux-dev", "--bandwidth", "fast"], "Cannot read bandwidth"),
        (["plan", "--model", "flux-dev", "--dtype", "transformer=fp7"], "Unknown dtype"),
        (["plan", "--model", "flux-dev", "--dtype", "unet=fp8"], "unknown components"),
        (["plan", "--model", "flux-dev", "--steps", "0"], "--steps"),
        (["plan", "--model", "/nonexistent/spec.json"], "Cannot read model spec"),
        (["plan"], "plan needs --model"),
        (["demo", "--generations", "0"], "--generations"),
    ],
)
def test_errors_exit_with_code_2(capsys, argv, message):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and message in err and out == ""
    code, out, err = run_cli(capsys, *argv, "--json")
    assert code == 2 and message in json.loads(out)["error"]


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
    spec.write_text(json.dumps({"components": {"x": {"class": "NoSuchModel", "config": {}}}, "tiny": "flux"}))
    code, _, err = run_cli(capsys, "plan", "--model", str(spec))
    assert code == 2 and "'NoSuchModel' is not in the installed diffusers" in err


def test_usage_errors_from_argparse_exit_with_code_2(capsys):
    with pytest.raises(SystemExit) as raised:
        cli.main([])
    assert raised.value.code == 2
    with pytest.raises(SystemExit) as raised:
        cli.main(["plan", "--steps", "many"])
    assert raised.value.code == 2


def test_the_process_exit_code(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run(
        [sys.executable, "-m", "diffusers_offload_ext.cli", "plan", "--model", "nope", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 2 and json.loads(done.stdout)["exit_code"] == 2


def test_parsers():
    assert parse_size("24GiB") == 24 * GiB and parse_size("24 GB") == 24 * 10**9 and parse_size("512MiB") == 1 << 29
    assert parse_size("1.5gib") == 3 * (1 << 29) and parse_size("24e9") == 24 * 10**9
    assert parse_bandwidth("12GB/s") == 12e9 and parse_bandwidth("1 GiB/s") == GiB and parse_bandwidth("12e9") == 12e9
    for bad in ("", "GiB", "12 parsecs", "-1GB", "1.2.3GB"):
        with pytest.raises(PlanError):
            parse_size(bad)


def test_demo(tmp_path, capsys):
    png = tmp_path / "demo.png"
    code, out, _ = run_cli(capsys, "demo", "--steps", "3", "--generations", "2", "--png", str(png), "--json")
    assert code == 0 and png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 10_000
    result = json.loads(out)
    configs = result["configurations"]
    assert set(configs) == {"stock", "exclude_transformer", "keep_during_generation"}
    # Stock with a preview: text encoders, the VAE once, the transformer at each of the 3 steps.
    assert configs["stock"]["onloads_per_generation"] == 6
    assert configs["exclude_transformer"]["onloads_per_generation"] == 3
    assert configs["keep_during_generation"]["onloads_per_generation"] == 4
    real = flux_bytes(transformer_bytes_per_parameter=1)
    others = sum(real.values()) - real["transformer"]
    assert configs["stock"]["flux_dev_fp8_bytes_per_generation"] == 2 * others + 2 * 3 * real["transformer"]
    assert configs["exclude_transformer"]["flux_dev_fp8_bytes_per_generation"] == 2 * others
    assert configs["exclude_transformer"]["flux_dev_fp8_bytes_at_enable"] == real["transformer"]
    assert configs["keep_during_generation"]["flux_dev_fp8_peak_bytes"] == sum(real.values())
    assert configs["stock"]["flux_dev_fp8_peak_bytes"] == real["transformer"] + real["vae"]
    assert all(c["fits_24gb"] for c in configs.values())
    code, out, _ = run_cli(capsys, "demo", "--steps", "2", "--generations", "1")
    assert code == 0 and "keep_on_device_during_generation=True" in out and "12 GB/s" in out
    assert not doe.is_installed()


def test_doctor(capsys, monkeypatch):
    code, out, _ = run_cli(capsys, "doctor", "--json")
    assert code == 0
    report = json.loads(out)
    assert set(report["versions"]) >= {"torch", "diffusers", "accelerate", "transformers"}
    assert report["plugin_installed"] is doe.is_installed()
    assert report["upstream_patch"] == {"exclude_from_offload": False, "keep_on_device_during_generation": False}

    def patched(self, gpu_id=None, device=None, *, exclude_from_offload=None, keep_on_device_during_generation=None):
        pass

    monkeypatch.setitem(_mixin.STOCK, "enable_model_cpu_offload", patched)
    doe.install()
    try:
        code, out, _ = run_cli(capsys, "doctor", "--json")
    finally:
        doe.uninstall()
    report = json.loads(out)
    assert report["plugin_installed"] is True
    assert report["upstream_patch"] == {"exclude_from_offload": True, "keep_on_device_during_generation": True}
    code, out, _ = run_cli(capsys, "doctor")
    assert code == 0 and "diffusers carries the patch" in out
