"""The real component sizes that `benchmarks/upstream_cases.py` prices its measured moves with, as JSON
`{model: {component: bytes}}`: FLUX.1-dev (bf16, and its transformer in float8 and NF4) and Stable Diffusion 3.5
Large from `diffusers-offload plan --json` (the shipped model data); HiDream-I1, which the model data does not have,
from its encoders there (CLIP-L, CLIP-G and T5-XXL as in SD 3.5 Large, FLUX's VAE) and the classes built on the meta
device: `HiDreamImageTransformer2DModel` with its defaults (the published model's: 16 + 32 layers, 20 heads of 128,
4 routed experts) and T5-XXL and Llama widths as caption channels, and Llama-3.1-8B's `LlamaForCausalLM`.

    .venv/bin/python benchmarks/real_sizes.py > build/real-sizes.json
"""

import json
import subprocess
import sys

import torch

BF16 = 2


def plan_sizes(model, *dtypes):
    command = [sys.executable, "-m", "diffusers_offload_ext.cli", "plan", "--model", model, "--json"]
    for dtype in dtypes:
        command += ["--dtype", dtype]
    plan = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
    return {name: component["nbytes"] for name, component in plan["components"].items()}


def meta_bytes(factory):
    with torch.device("meta"):
        module = factory()
    return sum(p.numel() for p in module.parameters()) * BF16, sum(p.numel() for p in module.parameters())


def hidream_sizes(sd35, flux):
    import diffusers
    from transformers import LlamaConfig, LlamaForCausalLM

    transformer, transformer_params = meta_bytes(
        lambda: diffusers.HiDreamImageTransformer2DModel(
            patch_size=2, in_channels=16, out_channels=16, caption_channels=[4096, 4096], axes_dims_rope=(64, 32, 32)
        )
    )
    llama_config = LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    )
    llama, llama_params = meta_bytes(lambda: LlamaForCausalLM(llama_config))
    print(f"HiDream transformer {transformer_params:,} parameters, Llama {llama_params:,}", file=sys.stderr)
    return {
        "text_encoder": sd35["text_encoder"],
        "text_encoder_2": sd35["text_encoder_2"],
        "text_encoder_3": sd35["text_encoder_3"],
        "text_encoder_4": llama,
        "transformer": transformer,
        "vae": flux["vae"],
    }


def main():
    flux = plan_sizes("flux-dev")
    sd35 = plan_sizes("sd3.5-large")
    sizes = {
        "flux-dev": flux,
        "flux-dev-fp8": plan_sizes("flux-dev", "transformer=fp8"),
        "flux-dev-nf4": plan_sizes("flux-dev", "transformer=nf4"),
        "sd3.5-large": sd35,
        "hidream-i1": hidream_sizes(sd35, flux),
    }
    print(json.dumps(sizes, indent=1))


if __name__ == "__main__":
    main()
