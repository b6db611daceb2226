"""The first hour with the package (issue 20, item 9): a size or bandwidth written without its unit is refused with
the unit suggested, before anything changes; a reserve that leaves nothing of the card says nothing fits."""

import json
import os

import pytest

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: the CLI and the residency options")

import diffusers_offload_ext as doe  # noqa: E402
from diffusers_offload_ext import cli  # noqa: E402
from diffusers_offload_ext.testing import tiny  # noqa: E402
from diffusers_offload_ext.units import SizeError, check_unit  # noqa: E402

pytestmark = pytest.mark.plugin_only
GiB = 1 << 30


@pytest.mark.parametrize("value", [16, "16", " 16 ", 100.0, "12e3", (1 << 20) - 1])
def test_a_bare_number_under_a_mebibyte_is_refused_with_the_unit_suggested(value):
    with pytest.raises(SizeError, match=r"did you mean `'[0-9.e]+GiB'`"):
        check_unit(value, "--vram")


@pytest.mark.parametrize("value", [0, "0", 1 << 20, "1048576", "16GiB", "512KiB", "100B", "abc", True, None])
def test_a_unit_zero_or_a_mebibyte_and_more_pass(value):
    check_unit(value, "--vram")  # `parse_size` judges what is not a bare small number


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "argv, argument, suggestion",
    [
        (["--vram", "16"], "--vram", "'16GiB'"),
        (["--reserve", "3"], "--reserve", "'3GiB'"),
        (["--bandwidth", "12"], "--h2d-bandwidth", "'12GB/s'"),
        (["--pinned-bandwidth", "25"], "--pinned-bandwidth", "'25GB/s'"),
    ],
)
def test_plan_refuses_a_number_without_its_unit(capsys, argv, argument, suggestion):
    code, out, _ = run(capsys, "plan", "--model", "flux-dev", *argv, "--json")
    result = json.loads(out)
    assert code == 2 and result["argument"] == argument and f"did you mean `{suggestion}`" in result["error"]


def test_plan_with_the_units_written_runs(capsys):
    code, out, _ = run(capsys, "plan", "--model", "flux-dev", "--vram", "16GiB", "--bandwidth", "12GB/s", "--json")
    assert code == 0 and json.loads(out)["vram_bytes"] == 16 << 30


@pytest.mark.usefixtures("installed")
def test_a_memory_budget_text_without_its_unit_is_refused_before_anything_changes():
    pipe = tiny.build("sd15")
    with pytest.raises(ValueError, match=r"`memory_budget`: `16`: did you mean `'16GiB'`"):
        pipe.enable_model_cpu_offload(device="cpu", memory_budget="16")
    assert doe.offload_status(pipe).enabled is False
    assert not any(hasattr(m, "_hf_hook") for m in pipe.components.values())


def _traces():
    stock = tiny.build("flux")
    stock.enable_model_cpu_offload(device="cpu")  # stock diffusers: its moves are replayed
    ours = tiny.build("flux")
    doe.OffloadMixin.enable_model_cpu_offload(ours, device="cpu", keep_on_device_during_generation=True)
    traces = []
    for pipe in (stock, ours):
        with doe.trace(pipe) as recorded:
            tiny.run(pipe, "flux")
        traces.append(recorded)
    return traces


def test_trace_tables_are_readable_at_80_columns():
    import rich.console

    for recorded in _traces():
        for by in ("component", "call"):
            console = rich.console.Console(width=80, record=True, file=open(os.devnull, "w"))
            console.print(recorded.table(by=by))
            text = console.export_text()
            assert "…" not in text  # no header or cell cut
            assert max(len(line.rstrip()) for line in text.splitlines()) <= 80
            header = next(line for line in text.splitlines() if line.split()[:1] in (["component"], ["call"]))
            assert "onloaded" in header and "seconds" in header
            assert "text_encoder_2" in text or by == "call"


