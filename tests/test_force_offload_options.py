"""`tools/force_offload_options.py`, the pytest plugin behind `tools/diffusers_own_tests.py`: it lifts diffusers'
accelerator-only skip from the offload test, whether the test carries it or its class does (diffusers' pipelines'
`MemoryTesterMixin` marks the whole class), and leaves it on the class's other tests and every other skip."""

import pathlib
import subprocess
import sys

TOOLS = pathlib.Path(__file__).resolve().parent.parent / "tools"

MODULE = """
import pytest

ACCELERATOR_ONLY = pytest.mark.skipif(True, reason="test requires a hardware accelerator")


@ACCELERATOR_ONLY
class TestPipelineMemory:
    def test_model_cpu_offload_forward_pass(self):
        pass

    def test_sequential_cpu_offload_forward_pass(self):
        pass


class TestPipelineFast:
    @ACCELERATOR_ONLY
    def test_model_cpu_offload_forward_pass(self):
        pass

    @ACCELERATOR_ONLY
    def test_group_offload(self):
        pass


class TestPipelineOtherReason:
    @pytest.mark.skipif(True, reason="needs a package")
    def test_model_cpu_offload_forward_pass(self):
        pass
"""


def test_the_offload_test_runs_on_the_cpu_and_every_other_skip_stays(tmp_path):
    (tmp_path / "test_pipeline.py").write_text(MODULE)
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "force_offload_options", "-rA", "-q"]
    env = {"PYTHONPATH": str(TOOLS), "FORCE_OFFLOAD_OPTION": "stock", "PATH": ""}
    done = subprocess.run(command + ["test_pipeline.py"], cwd=tmp_path, env=env, capture_output=True, text=True)
    outcomes = {
        line.split()[1].split("::", 1)[1]: line.split()[0]
        for line in done.stdout.splitlines()
        if line.startswith(("PASSED ", "SKIPPED ", "FAILED ")) and "::" in line
    }
    skipped = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED")]
    assert outcomes == {
        "TestPipelineMemory::test_model_cpu_offload_forward_pass": "PASSED",
        "TestPipelineFast::test_model_cpu_offload_forward_pass": "PASSED",
    }, done.stdout
    assert len(skipped) == 3 and sum("needs a package" in line for line in skipped) == 1, done.stdout
