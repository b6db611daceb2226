"""The setups that `benchmarks/upstream_cases.py` measures: the upstream patch's options and the alternatives that need
no new API (a pipeline on the device, a resident transformer with group offloaded encoders, `ComponentsManager` with
a custom `offload_strategy`), the tiny pipelines (the shared suite's, loaded by path, and a tiny HiDream-I1) and the
keyword arguments of their calls."""

from __future__ import annotations

import contextlib
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import tiny_pipelines as tiny  # noqa: E402  (by path, as the shared suite loads it)

import diffusers  # noqa: E402
from diffusers.hooks import apply_group_offloading  # noqa: E402

DEVICE = torch.device("cpu", 0)  # the simulated accelerator; `device="cpu"` offloads to it too (index 0)
HOST = torch.device("cpu")
CAPACITY = 1 << 40  # counts device memory without limiting it
STEPS = 4
PREVIEW_STEPS = 28

# -- configurations: what is done to a fresh pipeline before its calls ---------------------------------------------


def offload(**options):
    def setup(pipe):
        pipe.enable_model_cpu_offload(device="cpu", **options)

    return setup


def on_device(pipe):
    pipe.to(DEVICE)


def mixed(resident, streamed):
    """No new API: some components placed on the accelerator for good, others group offloaded (no CUDA streams
    here: each group is copied up before it runs and back after)."""

    def setup(pipe):
        for name in resident:
            getattr(pipe, name).to(DEVICE)
        for name in streamed:
            apply_group_offloading(
                getattr(pipe, name),
                onload_device=DEVICE,
                offload_device=HOST,
                offload_type="block_level",
                num_blocks_per_group=1,
            )

    setup.streamed = tuple(streamed)
    return setup


class NeverOffload:
    """An `offload_strategy` for `ComponentsManager.enable_auto_cpu_offload`: make room by offloading every resident
    model except `keep` (which it never offloads), whatever the free memory."""

    def __init__(self, pipe, keep):
        self.keep = [getattr(pipe, name) for name in keep]

    def __call__(self, hooks, model_id, model, execution_device):
        return [hook for hook in hooks if not any(hook.model is kept for kept in self.keep)]


@contextlib.contextmanager
def mem_get_info_stand_in(sim):
    """`enable_auto_cpu_offload` refuses a device whose torch module has no `mem_get_info` (CPU, MPS), even with a
    strategy that does not read it: report the simulated capacity for the measurement."""
    torch.cpu.mem_get_info = lambda index=None: (sim.capacity - sim.allocated_bytes, sim.capacity)
    try:
        yield
    finally:
        del torch.cpu.mem_get_info


def manager(keep):
    def setup(pipe):
        from diffusers import ComponentsManager

        components = ComponentsManager()
        for name, module in modules_of(pipe).items():
            components.add(name, module)
        components.enable_auto_cpu_offload(device=DEVICE, offload_strategy=NeverOffload(pipe, keep))
        pipe._measured_manager = components  # kept alive with the pipeline

    setup.needs_mem_get_info = True
    return setup


# -- pipelines and calls --------------------------------------------------------------------------------------------


def modules_of(pipe):
    return {name: m for name, m in pipe.components.items() if isinstance(m, torch.nn.Module)}


def build_hidream():
    """A tiny HiDreamImagePipeline: two CLIP encoders with projection, T5, Llama, the MoE transformer, a VAE."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def llama():
        config = LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=64,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=1,
        )
        return LlamaForCausalLM(config)

    def transformer():
        return diffusers.HiDreamImageTransformer2DModel(
            patch_size=2,
            in_channels=4,
            out_channels=4,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            caption_channels=[32, 32],  # T5 d_model, Llama hidden size
            text_emb_dim=64,  # the two CLIP projections, concatenated
            num_routed_experts=2,
            num_activated_experts=1,
            axes_dims_rope=(8, 4, 4),
            max_resolution=(32, 32),
            llama_layers=(0, 1),
        )

    with torch.random.fork_rng(devices=[]):
        return tiny._make(
            diffusers.HiDreamImagePipeline,
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
            vae=tiny._vae(1, latent_channels=4, scaling=0.3611, shift=0.1159, quant=False),
            text_encoder=tiny._clip_text(2, hidden=32, projection=32, with_projection=True),
            tokenizer=tiny._clip_tokenizer(),
            text_encoder_2=tiny._clip_text(5, hidden=32, projection=32, with_projection=True),
            tokenizer_2=tiny._clip_tokenizer(),
            text_encoder_3=tiny._t5_encoder(6, d_model=32),
            tokenizer_3=tiny._t5_tokenizer(),
            text_encoder_4=tiny._seeded(7, llama),
            tokenizer_4=tiny._t5_tokenizer(),
            transformer=tiny._seeded(3, transformer),
        )


def hidream_kwargs():
    return dict(
        prompt=tiny.PROMPT,
        num_inference_steps=STEPS,
        height=32,
        width=32,
        max_sequence_length=16,
        generator=torch.Generator("cpu").manual_seed(0),
        output_type="pt",
    )


def flux_kwargs(steps=STEPS, preview=False):
    return {**tiny.call_kwargs("flux", preview=preview), "num_inference_steps": steps}


def flux_embeds_kwargs():
    """A serving pattern: the prompt was encoded once, elsewhere, and its embeddings are on the accelerator; the
    call never runs the text encoders."""
    encoder = tiny.build("flux")
    with torch.no_grad():
        prompt_embeds, pooled, _ = encoder.encode_prompt(
            prompt=tiny.PROMPT, prompt_2=None, device=HOST, max_sequence_length=16
        )
    kwargs = flux_kwargs()
    del kwargs["prompt"], kwargs["max_sequence_length"]
    return {**kwargs, "prompt_embeds": prompt_embeds.to(DEVICE), "pooled_prompt_embeds": pooled.to(DEVICE)}


def fp8_flux():
    """The tiny FLUX with its transformer stored in float8 (diffusers' layerwise casting): a quantized transformer
    that any diffusers can move, one byte per weight."""
    pipe = tiny.build("flux")
    pipe.transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    return pipe
