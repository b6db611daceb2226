"""What `benchmarks/realscale.py` measures on: a shipped model spec's pipeline at real size with random weights (or
the tiny pipeline of the same class), the keyword arguments of its calls, and the description of the machine.

Components are built from the spec's configs (the data `diffusers-offload plan` uses; nothing is downloaded), one at
a time directly on the GPU with each class's own random initialisation in the spec's dtype, then moved to the host.
Tokenizers and the scheduler are the tiny pipeline's stand-ins (`diffusers_offload_ext.testing.tiny`): prompts go
through the real-size text encoders, so their weights move as in a real run, with a small vocabulary.
"""

import datetime
import os
import platform
import shlex
import shutil
import subprocess

import torch

import diffusers_offload_ext as doe
from diffusers_offload_ext.models.meta import model_class
from diffusers_offload_ext.testing import tiny


def build_pipeline(spec: dict, scale: str, device: torch.device):
    """The pipeline of `spec` on the host, no offload enabled: real size with random weights, or the tiny one."""
    small = tiny.build(spec["tiny"])
    if scale == "tiny":
        return small
    modules = {name: random_component(entry, device) for name, entry in spec["components"].items()}
    return type(small)(**{**small.components, **modules})


def random_component(entry: dict, device: torch.device) -> torch.nn.Module:
    """One component of the spec built on `device` in its dtype with random weights, then moved to the host."""
    cls, library = model_class(entry["class"], entry.get("library"))
    config = {k: v for k, v in entry["config"].items() if not k.startswith("_")}
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, entry.get("dtype", "bfloat16")))
    try:
        with torch.device(device):
            module = cls.from_config(config) if library == "diffusers" else cls(cls.config_class(**config))
    finally:
        torch.set_default_dtype(previous)
    module = module.eval().requires_grad_(False).to("cpu")
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return module


def call_kwargs(spec: dict, pipe, args) -> dict:
    """Keyword arguments of one call: the tiny pipeline's (its size and steps) at tiny scale; at real scale the
    requested size, steps and frames, and the pipeline's own default text length."""
    kwargs = tiny.call_kwargs(spec["tiny"], pipe=pipe)
    if args.scale == "real":
        kwargs.pop("max_sequence_length", None)
        kwargs.update(height=args.height, width=args.width, num_inference_steps=args.steps)
        if "num_frames" in kwargs:
            kwargs["num_frames"] = args.frames
    return kwargs


def describe_inputs(spec: dict, kwargs: dict, args) -> str:
    """One sentence: the generation each call makes."""
    frames = f", {kwargs['num_frames']} frames" if "num_frames" in kwargs else ""
    size = f"{kwargs['height']}x{kwargs['width']}{frames}, {kwargs['num_inference_steps']} steps"
    if args.scale == "tiny":
        return f"the tiny `{spec['tiny']}` pipeline of the same class, float32 on the CPU, {size}"
    return (
        f"{spec.get('title', spec['name'])} ({spec['pipeline']}) built from the shipped spec with random weights, "
        f"{size}; tokenizers and scheduler are the tiny pipeline's stand-ins, the text encoders real size"
    )


def component_sizes(pipe) -> dict:
    """`{component: bytes of its parameters and buffers}`."""
    return {name: doe.module_nbytes(m) for name, m in pipe.components.items() if isinstance(m, torch.nn.Module)}


def driver_version() -> str:
    """The NVIDIA driver's version from `nvidia-smi`, or why it is unknown."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "unknown (no nvidia-smi)"
    try:
        done = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.SubprocessError) as error:
        return f"unknown ({type(error).__name__})"
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if done.returncode == 0 and lines else "unknown (nvidia-smi failed)"


def machine(device: torch.device, argv) -> dict:
    """Device, driver, versions, date and command line of this run."""
    import accelerate
    import diffusers
    import transformers

    cuda = device.type == "cuda"
    return {
        "device": torch.cuda.get_device_name(device) if cuda else f"CPU ({os.cpu_count()} logical cores)",
        "driver": driver_version() if cuda else None,
        "cuda": torch.version.cuda if cuda else None,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "diffusers": diffusers.__version__,
            "accelerate": accelerate.__version__,
            "transformers": transformers.__version__,
            "diffusers_offload_ext": doe.__version__,
        },
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["python benchmarks/realscale.py", *(shlex.quote(a) for a in argv)]),
        "platform": f"{platform.system()} {platform.release()}",
    }
