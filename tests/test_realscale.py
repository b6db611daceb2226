"""`benchmarks/realscale.py`, the real-size GPU benchmark: its code run at tiny scale on the CPU (the times are not
figures; the rows, the bytes and the ratios are checked), the real scale without CUDA, and bad options."""

import importlib.util
import json
import pathlib

import pytest

pytestmark = pytest.mark.plugin_only

PATH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "realscale.py"


@pytest.fixture(scope="module")
def realscale():
    pytest.importorskip("diffusers_offload_ext", reason="plugin-only: the benchmark drives the plugin")
    spec = importlib.util.spec_from_file_location("realscale", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_run(realscale, tmp_path_factory):
    """One tiny-scale run of flux-dev: `(exit status, stdout, written page, install state before, after)`."""
    import diffusers_offload_ext as doe

    written = tmp_path_factory.mktemp("realscale") / "table.md"
    before = doe.is_installed()
    out = _Capture()
    with out:
        status = realscale.main(["--scale", "tiny", "--model", "flux-dev", "--json", "--write", str(written)])
    return status, out.text, written.read_text(encoding="utf-8"), before, doe.is_installed()


class _Capture:
    """stdout of the block (capsys is function-scoped; the run is shared by the module's tests)."""

    def __enter__(self):
        import contextlib
        import io

        self.buffer = io.StringIO()
        self.redirect = contextlib.redirect_stdout(self.buffer)
        self.redirect.__enter__()

    def __exit__(self, *exc):
        self.redirect.__exit__(*exc)
        self.text = self.buffer.getvalue()


def _rows(tiny_run) -> dict:
    return {row["key"]: row for row in json.loads(tiny_run[1])["rows"]}


def test_tiny_run_is_one_json_document_with_every_configuration(realscale, tiny_run):
    status, text, page, before, after = tiny_run
    assert status == 0 and before == after
    result = json.loads(text)  # the whole of stdout: one document
    assert [row["key"] for row in result["rows"]] == [config.key for config in realscale.CONFIGS]
    assert realscale.TINY_NOTE in result["header"]["notes"] and "not benchmark figures" in page
    assert result["header"]["command"].startswith(
        "python benchmarks/realscale.py --scale tiny --model flux-dev --json"
    )
    for row in result["rows"]:
        assert row["status"] in ("ok", "skipped"), row
        assert f"`{row['label']}`" in page
    skipped = {row["key"]: row["reason"] for row in result["rows"] if row["status"] == "skipped"}
    assert set(skipped) == {
        "pinned-zero-copy",
        "pinned-keep",
        "pinned-residency-budget-prefetch",
        "stream-16GiB-prefetch",  # page-locked memory: CUDA only
        "stream-8GiB-prefetch",
        "sequential",
        "group",
        "mm-auto",  # diffusers-mm: not installed here (and CUDA only)
        "mm-block-pin",
    }
    assert "CPU" in skipped["pinned-keep"] and "--sequential" in skipped["sequential"]
    assert "diffusers-mm" in skipped["mm-auto"]
    assert "CPU" in skipped["group"] or "has no DiffusionPipeline.enable_group_offload" in skipped["group"]


def test_rows_below_the_denoiser_are_the_26_gib_row_with_a_smaller_budget_read_against_peak_memory(tiny_run):
    from diffusers_offload_ext.units import parse_size

    rows = _rows(tiny_run)
    budgets = {key: row["budget_bytes"] for key, row in rows.items()}
    assert budgets["residency-budget"] == budgets["pinned-residency-budget-prefetch"] == parse_size("26GiB")
    assert (budgets["stream-16GiB-prefetch"], budgets["stream-8GiB-prefetch"]) == (16 << 30, 8 << 30)
    assert {key for key, nbytes in budgets.items() if nbytes is None} == set(rows) - {
        "residency-budget",
        "pinned-residency-budget-prefetch",
        "stream-16GiB-prefetch",
        "stream-8GiB-prefetch",
    }
    template = rows["pinned-residency-budget-prefetch"]["label"]
    for budget in ("16GiB", "8GiB"):  # the same call as the 26 GiB row, only the budget differs
        assert rows[f"stream-{budget}-prefetch"]["label"] == template.replace("'26GiB'", f"'{budget}'")
    page = tiny_run[2]
    assert "| peak allocated | memory budget |" in page and "| 26.00 GiB |" in page


def test_tiny_run_bytes_follow_each_configuration(tiny_run):
    rows = _rows(tiny_run)
    moved = {key: row["moved_steady_bytes"] for key, row in rows.items() if row["status"] == "ok"}
    assert moved["no-offload"] == 0 and moved["residency-fits"] == 0 and moved["residency-budget"] == 0
    assert 0 < moved["exclude"] < moved["stock"] and moved["keep"] == moved["stock"] == moved["default"]
    assert 2 * moved["zero-copy"] == moved["stock"] and rows["zero-copy"]["dropped_steady_bytes"] == moved["zero-copy"]
    assert 2 * moved["zero-copy-exclude"] == moved["exclude"]
    assert rows["exclude"]["moved_first_bytes"] > moved["exclude"]  # the denoiser's one onload at enable time
    assert (
        rows["stock"]["bytes_source"].startswith("doe.trace") and rows["exclude"]["bytes_source"] == "transfer ledger"
    )


def test_tiny_run_ratios_come_from_the_same_run(tiny_run):
    rows = _rows(tiny_run)
    base = rows["no-offload"]["median_s"]
    for row in rows.values():
        if row["status"] == "ok":
            assert len(row["seconds"]) == 2 and row["first_s"] == row["seconds"][0]
            assert row["steady_s"] == [min(row["seconds"][1:]), max(row["seconds"][1:])]
            assert row["median_s"] == row["seconds"][1]  # one steady call here; three at real scale
            assert row["ratio"] == pytest.approx(row["median_s"] / base)
            floor = base + row["onload_steady_bytes"] / 54e9  # --floor-rate: the H200's page-locked rate
            assert row["floor_s"] == pytest.approx(floor) and row["floor_ratio"] == pytest.approx(
                row["median_s"] / floor
            )
            assert row["peak_allocated_bytes"] is None  # no CUDA: no peak to report


def test_tiny_run_bytes_equal_separate_runs(realscale, tiny_run):
    """Stock's bytes equal `doe.trace` of stock offload on its own; `exclude`'s the ledger of its own pipeline."""
    import diffusers_offload_ext as doe
    from diffusers_offload_ext.testing import tiny

    rows = _rows(tiny_run)
    with realscale.stock_diffusers():
        stock = tiny.build("flux")
        stock.enable_model_cpu_offload(device="cpu")
        with doe.trace(stock) as trace:
            tiny.run(stock, "flux")
        ours = type("OffloadFlux", (doe.OffloadMixin, type(stock)), {})(**tiny.build("flux").components)
        ours.enable_model_cpu_offload(device="cpu", exclude_from_offload=["transformer"])
        tiny.run(ours, "flux")
        tiny.run(ours, "flux")
    assert rows["stock"]["moved_steady_bytes"] == trace.summary()["total"]["total_bytes"] > 0
    assert rows["exclude"]["moved_steady_bytes"] == doe.transfer_ledger(ours).summary()["per_call"][1]["total_bytes"]


def test_real_scale_without_cuda_measures_nothing(realscale, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the real benchmark would run")
    assert realscale.main(["--model", "flux-dev"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("No CUDA GPU here: nothing measured") and out.count("\n") == 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "nope"], "argument --model: invalid choice: 'nope' (choose from 'flux-dev', 'flux-schnell'"),
        (["--calls", "0"], "argument --calls: must be 2 to 20 (the first call is reported apart"),
        (["--height", "100"], "argument --height: must be a multiple of 16, got 100"),
        (["--budget", "lots"], "argument --budget: 'lots' is not a number of bytes"),
        (["--only", "stock,nope"], "argument --only: unknown configuration(s) ['nope']; valid: no-offload, stock,"),
    ],
)
def test_bad_options_exit_2_naming_them(realscale, capsys, argv, message):
    with pytest.raises(SystemExit) as done:
        realscale.main(argv)
    assert done.value.code == 2 and message in capsys.readouterr().err


