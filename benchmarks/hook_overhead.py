"""Microseconds per hooked forward: accelerate's stock `CpuOffload` against this package's `DeferredCpuOffload`,
for a component that is already on the execution device: the hook's `pre_forward` alone, then a whole forward through
the hooks (ours: the out-of-memory guard, accelerate's `new_forward`, the hook) of a component that takes a FLUX
transformer's inputs, less that component's bare forward. A benchmark, not a test: numbers on a shared machine are
only meaningful as ratios measured in one run.

    python benchmarks/hook_overhead.py [--layers 400] [--calls 2000]
"""

import argparse
import platform
import time
import timeit

import accelerate
import torch
from accelerate.hooks import CpuOffload, add_hook_to_module
from diffusers import DiffusionPipeline

import diffusers_offload_ext as doe


class OneComponent(doe.OffloadMixin, DiffusionPipeline):
    """A pipeline with a single component, enough to arm the extension's hook."""

    model_cpu_offload_seq = "component"

    def __init__(self, component: torch.nn.Module) -> None:
        super().__init__()
        self.register_modules(component=component)


def component(layers: int) -> torch.nn.Module:
    return torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(layers)])


def per_call_us(hook, module, calls: int) -> float:
    x = torch.ones(8)
    hook.pre_forward(module, x)  # the first call may move; then it is on the device
    best = min(timeit.repeat(lambda: hook.pre_forward(module, x), number=calls, repeat=5))
    return best / calls * 1e6


class Probe(torch.nn.Module):
    """A component that takes a FLUX transformer's inputs and returns its latents: the forward costs next to nothing,
    so what a call costs beyond its bare forward is the hooks'."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(
        self,
        hidden_states,
        encoder_hidden_states=None,
        pooled_projections=None,
        timestep=None,
        img_ids=None,
        txt_ids=None,
        guidance=None,
        joint_attention_kwargs=None,
        return_dict=True,
    ):
        return (hidden_states,)


def probe_inputs() -> dict:
    return dict(
        hidden_states=torch.ones(1, 16, 8),
        encoder_hidden_states=torch.ones(1, 8, 8),
        pooled_projections=torch.ones(1, 8),
        timestep=torch.ones(1),
        img_ids=torch.ones(16, 3),
        txt_ids=torch.ones(8, 3),
        guidance=None,
        joint_attention_kwargs=None,
        return_dict=False,
    )


def interleaved(probes, calls: int, rounds: int = 15) -> dict:
    """Microseconds per forward of each `(label, module)`, the best of `rounds` rounds in which every module is timed
    once in turn: a machine whose load changes during the run slows them all alike, not the ones timed last."""
    inputs = probe_inputs()
    best = {label: float("inf") for label, _ in probes}
    with torch.no_grad():
        for _, module in probes:
            module(**inputs)  # the first call may move; then it is on the device
        for _ in range(rounds):
            for label, module in probes:
                seconds = timeit.timeit(lambda: module(**inputs), number=calls, timer=time.thread_time)
                best[label] = min(best[label], seconds / calls * 1e6)
    return best


def ours(layers: int, **options):
    pipe = OneComponent(component(layers))
    pipe.enable_model_cpu_offload(device="cpu", **options)
    return pipe.component._hf_hook, pipe.component


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=400, help="Linear layers in the component (default 400)")
    parser.add_argument("--calls", type=int, default=2000, help="pre_forward calls per measurement (default 2000)")
    args = parser.parse_args()
    module = component(args.layers)
    rows = []
    for device in (torch.device("cpu", 0), torch.device("cpu")):
        rows.append(
            (f"stock CpuOffload, execution device {device}", per_call_us(CpuOffload(device), module, args.calls))
        )
    for label, options in (
        ("defaults (stock's chain)", {}),
        ("keep_on_device_between_generations", {"keep_on_device_between_generations": True}),
    ):
        hook, hooked = ours(args.layers, **options)
        rows.append((f"DeferredCpuOffload, {label}, cpu:0", per_call_us(hook, hooked, args.calls)))
    stock = Probe()
    add_hook_to_module(stock, CpuOffload(torch.device("cpu")), append=True)
    probes = [("bare", Probe()), ("stock CpuOffload, execution device cpu", stock)]
    for label, options in (
        ("defaults (stock's chain)", {}),
        ("keep_on_device_between_generations", {"keep_on_device_between_generations": True}),
    ):
        pipe = OneComponent(Probe())
        pipe.enable_model_cpu_offload(device="cpu", **options)
        probes.append((f"DeferredCpuOffload, {label}, cpu:0", pipe.component))
    best = interleaved(probes, args.calls)
    bare = best.pop("bare")
    forwards = [(label, us - bare) for label, us in best.items()]
    print(
        f"torch {torch.__version__}, accelerate {accelerate.__version__}, {platform.processor() or platform.machine()}"
    )
    print(f"component: {args.layers} Linear(8, 8) layers ({sum(p.numel() for p in module.parameters())} parameters)")
    width = max(len(label) for label, _ in rows)
    for label, us in rows:
        print(f"{label:<{width}}  {us:9.2f} us per hooked forward  ({us / rows[-2][1]:6.1f}x ours)")
    print(
        "stock on cpu:0 walks every parameter (`module.to`) on each forward, as it does on CUDA with accelerate "
        "< 1.7; stock on plain cpu takes accelerate's own early return (device equality)."
    )
    print(f"a whole forward with a FLUX transformer's inputs, less its bare forward ({bare:.2f} us):")
    width = max(len(label) for label, _ in forwards)
    for label, us in forwards:
        print(f"{label:<{width}}  {us:9.2f} us per hooked forward  ({us / forwards[0][1]:6.2f}x stock's early return)")


if __name__ == "__main__":
    main()
