"""A pytest plugin that runs each test of a suite inside the simulated accelerator, so that diffusers' own
`@require_accelerator` tests (the upstream patch series' placement tests, `test_model_cpu_offload_forward_pass`) run
on a machine without one: `cpu:0` holds tensors apart from the host `cpu`, a layer run on host weights with inputs on
`cpu:0` raises as on CUDA, and `module.device` says where the weights are.

    DIFFUSERS_TEST_DEVICE=cpu:0 PYTHONPATH=/path/to/this/repo/tools pytest -p simulated_accelerator_pytest ...

With `DIFFUSERS_TEST_DEVICE=cpu:0`, diffusers' `torch_device` is the simulated device, so `require_accelerator` lets
the tests run and `pipe.to(torch_device)` and `enable_model_cpu_offload(device=torch_device)` use it. The simulator is
loaded by path, as the shared test suite loads it: this package need not be installed.
"""

import importlib.util
import pathlib

import pytest

_PATH = pathlib.Path(__file__).resolve().parent.parent / "tests" / "simulated_accelerator.py"
_SPEC = importlib.util.spec_from_file_location("_simulated_accelerator_for_pytest", _PATH)
_MODULE = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_MODULE)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test, its fixtures' setup and teardown included, inside a fresh simulated accelerator."""
    with _MODULE.SimulatedAccelerator():
        yield