def test_plan_prices_the_recommended_budget_call_once_and_names_the_options_it_assumes(capsys):
    code, out, _ = run(capsys, "plan", "--model", "flux-dev", "--vram", "16GiB", "--json")
    result = json.loads(out)
    assert code == 0 and result["recommended"]["strategy"] == "residency"
    assert "pin_memory" not in result["recommended"]["call"] and "prefetch" not in result["recommended"]["call"]
    strategy = result["strategies"]["residency"]["seconds"]["first_generation_excluding_setup"]
    rows = result["block_residency"]["rows"]
    assert result["strategies"]["residency"]["setup_bytes"] == 0
    # The recommended call from pageable memory, priced the same in both tables (its first generation; no setup) ...
    assert rows["budget"]["seconds_first"] == pytest.approx(strategy, rel=1e-3)
    assert "pin_memory=False" in rows["budget"]["label"]
    # ... and as it runs on CUDA by default (page-locked, prefetch), a row of its own that says so.
    assert rows["budget_pinned"]["seconds_first"] < rows["budget"]["seconds_first"]
    assert "pin_memory" in rows["budget_pinned"]["label"] and "prefetch" in rows["budget_pinned"]["label"]
    assert "pin_memory=True, prefetch=True" in result["block_residency"]["assumptions"]["bandwidth"]


def test_the_demo_names_the_plan_of_its_own_model_and_dtypes(capsys):
    pytest.importorskip("transformers")
    code, out, _ = run(capsys, "demo", "--steps", "2", "--generations", "1", "--json")
    result = json.loads(out)
    command = result["plan_command"].split()
    assert code == 0 and command[:2] == ["diffusers-offload", "plan"]
    code, out, _ = run(capsys, *command[1:], "--json")
    planned = json.loads(out)
    assert code == 0 and {n: c["nbytes"] for n, c in planned["components"].items()} == result["real_sizes"]
    assert planned["vram_bytes"] == 24 << 30 and planned["preview"] is True


# -- round 2 (issue 34): one screen, the user's words, per-model defaults --------------------------------------------
SCREENS = [
    ["--model", "flux-dev", "--vram", "16GiB"],
    ["--model", "flux-dev", "--vram", "16GiB", "--step-seconds", "0.5", "--preview"],
    ["--model", "flux-dev", "--vram", "3GiB", "--reserve", "2.5GiB"],  # nothing fits
    ["--model", "flux-dev", "--vram", "16GiB", "--dtype", "transformer=nf4,text_encoder_2=int8"],
    ["--model", "sdxl", "--vram", "8GB"],
    ["--model", "sd3.5-large", "--vram", "24GiB"],
    ["--model", "wan2.1-t2v-14b", "--vram", "80GiB"],
    ["--model", "wan2.2-t2v-a14b", "--vram", "48GiB", "--frames", "33"],
]


@pytest.mark.parametrize("argv", SCREENS, ids=lambda a: " ".join(a[1:]))
def test_plan_fits_one_screen_at_80_columns_and_says_what_to_use(capsys, monkeypatch, argv):
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = run(capsys, "plan", *argv)
    lines = out.splitlines()
    assert code == 0 and len(lines) <= 30 and max(map(len, lines)) <= 80, (len(lines), out)
    result = json.loads(run(capsys, "plan", *argv, "--json")[1])
    text = " ".join(out.split())
    if result["recommended"] is None:
        assert "Nothing fits" in text
    else:
        call = " ".join(result["recommended"]["call"].split())
        assert "Use (" in text and call.replace(", ", ",") in text.replace(", ", ",")
        assert ("Per image:" in text or "Per video:" in text) and "GiB over the bus" in text
    assert "Runner-up (" in text
    assert text.count("Seconds") == 1  # what seconds mean, said once: copies alone, or with the compute
    assert ("--step-seconds" in argv) == ("denoiser forwards x 0.5 s" in text)
    assert "--details" in text and "Predicted transfers" not in text
    code, details, _ = run(capsys, "plan", *argv, "--details")
    assert code == 0 and "Predicted transfers" in details and ("Use (" in details) == bool(result["recommended"])


