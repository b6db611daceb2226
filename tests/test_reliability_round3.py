"""Reliability round 3 (issue 21): weight edits on streaming components, failed calls, device tensors taken for host
copies, loggers, combined sub-pipelines, sticky options, a bounded ledger and shared components. Each test is one
fault of the issue, checked through public surfaces (images against no offload or stock, where tensors are, the
ledger, `doe.offload_status`), on the simulated accelerator and, where the fault shows there, the plain CPU."""

import copy

import pytest
import torch
from harness import max_abs_diff
from simulated_accelerator import SimulatedAccelerator

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: block streaming, residency and the ledger")

import diffusers_offload_ext as doe  # noqa: E402
from diffusers_offload_ext.blocks.find import block_sizes  # noqa: E402
from diffusers_offload_ext.testing import tiny  # noqa: E402

pytestmark = [pytest.mark.plugin_only, pytest.mark.usefixtures("installed")]
NAME = "flux"


def deep_flux():
    from test_block_streaming import deep_flux as build

    return build()


def streaming_budget(pipe, share=0.8):
    return int(sum(block_sizes(pipe.transformer).values()) * share)


def modules(pipe):
    return {n: m for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}


def call(pipe, callback=None):
    kwargs = tiny.call_kwargs(NAME, pipe=pipe)
    if callback is not None:
        kwargs["callback_on_step_end"] = callback
    out = pipe(**kwargs)
    return torch.as_tensor(out.images).float().cpu()


def streamed_blocks(pipe):
    """The streamed blocks of the transformer, as `offload_status` reports them during a call."""
    seen = []

    def look(p, step, timestep, kwargs):
        if not seen:
            seen.append(doe.offload_status(p).components["transformer"].blocks)
        return kwargs

    call(pipe, look)
    assert seen and seen[0] is not None, "the transformer did not stream"
    return list(seen[0].streamed)


def weight_of(pipe, block):
    return next(p for p in pipe.transformer.get_submodule(block).parameters() if p.dim() == 2)


def reference_with(edit_at_step_0):
    """No offload: the image of a call whose callback makes `edit_at_step_0(pipe)` at the end of step 0."""
    pipe = deep_flux()

    def callback(p, step, timestep, kwargs):
        if step == 0:
            edit_at_step_0(p)
        return kwargs

    with torch.no_grad():
        return call(pipe, callback), pipe


# -- 1 and 2: edits of a streamed block's weights made in a step callback ---------------------------------------------
EDITS = {
    "data-inplace": lambda w: w.data.mul_(1.5),
    "inplace-no-grad": lambda w: w.mul_(1.5),
}


@pytest.mark.parametrize("prefetch", [False, True], ids=["no-prefetch", "prefetch"])
@pytest.mark.parametrize("edit", EDITS, ids=str)
def test_an_inplace_edit_in_a_step_callback_is_used_at_the_next_step_though_its_block_was_prefetched(
    accelerator, edit, prefetch
):
    pipe = deep_flux()
    pipe.enable_model_cpu_offload(device="cpu", memory_budget=streaming_budget(pipe), prefetch=prefetch)
    first = streamed_blocks(pipe)[0]  # the first to run: prefetched across the step boundary from the 2nd call on

    def change(p):
        with torch.no_grad():
            EDITS[edit](weight_of(p, first))

    expected, reference_pipe = reference_with(change)

    def callback(p, step, timestep, kwargs):
        if step == 0:
            change(p)
        return kwargs

    image = call(pipe, callback)
    assert max_abs_diff(image, expected) == 0.0
    doe.release(pipe)
    assert torch.equal(weight_of(pipe, first).detach().cpu(), weight_of(reference_pipe, first).detach().cpu())


REPLACEMENTS = {
    "data-assigned": lambda m, w: setattr(w, "data", w.data * 1.5),
    "new-parameter": lambda m, w: setattr(m, "weight", torch.nn.Parameter(w.data * 1.5, requires_grad=False)),
}


@pytest.mark.parametrize("replace", REPLACEMENTS, ids=str)
def test_a_weight_replaced_in_a_streamed_block_is_kept(accelerator, replace):
    pipe = deep_flux()
    pipe.enable_model_cpu_offload(device="cpu", memory_budget=streaming_budget(pipe))
    block = streamed_blocks(pipe)[-1]
    layer = next(m for m in pipe.transformer.get_submodule(block).modules() if isinstance(m, torch.nn.Linear))
    path = next(n for n, m in pipe.transformer.named_modules() if m is layer)

    def change(p):
        target = p.transformer.get_submodule(path)
        with torch.no_grad():
            REPLACEMENTS[replace](target, target.weight)

    reference_pipe = edited_at_the_first_step(pipe, change, accelerator)
    got = pipe.transformer.get_submodule(path).weight.detach().cpu()
    assert torch.equal(got, reference_pipe.transformer.get_submodule(path).weight.detach().cpu())


