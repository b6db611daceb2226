"""The planner prices seconds from measured rates (issue 31): the shipped profile of the H200 runs
(`docs/gpu-runs/2026-11-26-h200`), the user's own written by `doctor --measure` and read by `plan --profile`. Its
seconds are compared with the committed runs' own: each row's time per steady call less no offload's, in the same
run."""

import json
import pathlib

import pytest

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: the planner")

from diffusers_offload_ext.cli import main  # noqa: E402
from diffusers_offload_ext.models import PlanError, load_profile, plan, shipped_profiles  # noqa: E402

pytestmark = pytest.mark.plugin_only
RUNS = pathlib.Path(__file__).resolve().parent.parent / "docs" / "gpu-runs" / "2026-11-26-h200"
#: Within this share of the measured seconds (issue 31).
TOLERANCE = 0.30


def measured_transfers(run: str, key: str) -> float:
    """Seconds of a row's steady call above no offload's, in the committed run `run`."""
    rows = {row["key"]: row for row in json.loads((RUNS / f"{run}-realscale.json").read_text())["rows"]}
    return rows[key]["steady_s"][0] - rows["no-offload"]["steady_s"][0]


@pytest.fixture(scope="module")
def plans():
    """FLUX.1-dev at 10 steps, two generations (the runs' two calls), on cards whose budget is each run's."""
    return {
        vram: plan("flux-dev", steps=10, generations=2, vram=vram, reserve="3GiB", height=512, width=512)
        for vram in ("29GiB", "19GiB", "11GiB")
    }


def later(entry: dict, fast: bool = False) -> float:
    return entry["seconds_fast_paths" if fast else "seconds"]["later_generation_mean"]


def test_the_planner_prices_the_committed_runs_within_30_percent(plans):
    """Stock at 10 steps: 24.4 s of transfers measured, 23.1 s priced (the plan said 5.6 s at its old assumed
    12 GB/s); the residency manager at 26 GiB, pageable and page-locked with prefetch; the 16 and 8 GiB streams."""
    strategies = plans["29GiB"]["strategies"]
    priced = {
        ("run1", "stock"): later(strategies["stock"]),
        ("run2", "keep"): later(strategies["keep_during_generation"]),
        ("run1", "residency-budget"): later(strategies["residency"]),
        ("run1", "stream-16GiB-prefetch"): plans["19GiB"]["block_residency"]["rows"]["budget_pinned"][
            "seconds_steady"
        ],
        ("run1", "stream-8GiB-prefetch"): plans["11GiB"]["block_residency"]["rows"]["budget_pinned"]["seconds_steady"],
    }
    assert strategies["residency"]["budget_bytes"] == 26 << 30
    ratios = {key: seconds / measured_transfers(*key) for key, seconds in priced.items()}
    assert all(abs(ratio - 1) <= TOLERANCE for ratio in ratios.values()), ratios
    assert 22 <= priced[("run1", "stock")] <= 26


def test_what_the_planner_does_not_price_within_30_percent_stays_as_documented(plans):
    """Known misses (docs/benchmarks-gpu.md): exclusion's steady call moved T5 back at about 3.8 GB/s in run 2, twice
    the probed `module.to("cpu")` rate the profile holds, so the plan is pessimistic there; group offloading's time
    is not its bytes at the page-locked rate (it waits at every group), so the plan is optimistic there. The runs
    measured the residency manager deciding component by component; the plan replays it deciding block by block
    (fewer bytes): at 26 GiB with page-locking and prefetch it is below the run by more than 30 %."""
    exclude = later(plans["29GiB"]["strategies"]["exclude_denoiser"]) / measured_transfers("run2", "exclude")
    group = plans["19GiB"]["block_residency"]["rows"]["group"]["seconds_steady"] / measured_transfers("run1", "group")
    assert 1.3 < exclude < 2.0 and 0.3 < group < 0.7
    residency = plans["29GiB"]["strategies"]["residency"]
    blocks = later(residency, fast=True) / measured_transfers("run2", "pinned-residency-budget-prefetch")
    assert 0.5 < blocks < 1.0


def test_the_shipped_profile_is_the_runs_rates_and_a_bad_one_is_refused(tmp_path):
    h200 = load_profile("h200")
    assert "h200" in shipped_profiles() and h200.measured
    assert (h200.h2d_pageable, h200.d2h_fresh, h200.h2d_page_locked) == (6.3e9, 1.9e9, 54e9)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"h2d_pageable": 0, "d2h_fresh": 1e9}))
    with pytest.raises(PlanError, match="`h2d_pageable` must be bytes per second"):
        load_profile(str(bad))
    with pytest.raises(PlanError, match="neither a shipped profile"):
        load_profile(str(tmp_path / "missing.json"))


def test_doctor_measure_writes_a_profile_that_plan_profile_reads(tmp_path, capsys, monkeypatch):
    """`doctor --measure PATH` writes what it measured (here the measurement stands in for a CUDA device's) as a rate
    profile; `plan --profile PATH` prices with it: stock's seconds follow its rates."""
    from diffusers_offload_ext.cli import doctor

    rates = {"h2d_pageable": 25e9, "d2h_fresh": 5e9, "h2d_page_locked": 50e9, "d2h_page_locked": 50e9}
    measured = {"measured": True, "device": "cuda:0", "name": "a test card", **rates}
    monkeypatch.setattr(doctor, "_bandwidth", lambda accelerators, measure: measured)
    path = tmp_path / "mine.json"
    assert main(["doctor", "--measure", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["profile"]["written"] == str(path)
    assert main(["plan", "--model", "flux-dev", "--steps", "10", "--profile", str(path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    stock = result["strategies"]["stock"]
    moved = stock["h2d_bytes_including_setup"], stock["d2h_bytes_including_setup"]
    generations = result["generations"]
    assert stock["seconds"]["mean_per_generation_including_setup"] == pytest.approx(
        (moved[0] / 25e9 + moved[1] / 5e9) / generations
    )
    assert result["bandwidth"]["profile"] == "cuda:0" and result["bandwidth"]["assumed"] is False


def test_doctor_measure_without_a_cuda_device_writes_nothing_and_says_why(tmp_path, capsys):
    path = tmp_path / "mine.json"
    code = main(["doctor", "--measure", str(path), "--no-bandwidth", "--json"])
    report = json.loads(capsys.readouterr().out)
    if report["bandwidth"]["measured"]:
        pytest.skip("a CUDA device is here: it measured")  # not on the CPU machines of the suite
    assert code == 1 and not path.exists() and "no CUDA device" in report["profile"]["reason"]