def test_the_one_screen_names_the_runner_up_and_the_pageable_call():
    result = plan_of("flux-dev", vram="16GiB", reserve="3GiB")
    summary = result["summary"]
    assert summary["use"]["strategy"] == result["recommended"]["strategy"] == "residency"
    assert summary["use"]["streams"]["transformer"]["kept"] == 20 and summary["use"]["fits"] == "yes"
    rows = result["block_residency"]["rows"]
    assert summary["use"]["seconds_per_image"] == rows["budget_pinned"]["seconds_steady"]  # the defaults on CUDA
    assert summary["use"]["pageable"]["seconds_per_image"] > summary["use"]["seconds_per_image"]
    # Nothing else fits 16 GiB: the runner-up is the one nearest to fitting (stock: the transformer alone).
    assert summary["runner_up"]["strategy"] == "stock" and summary["runner_up"]["fits"] == "no"
    assert summary["runner_up"]["peak_bytes"] == result["components"]["transformer"]["nbytes"]


def plan_of(model, **options):
    from diffusers_offload_ext.models import plan

    return plan(model, **options)


@pytest.mark.parametrize("typed", ["black-forest-labs/FLUX.1-dev", "black-forest-labs/flux.1-dev", "FLUX-DEV"])
def test_models_by_hub_id_in_any_case(capsys, typed):
    code, out, err = run(capsys, "plan", "--model", typed, "--vram", "16GiB", "--json")
    assert code == 0, err
    assert json.loads(out)["model"] == "flux-dev"
    code, out, _ = run(capsys, "plan", "--list")
    assert "black-forest-labs/FLUX.1-dev" in out and "Wan-AI/Wan2.2-T2V-A14B-Diffusers" in out


@pytest.mark.parametrize(
    "argv, argument, hint",
    [
        (["--model", "flux-dve"], "--model", "Did you mean 'flux-dev'?"),
        (["--model", "black-forest-labs/FLUX.1-schnel"], "--model", "Did you mean 'flux-schnell'?"),
        (["--model", "someone/else"], "--model", "nor its Hugging Face Hub id"),
        (["--model", "flux-dev", "--vram", "16G"], "--vram", "did you mean '16GiB'?"),
        (["--model", "flux-dev", "--vram", "512M"], "--vram", "did you mean '512MiB'?"),
        (["--model", "flux-dev", "--dtype", "transformer=nf5"], "--dtype", "did you mean 'nf4'?"),
        (["--model", "flux-dev", "--dtype", "transfomer=nf4"], "--dtype", "did you mean 'transformer'?"),
        (["--model", "flux-dev", "--frames", "33"], "--frames", "for video models"),
    ],
)
def test_mistyped_names_and_values_get_the_nearest_suggested(capsys, argv, argument, hint):
    code, out, _ = run(capsys, "plan", *argv, "--json")
    result = json.loads(out)
    assert code == 2 and result["argument"] == argument and hint in result["error"], result


@pytest.mark.parametrize("argv, hint", [(["plan", "--vam", "16GiB"], "did you mean --vram?"), (["plna"], "plan?")])
def test_mistyped_options_and_commands_get_the_nearest_suggested(capsys, argv, hint):
    code, _, err = run(capsys, *argv)
    assert code == 2 and hint in err


def test_a_card_in_gb_is_read_as_cards_are_sold(capsys):
    """Cards sold as 8 GB have 8 GiB: `--vram 8GB` plans the same card as `8GiB`, and says how it read it."""
    results = {}
    for vram in ("8GB", "8GiB"):
        code, out, _ = run(capsys, "plan", "--model", "sdxl", "--vram", vram, "--json")
        results[vram] = json.loads(out)
    assert results["8GB"]["vram_bytes"] == results["8GiB"]["vram_bytes"] == 8 << 30
    assert results["8GB"]["recommended"] == results["8GiB"]["recommended"]
    assert "cards sold as 8 GB have 8 GiB" in results["8GB"]["vram_note"] and results["8GiB"]["vram_note"] is None
    code, out, _ = run(capsys, "plan", "--model", "sdxl", "--vram", "8e9", "--json")
    assert json.loads(out)["vram_bytes"] == 8 * 10**9  # bytes as written
    code, out, _ = run(capsys, "plan", "--model", "sdxl", "--vram", "8GB")
    assert "read as 8 GiB" in " ".join(out.split())


