"""A pytest plugin for diffusers' own test suite: runs `test_model_cpu_offload_forward_pass` on the CPU (diffusers
marks it for accelerators only; with `device="cpu"` the offload machinery runs on the CPU) and, with
`FORCE_OFFLOAD_OPTION` set, with this package installed and one of its options forced into every
`enable_model_cpu_offload()` call that does not set it. Used by `tools/diffusers_own_tests.py`."""

import functools
import os

import pytest

#: Option name -> keyword arguments for a pipeline (computed per call).
OPTIONS = {
    "stock": None,
    "exclude": lambda pipe: {"exclude_from_offload": _first_model(pipe)},
    "keep_during": lambda pipe: {"keep_on_device_during_generation": True},
    "keep_between": lambda pipe: {"keep_on_device_between_generations": True},
    "budget": lambda pipe: {"memory_budget": max(_model_bytes(pipe) // 2, 1)},
}
ACCELERATOR_ONLY = "test requires a hardware accelerator"


def _models(pipe):
    import torch

    return {n: m for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}


def _first_model(pipe):
    chain = [n for n in (getattr(pipe, "model_cpu_offload_seq", None) or "").split("->") if n]
    models = _models(pipe)
    return [next((n for n in chain if n in models), next(iter(models)))]


def _model_bytes(pipe):
    return sum(t.numel() * t.element_size() for m in _models(pipe).values() for t in m.parameters())


def _force(method, option):
    @functools.wraps(method)
    def enable(self, *args, **kwargs):
        new = ("exclude_from_offload", "keep_on_device_during_generation", "memory_budget")
        new += ("keep_on_device_between_generations",)
        if not any(kwargs.get(k) is not None for k in new):
            kwargs.update(OPTIONS[option](self))
        return method(self, *args, **kwargs)

    return enable


def pytest_configure(config):
    option = os.environ.get("FORCE_OFFLOAD_OPTION", "stock")
    if option not in OPTIONS:
        raise pytest.UsageError(f"FORCE_OFFLOAD_OPTION={option!r}: choose one of {sorted(OPTIONS)}.")
    if option == "stock":
        return
    import diffusers

    import diffusers_offload_ext as doe

    doe.install()
    classes = [diffusers.DiffusionPipeline]
    for name in dir(diffusers):
        cls = getattr(diffusers, name, None) if name.endswith("Pipeline") else None
        if isinstance(cls, type) and "enable_model_cpu_offload" in vars(cls):
            classes.append(cls)
    for cls in dict.fromkeys(classes):
        setattr(cls, "enable_model_cpu_offload", _force(vars(cls)["enable_model_cpu_offload"], option))


def _accelerator_only(mark):
    return mark.name == "skipif" and mark.kwargs.get("reason") == ACCELERATOR_ONLY


def pytest_collection_modifyitems(config, items):
    """Lifts diffusers' accelerator-only skip from the offload test, where it is the test's own mark or its class's
    (the pipelines' `MemoryTesterMixin` carries it on the class); the class's other tests keep it."""
    for item in items:
        if not item.name.startswith("test_model_cpu_offload_forward_pass"):
            continue
        item.own_markers = [m for m in item.own_markers if not _accelerator_only(m)]
        for node in item.listchain()[:-1]:
            lifted = [m for m in node.own_markers if _accelerator_only(m)]
            if not lifted:
                continue
            node.own_markers = [m for m in node.own_markers if not _accelerator_only(m)]
            for other in items:
                if other is not item and node in other.listchain()[:-1]:
                    if not other.name.startswith("test_model_cpu_offload_forward_pass"):
                        other.own_markers.extend(lifted)
