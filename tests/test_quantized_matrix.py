"""Every quantization backend under every offload option (issue 20, "Done when"), on the plain CPU and the simulated
accelerator, in `make test-quant`'s venv: the tiny FLUX pipeline reloaded quantized (`testing/quantized.py`), called
twice; images equal to the same pipeline without offload, `offload_status` and every whole-component ledger record
within 1 % of the true storage bytes, and no "does not fit" where everything fits.
"""

import logging

import pytest
import torch

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: the residency options")

import diffusers_offload_ext as doe  # noqa: E402
from diffusers_offload_ext.storages import tensor_parts  # noqa: E402
from diffusers_offload_ext.testing import quantized, tiny  # noqa: E402

pytestmark = [pytest.mark.plugin_only, pytest.mark.usefixtures("installed")]
NAME = "flux"
BELOW, TOTAL = "below", "total"  # replaced by 0.8x the quantized transformer's bytes / 1.2x every component's

OPTIONS = {
    "defaults": {},
    "exclude": {"exclude_from_offload": ["transformer"]},
    "keep-during": {"keep_on_device_during_generation": True},
    "keep-between-budget": {"keep_on_device_between_generations": True, "memory_budget": "1GiB"},
    "zero-copy": {"zero_copy_eviction": True},
    "pin-auto": {"pin_memory": "auto"},
    "budget-below": {"memory_budget": BELOW, "keep_on_device_between_generations": True},
    "budget-1.2x": {"memory_budget": TOTAL, "keep_on_device_between_generations": True},
}
#: Every option, on both accelerators, per backend. bitsandbytes 8-bit components cannot move: they stay where they
#: were loaded, shown in `offload_status` with the role "cannot move" and counted against the budget.
PASSING = {backend: tuple(OPTIONS) for backend in quantized.BACKENDS}
#: Backends whose transformer streams under a budget below it: every one that can move (8-bit cannot).
STREAMING = {"nf4", "fp4", "gguf", "torchao", "quanto", "layerwise"}


def cells():
    for backend, options in PASSING.items():
        ok, why = quantized.available(backend)
        for option in options:
            for where in ("cpu", "simulated"):
                marks = () if ok else pytest.mark.skip(reason=why)
                yield pytest.param(backend, option, where, id=f"{backend}-{option}-{where}", marks=marks)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return quantized.save(str(tmp_path_factory.mktemp("tiny-flux")))


class Messages(logging.Handler):
    def __init__(self):
        super().__init__()
        self.texts = []

    def emit(self, record):
        self.texts.append(record.getMessage())


@pytest.fixture
def messages():
    handler = Messages()
    logger = logging.getLogger("diffusers.diffusers_offload_ext")  # where our loggers are (under diffusers)
    logger.addHandler(handler)
    try:
        yield handler.texts
    finally:
        logger.removeHandler(handler)


_REFERENCES = {}


def reference(backend, saved, device):
    """The image of the quantized pipeline without offload, on the plain CPU or all on the simulated device."""
    key = (backend, device is not None)
    if key not in _REFERENCES:
        pipe = quantized.load(backend, saved, device=device)
        if device is not None:
            pipe.to(device)
        _REFERENCES[key] = tiny.run(pipe, NAME)
    return _REFERENCES[key]


def resolved(options, sizes):
    budget = options.get("memory_budget")
    if budget == BELOW:
        return {**options, "memory_budget": f"{int(sizes['transformer'] * 0.8)}B"}
    if budget == TOTAL:
        return {**options, "memory_budget": f"{int(sum(sizes.values()) * 1.2)}B"}
    return options


def within(measured, true):
    return abs(measured - true) <= 0.01 * true


@pytest.mark.parametrize("backend, option, where", list(cells()))
def test_every_backend_under_every_option(saved, messages, backend, option, where):
    from diffusers_offload_ext.testing.simulated_accelerator import SimulatedAccelerator

    context = SimulatedAccelerator() if where == "simulated" else _Plain()
    with context as sim:
        device = sim.device if sim is not None else None
        expected = reference(backend, saved, device)
        pipe = quantized.load(backend, saved, device=device)
        sizes = {n: doe.module_nbytes(m) for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
        pipe.enable_model_cpu_offload(device="cpu", **resolved(OPTIONS[option], sizes))
        calls = 2 if option.startswith(("keep-between", "budget")) else 1  # the second call: what stays moves nothing
        images = [tiny.run(pipe, NAME) for _ in range(calls)]
        assert all(torch.equal(image, expected) for image in images)
        status = doe.offload_status(pipe).components
        assert set(sizes) <= set(status)
        assert {n: c.nbytes for n, c in status.items()} == pytest.approx({n: sizes[n] for n in status}, rel=0.01)
        for record in doe.transfer_ledger(pipe).records:
            if record.block is None:
                assert within(record.nbytes, sizes[record.component]), record
        if option == "budget-below" and backend in STREAMING:
            streamed = [r for r in doe.transfer_ledger(pipe).records if r.block is not None]
            assert streamed, "the transformer did not stream"
            if sim is not None:  # every byte home after a release, quantization state included
                doe.release(pipe)  # (kept between calls, the blocks it keeps stay until then)
                tensors = [*pipe.transformer.parameters(), *pipe.transformer.buffers()]
                assert not [part for t in tensors for part in tensor_parts(t) if sim.is_on_device(part)]
        if option == "budget-1.2x":
            assert not [text for text in messages if "does not fit" in text]
            assert [r for r in doe.transfer_ledger(pipe).records if r.call_index == 1] == []


class _Plain:
    def __enter__(self):
        return None

    def __exit__(self, *exc_info):
        return None
