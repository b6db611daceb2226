"""Shared fixtures. `--offload-impl=plugin` (default) tests stock diffusers + this package; `--offload-impl=patched`
tests a diffusers built with `patches/` applied and this package not installed."""

import os

import pytest
import torch

# One thread: on a shared 2-core machine two threads made tiny calls swing from 0.03 s to 4 s.
torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_addoption(parser):
    parser.addoption(
        "--offload-impl",
        action="store",
        default="plugin",
        choices=("plugin", "patched"),
        help="plugin: stock diffusers + diffusers_offload_ext; patched: diffusers with patches/ applied.",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "plugin_only: a feature of the plugin that the upstream patch does not have")
    impl = config.getoption("--offload-impl")
    if impl == "plugin":
        # Plugin-only test files skip themselves when the package is missing (that is the patched run); here it must
        # be there, so that no test is skipped for a broken install.
        import diffusers_offload_ext  # noqa: F401
    if impl == "patched":
        try:
            import diffusers_offload_ext  # noqa: F401
        except ImportError:
            pass
        else:
            raise pytest.UsageError(
                "--offload-impl=patched must run where diffusers_offload_ext is not importable (it would hide the "
                "patch). Use the patched virtualenv made by `make .venv-patched`."
            )
        import inspect

        from diffusers import DiffusionPipeline

        parameters = inspect.signature(DiffusionPipeline.enable_model_cpu_offload).parameters
        if "exclude_from_offload" not in parameters:
            raise pytest.UsageError("--offload-impl=patched needs a diffusers with patches/ applied.")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--offload-impl") != "patched":
        return
    skip = pytest.mark.skip(reason="plugin-only feature: not part of the upstream patch")
    for item in items:
        if "plugin_only" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def offload_impl(request):
    return request.config.getoption("--offload-impl")


@pytest.fixture(params=["cpu", "simulated"])
def accelerator(request):
    """Each test that asks for it runs twice: on the plain CPU (host and device are the same memory), and on the
    simulated accelerator, where `.to(device)` makes distinct tensors, tensors report where they are, and a layer
    that runs on host weights with device inputs fails as on CUDA (`diffusers_offload_ext/testing/`)."""
    if request.param == "cpu":
        yield None
        return
    from simulated_accelerator import SimulatedAccelerator

    with SimulatedAccelerator() as sim:
        yield sim


@pytest.fixture
def detected_device(offload_impl, monkeypatch):
    """`enable_model_cpu_offload()` without `device` (as diffusers' LoRA loaders call it) finds the execution device.

    The plugin reuses the device of the previous call. The patch keeps stock's detection, which finds no accelerator
    on these machines and raises: stand one in, the way an accelerator machine would answer."""
    if offload_impl == "patched":
        import diffusers.pipelines.pipeline_utils as pipeline_utils

        monkeypatch.setattr(pipeline_utils, "get_device", lambda: "cpu:0")


@pytest.fixture
def installed(offload_impl):
    """The new `enable_model_cpu_offload` arguments are available on every pipeline for the test's duration."""
    if offload_impl == "patched":
        yield None
        return
    import diffusers_offload_ext as doe

    doe.install()
    try:
        yield doe
    finally:
        doe.uninstall()
