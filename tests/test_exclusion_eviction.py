"""An excluded component keeps the chain's eviction point (issue 24, point 4): when it runs, its predecessor in
`model_cpu_offload_seq` leaves the device as it would without the option. Measured on the simulated accelerator,
where the tensors say where they are, for the plugin and the patched diffusers alike."""

import pytest
import tiny_pipelines as tiny
from harness import max_abs_diff
from simulated_accelerator import SimulatedAccelerator
from spy import modules_of

TOLERANCE = 1e-3  # as tests/test_pipelines.py: tiny Flux-like pipelines vary by about 6e-4 on the CPU

# pipeline, exclude_from_offload, on the device at every denoising step, on the device after the call
CASES = [
    ("flux", [], {"transformer"}, set()),
    ("flux", ["transformer"], {"transformer"}, {"transformer"}),  # T5 leaves when the transformer starts
    ("flux", ["text_encoder_2"], {"text_encoder_2", "transformer"}, {"text_encoder_2"}),
    ("sd3", ["transformer"], {"transformer"}, {"transformer"}),  # the third text encoder leaves
]


@pytest.mark.parametrize(
    "name, exclude, during, after", CASES, ids=[f"{c[0]}-{'+'.join(c[1]) or 'stock'}" for c in CASES]
)
def test_where_components_are_while_denoising(installed, name, exclude, during, after):
    ok, reason = tiny.available(name)
    if not ok:
        pytest.skip(reason)
    expected_image = tiny.run(tiny.build(name), name, seed=0)
    steps = []

    def record(pipe, step, timestep, callback_kwargs):
        steps.append({n for n, m in modules_of(pipe).items() if sim.where(m) == "device"})
        return callback_kwargs

    with SimulatedAccelerator() as sim:
        pipe = tiny.build(name)
        pipe.enable_model_cpu_offload(device="cpu", exclude_from_offload=exclude)
        for _ in range(2):  # the second call starts with the excluded components already on the device
            image = pipe(**{**tiny.call_kwargs(name, seed=0), "callback_on_step_end": record})[0]
            assert max_abs_diff(image.to("cpu"), expected_image) <= TOLERANCE
        placed = {n for n, m in modules_of(pipe).items() if sim.where(m) == "device"}

    assert len(steps) == 2 * tiny.STEPS_RUN[name]
    assert steps == [during] * len(steps)
    assert placed == after