def edited_at_the_first_step(pipe, change, accelerator):
    """One call of `pipe` with `change(pipe)` made in its first step's callback: its image is the one of no offload
    with the same change at the same point, and after `doe.release` the transformer is on the host. Returns that
    reference pipeline."""
    expected, reference_pipe = reference_with(change)

    def callback(p, step, timestep, kwargs):
        if step == 0:
            change(p)
        return kwargs

    assert max_abs_diff(call(pipe, callback), expected) == 0.0
    doe.release(pipe)
    if accelerator is not None:
        assert accelerator.where(pipe.transformer) == "host"
    return reference_pipe


# -- 3: a submodule replaced inside a streaming component -------------------------------------------------------------
@pytest.mark.parametrize("where", ["streamed", "kept", "rest"])
def test_a_submodule_replaced_inside_a_streaming_component_runs_on_the_device(accelerator, where):
    pipe = deep_flux()
    pipe.enable_model_cpu_offload(device="cpu", memory_budget=streaming_budget(pipe))
    status = []

    def look(p, step, timestep, kwargs):
        status.append(doe.offload_status(p).components["transformer"].blocks)
        return kwargs

    call(pipe, look)
    streamed, kept = list(status[0].streamed), [b for b in status[0].resident if b in block_sizes(pipe.transformer)]
    owner = {"streamed": streamed[-1], "kept": next((b for b in kept if "." in b), None), "rest": None}[where]
    if owner is None and where == "kept":
        pytest.fail(f"no kept block to test in {kept!r}")
    scope = pipe.transformer if owner is None else pipe.transformer.get_submodule(owner)
    name, layer = next((n, m) for n, m in scope.named_modules() if isinstance(m, torch.nn.Linear))
    path = name if owner is None else f"{owner}.{name}"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        fresh = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None).eval()

    def change(p):
        parent, _, leaf = path.rpartition(".")
        target = p.transformer.get_submodule(parent) if parent else p.transformer
        setattr(target, leaf, copy.deepcopy(fresh))

    edited_at_the_first_step(pipe, change, accelerator)


# -- 4: a failed call's partial pass ----------------------------------------------------------------------------------
@pytest.mark.parametrize("failed", ["first", "second"])
def test_a_failed_call_does_not_become_the_next_calls_block_plan(accelerator, failed):
    def run(fail):
        pipe = deep_flux()
        pipe.enable_model_cpu_offload(
            device="cpu", memory_budget=streaming_budget(pipe, 0.85), keep_on_device_between_generations=True
        )  # a budget where the plan keeps a single block (checked below): a block that did not run in the failed call
        if failed == "second":
            call(pipe)
        if fail:  # the first single block raises: it and those after it did not run in the failed call
            ran = []

            def stop(module, args):
                ran.append(None)
                if len(ran) == 1 or failed == "second":
                    raise RuntimeError("stop")

            handle = pipe.transformer.single_transformer_blocks[0].register_forward_pre_hook(stop)
            with pytest.raises(RuntimeError, match="stop"):
                call(pipe)
            handle.remove()
        ledger = doe.transfer_ledger(pipe)
        ledger.clear()
        plans = []

        def look(p, step, timestep, kwargs):
            plans.append(doe.offload_status(p).components["transformer"].blocks)
            return kwargs

        image = call(pipe, look)
        return image, plans[-1], sum(r.nbytes for r in ledger.records if r.direction == "onload")

    image, plan, moved = run(fail=True)
    control_image, control_plan, control_moved = run(fail=False)
    singles = [b for b in control_plan.resident if b.startswith("single_transformer_blocks.")]
    assert singles, f"the budget tests nothing: the plan keeps no block the failed call did not run ({control_plan})"
    assert max_abs_diff(image, control_image) == 0.0
    assert (plan.resident, plan.streamed) == (control_plan.resident, control_plan.streamed)
    assert moved <= control_moved  # (what the failed call left on the device, kept between calls, is not copied again)


# -- 5: zero-copy with part of a component already on the device -------------------------------------------------------
PARTS = {  # a part of a component put on the device by the user between calls
    "moved": lambda pipe, device: pipe.vae.decoder.conv_out.to(device),
    "built-on-the-device": lambda pipe, device: setattr(
        pipe.vae.decoder, "conv_out", copy.deepcopy(pipe.vae.decoder.conv_out).to(device)
    ),
    "a-block-moved": lambda pipe, device: pipe.transformer.transformer_blocks[0].to(device),
}