def test_each_model_plans_its_own_steps_and_call_size():
    schnell, dev = plan_of("flux-schnell"), plan_of("flux-dev")
    assert (schnell["steps"], dev["steps"]) == (4, 28)
    assert schnell["call_trace"].count("transformer") == 4
    wan = plan_of("wan2.1-t2v-14b", vram="80GiB")
    assert wan["steps"] == 50 and wan["call_shape"] == {"height": 480, "width": 832, "frames": 81}
    assert plan_of("wan2.2-t2v-a14b", vram="80GiB")["steps"] == 40
    assert plan_of("flux-dev", steps=10)["steps"] == 10  # given: as given


def test_the_activations_are_estimated_for_the_call_size():
    dev = plan_of("flux-dev")
    small = plan_of("flux-dev", height=512, width=512)
    assert dev["activations"]["source"] == small["activations"]["source"] == "estimated"
    assert small["reserve_bytes"] < dev["reserve_bytes"]
    short = plan_of("wan2.1-t2v-14b", vram="80GiB", frames=33)
    full = plan_of("wan2.1-t2v-14b", vram="80GiB")
    # An 81-frame decode needs far more than the 3 GiB every model used to get, and more than 33 frames.
    assert full["reserve_bytes"] > short["reserve_bytes"] > 3 << 30
    assert full["activations"]["estimate"]["largest"] == "vae"
    # Given reserves and measured activations take precedence; a model spec without activation data gets 3 GiB.
    assert plan_of("flux-dev", reserve="1GiB")["reserve_bytes"] == 1 << 30
    assert plan_of("flux-dev", activations="4GiB")["activations"]["source"] == "activations"


def test_a_call_whose_estimated_activations_exceed_the_card_says_so(capsys):
    code, out, _ = run(capsys, "plan", "--model", "wan2.1-t2v-14b", "--vram", "24GiB", "--height", "720",
                       "--width", "1280", "--json")  # fmt: skip
    result = json.loads(out)
    assert code == 2 and "nothing fits" in result["error"] and "enable_tiling" in result["error"]


def test_the_readme_opens_with_a_24_gb_card_and_its_figures_are_the_plan_s():
    """The README's first example is FLUX.1-dev on a 24 GB card, and every figure it quotes is the plan's (issue 34,
    point 8); user docs cite no internal issue numbers."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text(encoding="utf-8")
    opening = readme[: readme.index("## Install")]
    assert re.search(r"```bash\n([^`]*)```", opening).group(1).split() == [
        "diffusers-offload", "plan", "--model", "black-forest-labs/FLUX.1-dev", "--vram", "24GiB",
    ]  # fmt: skip
    text = " ".join(opening.split())
    recommended = plan_of("flux-dev", vram="24GiB")
    assert 'memory_budget="20.7GiB"' in recommended["summary"]["use"]["call"] and '`memory_budget="20.7GiB"`' in text
    estimate = recommended["activations"]["estimate"]
    assert f"{recommended['reserve_bytes'] / GiB:.2f} GiB" in text and f"({estimate['bytes'] / GiB:.2f} GiB" in text
    used = plan_of("flux-dev", vram="24GiB", reserve="4GiB")  # the example's 20 GiB, as the README says
    use = used["summary"]["use"]
    assert 'memory_budget="20.0GiB"' in use["call"] and 'memory_budget="20GiB"' in opening
    stream = use["streams"]["transformer"]
    for figure in (
        f"{stream['kept']} of its {stream['blocks']}",
        f"{use['bytes_per_image'] / GiB:.2f} GiB over the bus",
        f"{use['seconds_per_image']:.2f} s of copies as it runs on CUDA by default",
        f"{use['pageable']['seconds_per_image']:.2f} s with `{use['pageable']['options']}`",
        f"{sum(c['nbytes'] for c in used['components'].values()) / GiB:.2f} GiB of weights",
        f"transformer ({used['components']['transformer']['nbytes'] / GiB:.2f} GiB)",
    ):
        assert figure in text, figure
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        assert not re.search(r"\bissues? \d", doc.read_text(encoding="utf-8"), re.I), doc.name