def test_only_runs_the_chosen_rows_in_the_tables_order_and_writes_after_each(realscale, tmp_path, monkeypatch):
    out = tmp_path / "rows.json"
    seen = []  # the rows the JSON file held when each row was measured
    measure = realscale.measure

    def watched(base, config, *args):
        seen.append([r["key"] for r in json.loads(out.read_text())["rows"]] if out.exists() else None)
        if config.key == "keep":
            raise KeyboardInterrupt  # the run is stopped, as a time-out stops it
        return measure(base, config, *args)

    monkeypatch.setattr(realscale, "measure", watched)
    argv = ["--scale", "tiny", "--only", "keep,stock,no-offload", "--json-out", str(out)]
    with _Capture(), pytest.raises(KeyboardInterrupt):
        realscale.main(argv)
    assert seen == [None, ["no-offload"], ["no-offload", "stock"]]  # the table's order, each row written as it ended
    assert [r["key"] for r in json.loads(out.read_text())["rows"]] == ["no-offload", "stock"]


def test_the_gpu_check_runs_end_to_end_at_tiny_scale(tmp_path):
    """`tools/gpu_check.sh` without CUDA: every part runs and says so, the benchmark at tiny scale, within its limit,
    and its results are where the device tool brings files back from (at most 8 files)."""
    import os
    import subprocess
    import sys

    script = PATH.parent.parent / "tools" / "gpu_check.sh"
    env = {**os.environ, "PYTHON": sys.executable, "SCALE": "tiny", "ROWS": "no-offload,stock"}
    done = subprocess.run(["bash", str(script), str(tmp_path), "300"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["env.txt", "logs.txt", "realscale.json", "realscale.md", "summary.txt"] and len(files) <= 8
    summary = (tmp_path / "summary.txt").read_text()
    parts = ["probe-pagelock", "probe-pools", "probe-bandwidth", "probe-mapped", "probe-fingerprint", "probe-tiny"]
    for part in parts + ["cuda-tests", "realscale"]:
        assert f"{part}: exit 0" in summary, summary
    assert [r["key"] for r in json.loads((tmp_path / "realscale.json").read_text())["rows"]] == ["no-offload", "stock"]
    assert "No CUDA GPU here: nothing probed." in (tmp_path / "logs.txt").read_text()


def test_a_row_after_a_peer_whose_hooks_stay_is_not_run_and_says_how_to_run_it(realscale, monkeypatch):
    """Group offloading and diffusers-mm leave hooks that cannot be removed: a row after one of them is reported "not
    run", naming the command that runs it in its own process beside no offload."""
    configs = tuple(c for c in realscale.CONFIGS if c.key in ("group", "mm-auto"))
    monkeypatch.setattr(realscale, "selected", lambda args: configs)

    def measure(base, config, *rest):
        assert config.key == "group", f"{config.key} measured after a peer whose hooks stay"
        return {"key": config.key, "label": "group", "status": "ok"}

    monkeypatch.setattr(realscale, "measure", measure)
    args = realscale.parse(["--scale", "tiny"])
    rows = realscale.measure_all(None, {"denoisers": ["transformer"]}, args, None, None)
    assert [r["status"] for r in rows] == ["ok", "not run"]
    assert "--only no-offload,mm-auto" in rows[-1]["reason"]
