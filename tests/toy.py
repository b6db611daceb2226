"""A tiny pipeline that runs its components in any order it is given: the workhorse of the property tests."""

from __future__ import annotations

import torch
from diffusers import DiffusionPipeline, ModelMixin
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.utils.accelerate_utils import apply_forward_hook

NAMES = ("text_encoder", "text_encoder_2", "transformer", "vae", "controlnet", "safety_checker")
SEQ = "text_encoder->text_encoder_2->transformer->vae"
# Distinct sizes so that bytes tell components apart.
WIDTHS = {
    "text_encoder": 3,
    "text_encoder_2": 5,
    "transformer": 8,
    "vae": 4,
    "controlnet": 6,
    "safety_checker": 2,
}


class Block(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)
        self.register_buffer("scale", torch.ones(width))

    def forward(self, x=None):
        # Inputs made where the weights are, as a pipeline makes them on its execution device.
        x = torch.ones(self.linear.in_features, device=self.linear.weight.device) if x is None else x
        return self.linear(x) * self.scale


class Vae(Block):
    @apply_forward_hook
    def decode(self, x=None):
        # Like diffusers' VAEs: decode does not go through forward; the hook's pre_forward(module) runs.
        return self.linear(torch.ones(self.linear.in_features, device=self.linear.weight.device))


class TracePipeline(DiffusionPipeline):
    """`pipe(trace)` runs the named components in order; `pipe(trace, fail_at=k)` raises at event k;
    `probe(index, name)` is called after each event."""

    model_cpu_offload_seq = SEQ
    _exclude_from_cpu_offload = ["safety_checker"]
    _optional_components = ["controlnet", "safety_checker"]

    def __init__(self, text_encoder, text_encoder_2, transformer, vae, controlnet, safety_checker):
        super().__init__()
        self.register_modules(
            text_encoder=text_encoder,
            text_encoder_2=text_encoder_2,
            transformer=transformer,
            vae=vae,
            controlnet=controlnet,
            safety_checker=safety_checker,
        )

    def __call__(self, trace=(), fail_at=None, interrupt=False, probe=None):
        for index, name in enumerate(trace):
            if index == fail_at:
                raise (KeyboardInterrupt if interrupt else RuntimeError)(f"failure at event {index}")
            module = getattr(self, name)
            if name == "vae":
                module.decode()
            else:
                module()
            if probe is not None:
                probe(index, name)
        self.maybe_free_model_hooks()
        return list(trace)


def build(pipeline_class=TracePipeline, with_controlnet=True, with_safety_checker=True, seed=0):
    torch.manual_seed(seed)
    kwargs = {name: Block(WIDTHS[name]) for name in ("text_encoder", "text_encoder_2", "transformer")}
    kwargs["vae"] = Vae(WIDTHS["vae"])
    kwargs["controlnet"] = Block(WIDTHS["controlnet"]) if with_controlnet else None
    kwargs["safety_checker"] = Block(WIDTHS["safety_checker"]) if with_safety_checker else None
    return pipeline_class(**kwargs)
