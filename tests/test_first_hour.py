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
    strategy = result["strategies"]["residency"]["seconds_at_assumed_bandwidth"]["first_generation_excluding_setup"]
    rows = result["block_residency"]["rows"]
    assert result["strategies"]["residency"]["setup_bytes"] == 0
    # The recommended call, priced the same in both tables (its first generation; no setup here) ...
    assert rows["budget"]["seconds_first"] == pytest.approx(strategy, rel=1e-3)
    # ... and the same call with page-locking and prefetch, a row of its own that says so.
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
