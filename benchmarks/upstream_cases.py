"""The figures of `patches/ISSUE.md`: what the upstream patch's two options change in the cases where they matter,
measured on the simulated accelerator with tiny pipelines, next to the alternatives that need no new API, and the
same moves priced with the real models' component sizes.

    build/venv-patched/bin/python benchmarks/upstream_cases.py --sizes build/real-sizes.json > patches/measurements.md

Run it with a diffusers that has `patches/` applied (`.venv-patched`: this package is not imported). It loads the
simulated accelerator and the tiny pipelines by path, as the shared test suite does. Measured: the bytes that crossed
the simulated bus (host to device, device to host) and the most device memory held at once (weights and activations)
in one pipeline call, the second one (the first pays for the excluded models once); the bytes held between calls.
Computed: the same moves, read from where each component is before and after every forward, priced with the real
component sizes of `--sizes` (a JSON file of `{model: {component: bytes}}`, made by `real_sizes.py` from
`diffusers-offload plan --json` and, for HiDream-I1, from the classes built on the meta device).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]
import simulated_accelerator as simulated  # noqa: E402  (by path, as the shared suite loads it)
from upstream_setups import (  # noqa: E402
    CAPACITY,
    DEVICE,
    HOST,
    PREVIEW_STEPS,
    build_hidream,
    diffusers,
    flux_embeds_kwargs,
    flux_kwargs,
    fp8_flux,
    hidream_kwargs,
    manager,
    mem_get_info_stand_in,
    mixed,
    modules_of,
    NeverOffload,
    offload,
    on_device,
    tiny,
)

# -- measuring ------------------------------------------------------------------------------------------------------


class Placements:
    """Where each component is (`sim.where`) before and after each of its forwards and VAE decodes: the moves of a
    call are the changes between consecutive readings."""

    def __init__(self, pipe, sim):
        self.sim, self.models = sim, modules_of(pipe)
        self.readings, self.forwards = [], dict.fromkeys(self.models, 0)
        for name, module in self.models.items():
            module.register_forward_pre_hook(lambda *_, name=name: self.read(name))
            module.register_forward_hook(lambda *_: self.read())
        vae = self.models.get("vae")
        if vae is not None and hasattr(vae, "decode"):
            decode = vae.decode

            def read_around(*args, **kwargs):
                self.read("vae")
                try:
                    return decode(*args, **kwargs)
                finally:
                    self.read()

            vae.decode = read_around

    def read(self, forward=None):
        if forward is not None:
            self.forwards[forward] += 1
        self.readings.append({name: self.sim.where(m) == "device" for name, m in self.models.items()})

    def start(self):
        self.readings, self.forwards = [], dict.fromkeys(self.models, 0)
        self.read()

    def moves(self):
        """{component: [onloads, offloads]} between the first and the last reading."""
        moves = {name: [0, 0] for name in self.models}
        for before, after in zip(self.readings, self.readings[1:]):
            for name in self.models:
                if before[name] != after[name]:
                    moves[name][0 if after[name] else 1] += 1
        return moves


def measure(build, setup, calls):
    """Build, set up and call a pipeline inside a simulated accelerator (`calls()`: the keyword arguments of each
    call, made there); one record per call, after one for the setup."""
    with simulated.SimulatedAccelerator(capacity=CAPACITY) as sim:
        stand_in = mem_get_info_stand_in(sim) if getattr(setup, "needs_mem_get_info", False) else None
        with stand_in or contextlib.nullcontext():
            pipe = build()
            kwargs_of_calls = calls()
            placements = Placements(pipe, sim)
            placements.start()
            setup(pipe)
            placements.read()
            records = [{"h2d": sim.h2d_bytes, "d2h": sim.d2h_bytes, "moves": placements.moves()}]
            for kwargs in kwargs_of_calls:
                sim.reset_counters()
                sim.reset_peak()
                placements.start()
                try:
                    with torch.no_grad():
                        output = pipe(**kwargs)
                except Exception as error:  # a configuration that cannot make this call: the table says so
                    records.append({"error": f"{type(error).__name__}: {str(error).splitlines()[0][:150]}"})
                    break
                placements.read()
                images = output[0] if isinstance(output, tuple) else output.images
                records.append(
                    {
                        "h2d": sim.h2d_bytes,
                        "d2h": sim.d2h_bytes,
                        "peak": sim.peak_bytes,
                        "held": sim.allocated_bytes,
                        "moves": placements.moves(),
                        "readings": placements.readings,
                        "forwards": dict(placements.forwards),
                        "image": torch.as_tensor(images).detach().to(HOST, torch.float32),
                    }
                )
    return records


def priced(record, sizes, streamed=(), use_stream=True):
    """The call's moves and its most weights on the device at once, priced with the real component sizes. A group
    offloaded component is copied up once per forward, and back only without CUDA streams; its groups on the
    device are left out of the peak (one block at a time)."""
    up = sum(sizes[name] * n_on for name, (n_on, _) in record["moves"].items() if name not in streamed)
    down = sum(sizes[name] * n_off for name, (_, n_off) in record["moves"].items() if name not in streamed)
    for name in streamed:
        up += sizes[name] * record["forwards"][name]
        down += 0 if use_stream else sizes[name] * record["forwards"][name]
    peak = max(
        sum(sizes[n] for n, here in reading.items() if here and n not in streamed) for reading in record["readings"]
    )
    return up, down, peak


# -- the cases ------------------------------------------------------------------------------------------------------

FLUX_ENCODERS = ["text_encoder", "text_encoder_2"]
HIDREAM_ENCODERS = ["text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4"]


def flux_prompt_configs():
    return [
        ("`enable_model_cpu_offload()`", offload()),
        ('`exclude_from_offload="transformer"`', offload(exclude_from_offload="transformer")),
        ('`pipe.to("cuda")`', on_device),
        (
            "no new API: T5 group offloaded, the rest `.to()`",
            mixed(["transformer", "vae", "text_encoder"], ["text_encoder_2"]),
        ),
        ("no new API: `ComponentsManager`, never offload the transformer", manager(["transformer"])),
    ]


CASES = {
    "prompt": dict(
        title="FLUX.1-dev, a prompt: the case of the first review",
        build=lambda: tiny.build("flux"),
        calls=lambda: [flux_kwargs(), flux_kwargs()],
        sizes=[("bf16", "flux-dev")],
        configs=flux_prompt_configs,
    ),
    "embeds": dict(
        title="FLUX.1-dev, precomputed `prompt_embeds` (serving: the encoders never run); the third call misses the "
        "cache and passes a prompt",
        build=lambda: tiny.build("flux"),
        calls=lambda: [flux_embeds_kwargs(), flux_embeds_kwargs(), flux_kwargs()],
        sizes=[("bf16", "flux-dev")],
        configs=lambda: [
            ("`enable_model_cpu_offload()`", offload()),
            ('`exclude_from_offload=["transformer", "vae"]`', offload(exclude_from_offload=["transformer", "vae"])),
            ('`pipe.to("cuda")`', on_device),
            (
                "no new API: transformer and VAE `.to()`, encoders group offloaded",
                mixed(["transformer", "vae"], FLUX_ENCODERS),
            ),
            ("no new API: `ComponentsManager`, never offload transformer and VAE", manager(["transformer", "vae"])),
        ],
    ),
    "hidream": dict(
        title="HiDream-I1: four text encoders (CLIP-L, CLIP-G, T5-XXL, Llama-3.1-8B)",
        build=build_hidream,
        calls=lambda: [hidream_kwargs(), hidream_kwargs()],
        sizes=[("bf16", "hidream-i1")],
        configs=lambda: [
            ("`enable_model_cpu_offload()`", offload()),
            ('`exclude_from_offload="transformer"`', offload(exclude_from_offload="transformer")),
            (
                '`exclude_from_offload=["transformer", "vae", "text_encoder", "text_encoder_2"]`',
                offload(exclude_from_offload=["transformer", "vae", "text_encoder", "text_encoder_2"]),
            ),
            ('`pipe.to("cuda")`', on_device),
            (
                "no new API: encoders group offloaded, the rest `.to()`",
                mixed(["transformer", "vae"], HIDREAM_ENCODERS),
            ),
            ("no new API: `ComponentsManager`, never offload the transformer", manager(["transformer"])),
        ],
    ),
    "preview": dict(
        title=f"FLUX.1-dev, a preview decoded with the VAE at each of {PREVIEW_STEPS} steps",
        build=lambda: tiny.build("flux"),
        calls=lambda: [flux_kwargs(PREVIEW_STEPS, preview=True)] * 2,
        sizes=[("bf16", "flux-dev")],
        configs=lambda: [
            ("`enable_model_cpu_offload()`", offload()),
            (
                '`keep_on_device_during_generation="transformer"`',
                offload(keep_on_device_during_generation="transformer"),
            ),
            ('`exclude_from_offload="transformer"`', offload(exclude_from_offload="transformer")),
            ('`pipe.to("cuda")`', on_device),
            (
                "no new API: T5 group offloaded, the rest `.to()`",
                mixed(["transformer", "vae", "text_encoder"], ["text_encoder_2"]),
            ),
        ],
    ),
    "quantized": dict(
        title="FLUX.1-dev with a quantized transformer (measured: float8 storage by layerwise casting), a prompt",
        build=fp8_flux,
        calls=lambda: [flux_kwargs(), flux_kwargs()],
        sizes=[("fp8", "flux-dev-fp8"), ("NF4", "flux-dev-nf4")],
        configs=flux_prompt_configs,
    ),
}


def gb(nbytes):
    return f"{nbytes / 1e9:.2f}"


def report(name, case, sizes):
    print(f"\n### {name}: {case['title']}\n")
    priced_as = [(label, sizes[model]) for label, model in case["sizes"] if model in sizes]
    head = "| configuration | call | h2d bytes | d2h bytes | peak bytes | held after | image vs first row |"
    rule = "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"
    for label, _ in priced_as:
        head += f" {label}: GB up | GB down | most weights | after |"
        rule += " ---: | ---: | ---: | ---: |"
    print(head)
    print(rule)
    reference = {}
    for config_label, setup in case["configs"]():
        streamed = getattr(setup, "streamed", ())
        records = measure(case["build"], setup, case["calls"])
        for index, record in enumerate(records[1:], start=1):
            if "error" in record:
                print(f"| {config_label} | {index} | {record['error']} |")
                continue
            if index == 1:
                continue  # the first call also moves what stays on the device for good
            diff = (record["image"] - reference.setdefault(index, record["image"])).abs().max().item()
            row = f"| {config_label} | {index} | {record['h2d']:,} | {record['d2h']:,} | {record['peak']:,} |"
            row += f" {record['held']:,} | {diff:.1e} |"
            for _, model_sizes in priced_as:
                up, down, peak = priced(record, model_sizes, streamed)
                after = sum(model_sizes[n] for n, here in record["readings"][-1].items() if here and n not in streamed)
                row += f" {gb(up)} | {gb(down)} | {gb(peak)} | {gb(after)} |"
            print(row)


def hooks(pipe):
    return {name: type(getattr(m, "_hf_hook", None)).__name__ for name, m in modules_of(pipe).items()}


def checks():
    """What `ComponentsManager.enable_auto_cpu_offload` with a custom strategy does with a `DiffusionPipeline`."""
    from diffusers import ComponentsManager

    print("\n### ComponentsManager with a `DiffusionPipeline`: what else happens\n")
    pipe = tiny.build("flux")
    components = ComponentsManager()
    for name, module in modules_of(pipe).items():
        components.add(name, module)
    try:
        components.enable_auto_cpu_offload(device="cpu", offload_strategy=NeverOffload(pipe, ["transformer"]))
    except NotImplementedError as error:
        print(f'- `enable_auto_cpu_offload(device="cpu", offload_strategy=...)` raises `NotImplementedError: {error}`')
    print(
        f"- `hasattr(torch.mps, \"mem_get_info\")`: {hasattr(torch.mps, 'mem_get_info')} in torch {torch.__version__}"
    )

    from test_lora import lora_state_dict  # the shared suite's small LoRA

    name = "sd15"
    state_dict = lora_state_dict(tiny.build(name).unet)
    with simulated.SimulatedAccelerator(capacity=CAPACITY) as sim, mem_get_info_stand_in(sim):
        reference = tiny.build(name).to(DEVICE)
        reference.load_lora_weights(state_dict, adapter_name="tiny")
        expected = tiny.run(reference, name, seed=0)
        del reference
        pipe = tiny.build(name)
        manager(["unet"])(pipe)
        before = tiny.run(pipe, name, seed=0)
        hooks_before = hooks(pipe)
        pipe.load_lora_weights(state_dict, adapter_name="tiny")
        after = tiny.run(pipe, name, seed=0)
        print(
            f"- SD 1.5 (tiny) under the manager, unet never offloaded; hooks {hooks_before}; `load_lora_weights` "
            f"leaves them ({hooks(pipe)}: the loaders only know accelerate's `CpuOffload` and `AlignDevicesHook`) "
            f"and the LoRA applies: image vs the LoRA pipeline on the device {(after - expected).abs().max():.1e}, "
            f"vs before the LoRA {(after - before).abs().max():.1e}; unet {sim.where(pipe.unet)} after the call"
        )
        pipe.maybe_free_model_hooks()
        print(f"- `pipe.maybe_free_model_hooks()` leaves the unet on the {sim.where(pipe.unet)} (it knows no hook)")
        pipe.enable_model_cpu_offload(device="cpu")
        print(
            f"- `pipe.enable_model_cpu_offload()` then replaces the manager's hooks ({hooks(pipe)}), while it "
            f"still lists {len(pipe._measured_manager.model_hooks)} hooks as its own"
        )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=pathlib.Path, help="real component sizes, JSON {model: {component: bytes}}")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--no-checks", dest="checks", action="store_false", help="leave out the manager's checks")
    args = parser.parse_args(argv)
    chosen = [c for c in args.cases.split(",") if c]
    unknown = [c for c in chosen if c not in CASES]
    if unknown or not chosen:
        parser.error(f"`--cases` must name some of {list(CASES)}, got {args.cases!r}")
    sizes = json.loads(args.sizes.read_text()) if args.sizes else {}
    torch.set_num_threads(1)
    print(f"diffusers {diffusers.__version__}, torch {torch.__version__}; call 1 (not shown) is the first call; calls")
    print("2 and up are measured; `h2d`/`d2h`: bytes that crossed the simulated bus in that call; `peak`: most device")
    print("memory held at once in the call (weights and activations); `held after`: device bytes after the call.")
    print("Priced columns (computed, not measured): the same moves with the real component sizes; `most weights`")
    print("excludes the groups of a group offloaded component (one block at a time).")
    for name in chosen:
        report(name, CASES[name], sizes)
    if args.checks:
        checks()


if __name__ == "__main__":
    main()
