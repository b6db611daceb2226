"""`diffusers-offload doctor` after a plain `pip install .` (issue 20, the first hour): transformers is not a
requirement, so doctor runs without it. The test starts a Python that cannot import transformers (its site-packages
seen through a folder that leaves out transformers and peft, which needs it and is not a requirement either) and runs
doctor there."""

import json
import os
import pathlib
import site
import subprocess
import sys

import pytest

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: the CLI")

pytestmark = pytest.mark.plugin_only
ROOT = pathlib.Path(__file__).resolve().parent.parent


def without(tmp_path, packages) -> str:
    """A folder holding links to everything in this interpreter's site-packages but `packages`."""
    folder = tmp_path / "site"
    folder.mkdir()
    for directory in site.getsitepackages():
        for entry in pathlib.Path(directory).iterdir():
            if entry.name.split("-")[0].split(".")[0] in packages or (folder / entry.name).exists():
                continue
            (folder / entry.name).symlink_to(entry)
    return str(folder)


def test_doctor_runs_without_transformers(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), without(tmp_path, ("transformers", "peft"))])}
    script = "import importlib.util, sys; assert importlib.util.find_spec('transformers') is None; "
    script += "from diffusers_offload_ext.cli import main; sys.exit(main(['doctor', '--json']))"
    done = subprocess.run([sys.executable, "-S", "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:] + done.stdout[-2000:]
    report = json.loads(done.stdout)
    assert report["demo"]["ready"] is False and report["demo"]["missing"] == "transformers"
    overrides = report["install_would"]["own_enable_model_cpu_offload"]
    assert overrides["AudioLDM2Pipeline"].startswith("not importable here")
