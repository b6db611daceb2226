"""The transfer ledgers of a representative subset of tiny pipeline x scenario x option set are exactly the ones
recorded for the same execution device (by `tests/tools/record_ledgers.py`, public API only): on the plain CPU
`tests/data/ledgers-baseline.json`, recorded before the runtime's refactoring, on the simulated accelerator
`tests/data/ledgers-baseline-simulated.json` (its default evictions drop unchanged components instead of copying them
back, issue 31): every record (component, direction, bytes, call index, kind) in order, the components hooked
at the end and the images' shape. The images' checksum is not compared (not bit-stable across runs). The baseline's
`step` is null everywhere (it was filled only while tracing); now the call tracker fills it always, and
`test_steps_are_filled_without_a_trace` checks that instead.

The baseline was recorded with diffusers 0.42.1; the old stack (diffusers 0.32.2, accelerate 1.6) records the same
ledgers for every pipeline it has (all but Wan). Should a diffusers version ever record different ones for a real
reason, record them into `ledgers-baseline[-simulated]-diffusers-<version>.json`: that file is then used for that
version.

Re-record both devices (about 80 s): `PYTHONPATH=. python tests/tools/record_ledgers.py`.
"""

import importlib.util
import pathlib
import sys

import pytest
import tiny_pipelines as tiny

_path = pathlib.Path(__file__).resolve().parent / "tools" / "record_ledgers.py"
_spec = importlib.util.spec_from_file_location("record_ledgers", _path)
record_ledgers = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("record_ledgers", record_ledgers)
_spec.loader.exec_module(record_ledgers)

DATA = pathlib.Path(__file__).resolve().parent / "data"
#: Each pipeline once with a preview-decoding callback under stock semantics, and every option set on three calls
#: of a transformer pipeline and a UNet pipeline with two text encoders.
SUBSET = [(name, "preview", "stock") for name in tiny.PIPELINES] + [
    (name, "three_calls", option) for name in ("flux", "sdxl") for option in record_ledgers.OPTIONS
]
_baselines = {}


def device_of(accelerator) -> str:
    """The baseline's device for the `accelerator` fixture's value."""
    return "plain" if accelerator is None else "simulated"


def baseline_path(device: str) -> pathlib.Path:
    import diffusers

    return record_ledgers.baseline_file(device, diffusers.__version__)


def baseline(device: str) -> dict:
    path = baseline_path(device)
    if path not in _baselines:
        _baselines[path] = record_ledgers.load(path)
    return _baselines[path]


def cases():
    for name, scenario, option in SUBSET:
        ok, reason = tiny.available(name)
        marks = [] if ok else [pytest.mark.skip(reason=reason)]
        yield pytest.param(name, scenario, option, marks=marks, id=record_ledgers.key(name, scenario, option))


@pytest.mark.plugin_only
@pytest.mark.parametrize("name, scenario, option", list(cases()))
def test_ledger_equals_the_baseline(installed, accelerator, name, scenario, option):
    key, device = record_ledgers.key(name, scenario, option), device_of(accelerator)
    expected = baseline(device).get(key)
    if expected is None:
        pytest.fail(f"{key} is not in {baseline_path(device).name}: re-record it with tests/tools/record_ledgers.py")
    actual = record_ledgers.record(name, scenario, option)
    difference = record_ledgers.diff(expected, actual)
    if difference:
        pytest.fail(f"{key} differs from {baseline_path(device).name}:\n{difference}", pytrace=False)


@pytest.mark.plugin_only
@pytest.mark.parametrize("name", ["flux", "sdxl"])
def test_steps_are_filled_without_a_trace(installed, accelerator, name):
    """Moves made inside the denoising loop carry its step, moves outside it none; nobody traces the pipeline."""
    entry = record_ledgers.record(name, "preview", "stock")
    steps = tiny.STEPS_RUN[name]
    in_loop = [r for r in entry["ledger"] if r[5] is not None]
    assert {r[5] for r in in_loop} == set(range(steps))  # a preview decode evicts the denoiser at every step
    assert all(r[3] is not None for r in in_loop)
    assert all(r[5] is None for r in entry["ledger"] if r[3] is None)  # at enable time
