"""`benchmarks/realscale.py`: the real-size GPU benchmark's code, run at tiny scale on the CPU (its times are not
figures); without CUDA the real scale says so and exits 0; bad input exits 2 naming the option."""

import importlib.util
import json
import pathlib

import pytest

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: the benchmark drives the plugin")
pytestmark = pytest.mark.plugin_only

PATH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "realscale.py"


@pytest.fixture(scope="module")
def realscale():
    spec = importlib.util.spec_from_file_location("realscale", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_scale_runs_every_configuration(realscale, capsys, tmp_path):
    import diffusers_offload_ext as doe

    was_installed = doe.is_installed()
    written = tmp_path / "table.md"
    assert realscale.main(["--scale", "tiny", "--calls", "2", "--json", "--write", str(written)]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = result["rows"]
    assert list(rows) == list(realscale.CONFIGS)
    assert rows["no offload"]["moved_bytes"] == 0 and rows["no offload"]["ratio_to_no_offload"] == 1.0
    assert 0 < rows["exclude denoiser"]["moved_bytes"] < rows["stock"]["moved_bytes"]
    assert 0 < rows["defaults, eviction without copies"]["moved_bytes"] < rows["stock"]["moved_bytes"]
    for name, row in rows.items():
        if "skipped" in row:
            assert row["skipped"] == "needs CUDA", name  # on the CPU: page-locking, prefetch, group offloading
        else:
            assert row["ratio_to_no_offload"] == pytest.approx(row["steady_s"][0] / rows["no offload"]["steady_s"][0])
    assert "not benchmark figures" in result["header"]["note"] and "not benchmark figures" in written.read_text()
    if was_installed:  # the benchmark uninstalls the extension between configurations
        doe.install()


def test_real_scale_without_cuda_measures_nothing(realscale, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the real benchmark would run")
    assert realscale.main(["--model", "flux-dev"]) == 0
    assert "No CUDA GPU here: nothing measured" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [(["--calls", "0"], "`--calls` must be 1 to 20, got 0"), (["--model", "nope"], "invalid choice: 'nope'")],
)
def test_bad_input_exits_2(realscale, capsys, argv, message):
    with pytest.raises(SystemExit) as done:
        realscale.main(argv)
    assert done.value.code == 2 and message in capsys.readouterr().err
