"""Regenerate the shipped model data (`data/recorded/<model>.json`) from the specs: element counts from a build of
every component on the meta device, the layout and call-trace template from two calls of the model's tiny pipeline
with stock model offload, observing its offload hooks (`record_uses`). Needs torch, diffusers (>= 0.33 for Wan) and
transformers.

    python -m diffusers_offload_ext.testing.record_model_data            # rewrite every model's data
    python -m diffusers_offload_ext.testing.record_model_data --check    # compare only; exit 1 when something differs
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from importlib.metadata import version
from typing import Dict, List, Optional, Sequence

from ..calls import CallTracker, StepBar
from ..layout import PipelineLayout, modules_of
from ..models.bounds import MAX_STEPS
from ..models.meta import count_elements
from ..models.recorded import FORMAT, RECORDED_DIR, VERSION, config_key
from ..models.schedule import SCHEDULER, flow_match_timesteps
from ..models.specs import load_spec, shipped_models
from ..models.traces import VARIANTS, call_trace, template_from_uses

#: Steps of the recorded calls (enough for both of Wan 2.2's experts to run).
RECORD_STEPS = 4
#: The scheduler options under which `schedule.flow_match_timesteps` holds.
_UNSUPPORTED = ("use_dynamic_shifting", "shift_terminal", "use_karras_sigmas", "use_exponential_sigmas",
                "use_beta_sigmas", "invert_sigmas")  # fmt: skip


def component_counts(spec: dict) -> Dict[str, dict]:
    """Element counts of every component of `spec`, built on the meta device, with its config key."""
    counts = {}
    for name, entry in spec["components"].items():
        counted = count_elements(entry["class"], entry.get("library"), entry["config"])
        counted["config_key"] = config_key(entry["class"], entry["config"])
        counts[name] = counted
    return counts


def record_uses(tiny, name: str, steps: int, preview: bool, calls: int = 1) -> List[list]:
    """`(component, phase, step)` of each use of an offloaded component in `calls` calls of tiny pipeline `name`.

    A use is what the policies see: one run of a component's offload hook (stock diffusers' model offload, on the
    CPU). `doe.trace` counts module entries instead, which repeat a component (a VAE decode enters `post_quant_conv`
    and `decoder`), and the residency manager's first-call prediction would see those repeats.
    """
    import torch

    pipe = tiny.build(name)
    kwargs = tiny.call_kwargs(name, preview=preview)
    kwargs["num_inference_steps"] = steps
    tracker, uses, recorded = CallTracker(), [], []
    bar = pipe.progress_bar
    object.__setattr__(pipe, "progress_bar", lambda iterable=None, total=None: StepBar(
        bar(iterable=iterable, total=total), tracker, total))  # fmt: skip
    pipe.enable_model_cpu_offload(device="cpu")
    for _ in range(calls):
        _observe_hooks(pipe, tracker, uses)  # stock re-creates its hooks at the end of every call
        tracker.begin()
        with torch.no_grad():
            pipe(**kwargs)
        tracker.end()
        recorded.append(list(uses))
        uses.clear()
    return recorded


def _observe_hooks(pipe, tracker: CallTracker, uses: list) -> None:
    """Make each component's offload hook append `(component, phase, step)` to `uses` when it runs."""
    for component, module in modules_of(pipe.components).items():
        hook = getattr(module, "_hf_hook", None)
        if hook is None:
            continue

        def pre_forward(module, *args, _component=component, _original=hook.pre_forward, **kwargs):
            uses.append((_component, tracker.phase, tracker.step))
            return _original(module, *args, **kwargs)

        hook.pre_forward = pre_forward


def experts_of(pipe) -> Optional[dict]:
    """The two experts of a pipeline with a `boundary_ratio` (Wan 2.2), and the schedule that splits the steps."""
    ratio = pipe.config.get("boundary_ratio")
    if ratio is None:
        return None
    scheduler = pipe.scheduler
    options = [o for o in _UNSUPPORTED if scheduler.config.get(o)]
    if type(scheduler).__name__ != SCHEDULER or options:
        raise RuntimeError(f"{type(scheduler).__name__} {options}: only a static-shift {SCHEDULER} is modelled.")
    schedule = {
        "scheduler": SCHEDULER,
        "shift": float(scheduler.config["shift"]),
        "num_train_timesteps": int(scheduler.config["num_train_timesteps"]),
    }
    return {"boundary_ratio": float(ratio), "high_noise": "transformer", "low_noise": "transformer_2",
            "schedule": schedule}  # fmt: skip