@pytest.mark.parametrize("part", PARTS, ids=str)
@pytest.mark.parametrize("options", [{"zero_copy_eviction": True}, {"keep_on_device_between_generations": True}])
def test_a_part_already_on_the_device_at_onload_goes_home(options, part):
    with SimulatedAccelerator() as sim:
        pipe = tiny.build(NAME)
        pipe.enable_model_cpu_offload(device="cpu", **options)
        expected = call(pipe)
        doe.release(pipe)
        PARTS[part](pipe, sim.device)
        for _ in range(2):  # that part goes home at the call's end (or the release), and again on a later call
            assert max_abs_diff(call(pipe), expected) == 0.0
            doe.release(pipe)
            assert {n: sim.where(m) for n, m in modules(pipe).items()} == {n: "host" for n in modules(pipe)}
            assert doe.offload_status(pipe).resident_bytes == 0


def test_a_streamed_block_found_on_the_device_goes_home_and_the_ledger_says_so():
    with SimulatedAccelerator() as sim:
        pipe = deep_flux()
        pipe.enable_model_cpu_offload(device="cpu", memory_budget=streaming_budget(pipe))
        block = streamed_blocks(pipe)[-1]
        expected = call(pipe)
        pipe.transformer.get_submodule(block).to(sim.device)  # moved by the user between calls
        ledger = doe.transfer_ledger(pipe)
        ledger.clear()
        assert max_abs_diff(call(pipe), expected) == 0.0
        doe.release(pipe)
        assert {n: sim.where(m) for n, m in modules(pipe).items()} == {n: "host" for n in modules(pipe)}
        assert doe.offload_status(pipe).resident_bytes == 0
        home = [r for r in ledger.records if r.block == block and r.direction == "offload" and r.kind == "copy"]
        assert home and home[0].nbytes == block_sizes(pipe.transformer)[block]


# -- 6: a reshape through .data on the device -------------------------------------------------------------------------
@pytest.mark.parametrize("zero_copy", [False, True], ids=["copy", "zero-copy"])
def test_a_reshape_through_data_on_the_device_survives_the_eviction(zero_copy):
    with SimulatedAccelerator() as sim:
        pipe = tiny.build(NAME)
        pipe.enable_model_cpu_offload(
            device="cpu", keep_on_device_between_generations=True, zero_copy_eviction=zero_copy
        )
        call(pipe)
        weight = pipe.transformer.proj_out.weight
        assert sim.is_on_device(weight)
        rows, cols = weight.shape
        weight.data = weight.data.view(cols, rows)  # same bytes, same pointer, another shape
        doe.release(pipe)
        assert tuple(pipe.transformer.proj_out.weight.shape) == (cols, rows)
        assert sim.where(pipe.transformer) == "host"


# -- 7: loggers obey diffusers' verbosity -----------------------------------------------------------------------------
def test_our_log_lines_follow_diffusers_verbosity():
    import logging as std_logging

    from diffusers.utils import logging

    class Lines(std_logging.Handler):  # beside diffusers' own handler, on its library logger: levels untouched
        def __init__(self):
            super().__init__(std_logging.DEBUG)
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    def streaming_call():
        pipe = deep_flux()
        pipe.enable_model_cpu_offload(device="cpu", memory_budget=streaming_budget(pipe))
        call(pipe)

    before, lines = logging.get_verbosity(), Lines()
    library = std_logging.getLogger("diffusers")
    library.addHandler(lines)
    try:
        logging.set_verbosity_info()
        streaming_call()
        shown, lines.lines = lines.lines, []
        logging.set_verbosity_error()
        streaming_call()
        silenced = lines.lines
    finally:
        library.removeHandler(lines)
        logging.set_verbosity(before)
    assert any("it streams" in line for line in shown), "set_verbosity_info() does not show that it streams"
    assert not any("stream" in line for line in silenced), "set_verbosity_error() does not silence our lines"