def check_schedule(scheduler, experts: dict, max_steps: int = MAX_STEPS) -> None:
    """Raise unless `schedule.flow_match_timesteps` equals `scheduler`'s timesteps for 1 to `max_steps` steps."""
    scheduler = copy.deepcopy(scheduler)
    shift, n = experts["schedule"]["shift"], experts["schedule"]["num_train_timesteps"]
    for steps in range(1, max_steps + 1):
        scheduler.set_timesteps(steps)
        if [float(t) for t in scheduler.timesteps] != flow_match_timesteps(steps, shift=shift, num_train_timesteps=n):
            raise RuntimeError(f"The modelled timesteps differ from {type(scheduler).__name__}'s at {steps} steps.")


def record_pipeline(tiny, name: str) -> dict:
    """Layout and call-trace template of tiny pipeline `name`, checked against what was recorded."""
    pipe = tiny.build(name)
    experts = experts_of(pipe)
    if experts is not None:
        check_schedule(pipe.scheduler, experts)
    template = {"recorded_steps": RECORD_STEPS, "experts": experts}
    for variant in VARIANTS:
        first, second = record_uses(tiny, name, RECORD_STEPS, variant == "preview", calls=2)
        if first != second:
            raise RuntimeError(f"{name}: two calls ran different component traces.")
        template[variant] = template_from_uses(first, RECORD_STEPS, experts)
        if call_trace(template, RECORD_STEPS, variant == "preview") != [use[0] for use in first]:
            raise RuntimeError(f"{name}: the template does not regenerate the recorded call.")
    return {"pipeline": type(pipe).__name__, "layout": PipelineLayout.from_pipeline(pipe).to_dict(), "trace": template}


def record_model(model: str, pipelines: Optional[dict] = None) -> dict:
    """The recorded data of shipped model `model` (`pipelines` caches `record_pipeline` by tiny name)."""
    from . import tiny

    spec = load_spec(model)
    pipelines = {} if pipelines is None else pipelines
    if spec["tiny"] not in pipelines:
        ok, reason = tiny.available(spec["tiny"])
        if not ok:
            raise RuntimeError(f"{model}: cannot record: {reason}")
        pipelines[spec["tiny"]] = record_pipeline(tiny, spec["tiny"])
    recorded = pipelines[spec["tiny"]]
    return {
        "format": FORMAT,
        "version": VERSION,
        "model": model,
        "recorded_with": {p: version(p) for p in ("torch", "diffusers", "transformers")},
        "tiny": spec["tiny"],
        "pipeline": recorded["pipeline"],
        "layout": recorded["layout"],
        "components": component_counts(spec),
        "trace": recorded["trace"],
    }


def record_blocks() -> dict:
    """Block element counts of every component of every shipped spec, built on meta (`models.block_model`)."""
    from ..models.block_model import block_counts

    components = {}
    for model in shipped_models():
        for entry in load_spec(model)["components"].values():
            key = config_key(entry["class"], entry["config"])
            components[key] = block_counts(entry["class"], entry.get("library"), entry["config"])
    return {"format": "diffusers-offload-blocks", "version": 1, "components": dict(sorted(components.items()))}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Regenerate (or --check) the shipped model data.")
    parser.add_argument("--models", nargs="*", default=None, help="models to record (default: every shipped one)")
    parser.add_argument("--check", action="store_true", help="compare with the shipped data; write nothing")
    parser.add_argument("--blocks", action="store_true", help="write the block counts (models/data/blocks.json)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    if args.blocks:
        from ..models.block_model import BLOCKS_FILE

        with open(BLOCKS_FILE, "w", encoding="utf-8") as f:
            json.dump(record_blocks(), f, indent=1)
            f.write("\n")
        print(f"wrote {BLOCKS_FILE}")
        return 0
    pipelines: dict = {}
    differs = []
    for model in args.models or shipped_models():
        data = record_model(model, pipelines)
        path = os.path.join(RECORDED_DIR, f"{model}.json")
        if args.check:
            with open(path, encoding="utf-8") as f:
                shipped = json.load(f)
            if {k: v for k, v in shipped.items() if k != "recorded_with"} != {
                k: v for k, v in data.items() if k != "recorded_with"
            }:
                differs.append(model)
            continue
        os.makedirs(RECORDED_DIR, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(json.dumps(data, indent=1) + "\n")
        print(f"wrote {path}", file=sys.stderr)
    if differs:
        print(f"differs from a live recording: {', '.join(differs)}", file=sys.stderr)
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