def test_every_logger_of_ours_is_under_diffusers():
    import importlib
    import logging
    import pkgutil

    for info in pkgutil.walk_packages(doe.__path__, prefix="diffusers_offload_ext."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
    ours = [name for name in logging.root.manager.loggerDict if "diffusers_offload_ext" in name]
    assert ours and all(name.startswith("diffusers.diffusers_offload_ext") for name in ours), ours


# -- 8: a combined pipeline's sub-pipeline called on its own -----------------------------------------------------------
def test_a_sub_pipeline_called_on_its_own_ends_its_call_as_stock_does():
    from diffusers_offload_ext.testing import tiny_combined

    def run_prior(options):
        with SimulatedAccelerator() as sim:
            pipe = tiny_combined.build_kandinsky22_img2img_combined()
            if options is None:
                doe.uninstall()
                try:
                    pipe.enable_model_cpu_offload(device="cpu")
                finally:
                    doe.install()
            else:
                pipe.enable_model_cpu_offload(device="cpu", **options)
            prior = pipe.prior_pipe
            prior(prompt="a cat", num_inference_steps=2, generator=torch.Generator().manual_seed(0))
            # Not the prior: the combined class excludes it (`_exclude_from_cpu_offload = ["prior_prior"]`), so
            # armed whole it stays on the device as a round trip, where stock's forwarding chains it in the prior
            # pipeline's sequence.
            return {n: sim.where(m) for n, m in modules(prior).items() if n != "prior"}

    stock = run_prior(None)
    ours = run_prior({"keep_on_device_during_generation": True})
    assert ours == stock


# -- 9: prefetch stays set while the manager is off and on again --------------------------------------------------------
def test_prefetch_survives_the_manager_switched_off_and_on():
    pipe = tiny.build(NAME)
    pipe.enable_model_cpu_offload(device="cpu", memory_budget="1GiB", prefetch=True)
    assert doe.offload_status(pipe).options["prefetch"] is True
    pipe.enable_model_cpu_offload(device="cpu", memory_budget="auto")
    pipe.enable_model_cpu_offload(device="cpu", memory_budget="1GiB")
    assert doe.offload_status(pipe).options["prefetch"] is True


# -- 10: the ledger is bounded ----------------------------------------------------------------------------------------
def test_the_ledger_is_bounded_and_its_summary_stays_exact():
    pipe = tiny.build(NAME)
    pipe.enable_model_cpu_offload(device="cpu")
    ledger = doe.transfer_ledger(pipe)
    call(pipe)
    first = list(ledger.records)
    per_call = len(first)
    bytes_per_call = sum(r.copied_bytes for r in first)
    calls = 60
    for _ in range(calls - 1):
        call(pipe)
    assert len(ledger.records) < calls * per_call, "every record of every call is still held"
    summary = ledger.summary()
    assert summary["total_bytes"] == ledger.copied_bytes() == calls * bytes_per_call
    assert len(summary["per_call"]) == calls
    assert ledger.copied_bytes(call_index=0) == bytes_per_call  # a call whose records are gone
    assert summary["per_component"]["transformer"]["onloads"] == calls
    held = ledger.keep_calls
    assert {r.call_index for r in ledger.records} == set(range(calls - held, calls))
    assert len(ledger.records) == held * per_call
    ledger.keep_calls = 2
    assert [r.call_index for r in ledger.records] == [calls - 2] * per_call + [calls - 1] * per_call
    assert ledger.summary() == summary  # trimming the records leaves the summary as it was
    ledger.keep_calls = None
    call(pipe)
    assert len(ledger.records) == 3 * per_call
    for bad, error in [(-1, ValueError), (2.5, TypeError), (True, TypeError)]:
        with pytest.raises(error, match="keep_calls"):
            ledger.keep_calls = bad
    ledger.clear()
    assert ledger.records == [] and ledger.summary()["total_bytes"] == 0 and ledger.summary()["per_call"] == {}


# -- 11: shared components are booked in the ledger of the pipeline whose call moved them --------------------------------
@pytest.mark.parametrize("build", ["from_pipe", "constructor"])
def test_a_shared_component_is_booked_only_by_the_pipeline_whose_call_moved_it(build):
    from diffusers import StableDiffusionControlNetPipeline

    with SimulatedAccelerator() as sim:
        sd = tiny.build("sd15")
        controlnet = tiny.build("sd_controlnet").controlnet
        if build == "from_pipe":
            control = StableDiffusionControlNetPipeline.from_pipe(sd, controlnet=controlnet)
        else:
            control = StableDiffusionControlNetPipeline(**sd.components, controlnet=controlnet)
        control.set_progress_bar_config(disable=True)
        assert control.vae is sd.vae and control.unet is sd.unet
        total = sum(doe.module_nbytes(m) for m in modules(control).values())
        # Everything of the SD pipeline fits its budget; the ControlNet pipeline's is smaller: when the SD pipeline's
        # call loads a shared component, the ControlNet pipeline makes room in its own budget.
        sd.enable_model_cpu_offload(device="cpu", memory_budget=total, keep_on_device_between_generations=True)
        budget = int(total * 0.6)
        control.enable_model_cpu_offload(device="cpu", memory_budget=budget, keep_on_device_between_generations=True)
        control_ledger, sd_ledger = doe.transfer_ledger(control), doe.transfer_ledger(sd)
        for _ in range(2):
            tiny.run(sd, "sd15")
        assert [(r.component, r.direction, r.call_index) for r in control_ledger.records] == []
        made_room = [r for r in sd_ledger.records if r.direction == "offload"]
        assert made_room and all(r.call_index is not None for r in made_room)  # booked by the SD pipeline's calls
        assert doe.offload_status(control).resident_bytes <= budget
        for pipe in (sd, control):
            for name, status in doe.offload_status(pipe).components.items():
                assert sim.where(pipe.components[name]) == ("device" if status.resident else "host"), name
