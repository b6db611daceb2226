"""The parts of the tiny pipelines (`testing/tiny.py`): tokenizers built in memory (no hub access), seeded models
from small configs, and each pipeline assembled from them (`_BUILDERS`)."""

from __future__ import annotations

import inspect
import json
import os
import tempfile
from typing import Callable

import torch

import diffusers

_WAN_BOUNDARY_RATIO = 0.875
_MAX_SEQUENCE_LENGTH = 16

# Words known to the T5/UMT5 stand-in tokenizer (others map to <unk>).
_WORDS = (
    "a an the of on in and with photo picture painting red blue green cat dog horse "
    "astronaut riding mars moon city night bad quality blurry"
).split()


def _init_params(cls) -> dict:
    return dict(inspect.signature(cls.__init__).parameters)


# --------------------------------------------------------------------------------------
# tokenizers (no hub access)
# --------------------------------------------------------------------------------------


def _clip_tokenizer():
    """A character-level CLIP BPE tokenizer (no merges): lowercase letters and their
    end-of-word forms; anything else maps to <|endoftext|> (the unk token)."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for ch in "abcdefghijklmnopqrstuvwxyz":
        vocab[ch] = len(vocab)
        vocab[ch + "</w>"] = len(vocab)
    params = _init_params(CLIPTokenizer)
    if "vocab_file" in params:  # transformers 4.x: file based (slow) tokenizer
        with tempfile.TemporaryDirectory(prefix="tiny_clip_tok_") as tmp:
            vocab_file = os.path.join(tmp, "vocab.json")
            merges_file = os.path.join(tmp, "merges.txt")
            with open(vocab_file, "w", encoding="utf-8") as f:
                json.dump(vocab, f)
            with open(merges_file, "w", encoding="utf-8") as f:
                f.write("#version: 0.2\n")
            return CLIPTokenizer(vocab_file=vocab_file, merges_file=merges_file, model_max_length=77)
    # transformers 5.x: the tokenizer takes the vocabulary and merges directly
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


_CLIP_VOCAB_SIZE = 64  # >= 54 tokens of the tokenizer above
_CLIP_EOS_ID = 1


def _t5_tokenizer():
    """A whitespace word-level tokenizer with T5's special tokens (<pad>=0, </s>=1,
    <unk>=2) that appends </s>, like T5/UMT5 tokenizers do."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for word in _WORDS:
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=512,
    )


_T5_VOCAB_SIZE = 64  # >= len(_WORDS) + 3


# --------------------------------------------------------------------------------------
# components
# --------------------------------------------------------------------------------------


def _ready(module: torch.nn.Module) -> torch.nn.Module:
    """Inference mode (no dropout), float32, CPU, no gradients needed."""
    module.eval()
    module.requires_grad_(False)
    # Freshly constructed modules are float32 on the CPU already; check rather than cast
    # (diffusers warns about `.to(dtype)` on models with fp32-pinned submodules).
    for param in module.parameters():
        if param.dtype != torch.float32 or param.device.type != "cpu":
            raise RuntimeError(f"{type(module).__name__}: {param.dtype} on {param.device}")
    return module


def _seeded(seed: int, factory: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    torch.manual_seed(seed)
    return _ready(factory())


def _clip_config(hidden: int, projection: int):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=_CLIP_VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        projection_dim=projection,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=77,
        hidden_act="quick_gelu",
        layer_norm_eps=1e-5,
        attention_dropout=0.0,
        dropout=0.0,
        bos_token_id=0,
        eos_token_id=_CLIP_EOS_ID,
        pad_token_id=_CLIP_EOS_ID,
    )


def _clip_text(seed: int, hidden: int = 32, projection: int = 32, with_projection=False):
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    cls = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    config = _clip_config(hidden, projection)
    return _seeded(seed, lambda: cls(config))


def _t5_kwargs(d_model: int) -> dict:
    return dict(
        vocab_size=_T5_VOCAB_SIZE,
        d_model=d_model,
        d_kv=8,
        d_ff=2 * d_model,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        dropout_rate=0.0,
        feed_forward_proj="gated-gelu",
        layer_norm_epsilon=1e-6,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )


def _t5_encoder(seed: int, d_model: int = 32):
    from transformers import T5Config, T5EncoderModel

    config = T5Config(**_t5_kwargs(d_model))
    return _seeded(seed, lambda: T5EncoderModel(config))


def _umt5_encoder(seed: int, d_model: int = 32):
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(**_t5_kwargs(d_model))
    return _seeded(seed, lambda: UMT5EncoderModel(config))


def _vae(seed: int, blocks=(8, 16), latent_channels=4, scaling=0.18215, shift=None, quant=True):
    kwargs = dict(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(blocks),
        up_block_types=("UpDecoderBlock2D",) * len(blocks),
        block_out_channels=tuple(blocks),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=32,
        scaling_factor=scaling,
    )
    if shift is not None:
        kwargs["shift_factor"] = shift
    if not quant:
        kwargs.update(use_quant_conv=False, use_post_quant_conv=False)
    return _seeded(seed, lambda: diffusers.AutoencoderKL(**kwargs))


_UNET_BLOCKS = dict(
    block_out_channels=(8, 16),
    layers_per_block=1,
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    norm_num_groups=4,
    attention_head_dim=2,
)


def _unet(seed: int, cross_attention_dim: int, **extra):
    kwargs = dict(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=cross_attention_dim,
        **_UNET_BLOCKS,
    )
    kwargs.update(extra)
    return _seeded(seed, lambda: diffusers.UNet2DConditionModel(**kwargs))


def _sd_scheduler():
    return diffusers.DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )


def _make(cls, **components):
    """Instantiate ``cls`` with ``components``; optional extras the installed version
    knows (image_encoder, feature_extractor, safety_checker) are set to None."""
    params = _init_params(cls)
    for opt in ("image_encoder", "feature_extractor", "safety_checker"):
        if opt in params and opt not in components:
            components[opt] = None
    unknown = [k for k in components if k not in params]
    if unknown:
        raise TypeError(f"{cls.__name__} does not take {unknown}")
    pipe = cls(**components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _build_sd15():
    return _make(
        diffusers.StableDiffusionPipeline,
        vae=_vae(1),
        text_encoder=_clip_text(2, hidden=16),
        tokenizer=_clip_tokenizer(),
        unet=_unet(3, cross_attention_dim=16),
        scheduler=_sd_scheduler(),
        requires_safety_checker=False,
    )


def _unzero(module: torch.nn.Module, std: float = 0.05) -> torch.nn.Module:
    """Give all-zero weight matrices/kernels small random values.

    ControlNet zero-initialises its output convolutions, so a fresh one would add
    nothing to the UNet and a test could not tell whether it ran correctly."""
    with torch.no_grad():
        for param in module.parameters():
            if param.dim() > 1 and not param.any():
                param.normal_(0.0, std)
    return module


def _build_sd_controlnet():
    controlnet = _seeded(
        4,
        lambda: _unzero(
            diffusers.ControlNetModel(
                in_channels=4,
                cross_attention_dim=16,
                conditioning_embedding_out_channels=(4, 8),  # 2x down = VAE factor
                **_UNET_BLOCKS,
            )
        ),
    )
    return _make(
        diffusers.StableDiffusionControlNetPipeline,
        vae=_vae(1),
        text_encoder=_clip_text(2, hidden=16),
        tokenizer=_clip_tokenizer(),
        unet=_unet(3, cross_attention_dim=16),
        controlnet=controlnet,
        scheduler=_sd_scheduler(),
        requires_safety_checker=False,
    )


def _build_sdxl():
    time_dim, proj_dim = 8, 16
    unet = _unet(
        3,
        cross_attention_dim=32,  # 16 (text_encoder) + 16 (text_encoder_2)
        addition_embed_type="text_time",
        addition_time_embed_dim=time_dim,
        projection_class_embeddings_input_dim=6 * time_dim + proj_dim,
        use_linear_projection=True,
    )
    return _make(
        diffusers.StableDiffusionXLPipeline,
        vae=_vae(1),
        text_encoder=_clip_text(2, hidden=16),
        text_encoder_2=_clip_text(5, hidden=16, projection=proj_dim, with_projection=True),
        tokenizer=_clip_tokenizer(),
        tokenizer_2=_clip_tokenizer(),
        unet=unet,
        scheduler=_sd_scheduler(),
        add_watermarker=False,
    )


def _build_sd3():
    transformer = _seeded(
        3,
        lambda: diffusers.SD3Transformer2DModel(
            sample_size=16,
            patch_size=1,
            in_channels=4,
            out_channels=4,
            num_layers=1,
            attention_head_dim=8,
            num_attention_heads=4,
            joint_attention_dim=32,  # T5 d_model (CLIP 16 + 16 is padded up to it)
            caption_projection_dim=32,
            pooled_projection_dim=32,  # 16 + 16 CLIP projections
            pos_embed_max_size=16,
        ),
    )
    return _make(
        diffusers.StableDiffusion3Pipeline,
        transformer=transformer,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_vae(1, latent_channels=4, scaling=1.5305, shift=0.0609, quant=False),
        text_encoder=_clip_text(2, hidden=16, projection=16, with_projection=True),
        tokenizer=_clip_tokenizer(),
        text_encoder_2=_clip_text(5, hidden=16, projection=16, with_projection=True),
        tokenizer_2=_clip_tokenizer(),
        text_encoder_3=_t5_encoder(6, d_model=32),
        tokenizer_3=_t5_tokenizer(),
    )


def _flux_components():
    transformer = _seeded(
        3,
        lambda: diffusers.FluxTransformer2DModel(
            patch_size=1,
            in_channels=16,  # 4 latent channels packed 2x2
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,  # T5 d_model
            pooled_projection_dim=32,  # CLIP hidden size (pooler output)
            axes_dims_rope=(4, 4, 8),
        ),
    )
    return dict(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
        vae=_vae(1, latent_channels=4, scaling=0.3611, shift=0.1159, quant=False),
        text_encoder=_clip_text(2, hidden=32),
        tokenizer=_clip_tokenizer(),
        text_encoder_2=_t5_encoder(6, d_model=32),
        tokenizer_2=_t5_tokenizer(),
        transformer=transformer,
    )


def _build_flux():
    return _make(diffusers.FluxPipeline, **_flux_components())


def _build_flux_img2img():
    return _make(diffusers.FluxImg2ImgPipeline, **_flux_components())


_WAN_Z = 4


def _wan_transformer(seed: int):
    return _seeded(
        seed,
        lambda: diffusers.WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=12,  # rope split 4/4/4 over (t, h, w)
            in_channels=_WAN_Z,
            out_channels=_WAN_Z,
            text_dim=32,  # UMT5 d_model
            freq_dim=32,
            ffn_dim=32,
            num_layers=1,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
        ),
    )


def _build_wan(two_experts: bool):
    vae = _seeded(
        1,
        lambda: diffusers.AutoencoderKLWan(
            base_dim=4,
            z_dim=_WAN_Z,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
            latents_mean=[0.1, -0.2, 0.05, 0.0][:_WAN_Z],
            latents_std=[1.5, 2.0, 1.0, 2.5][:_WAN_Z],
        ),
    )
    components = dict(
        tokenizer=_t5_tokenizer(),
        text_encoder=_umt5_encoder(6, d_model=32),
        vae=vae,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
        transformer=_wan_transformer(3),
    )
    if two_experts:
        components["transformer_2"] = _wan_transformer(7)
        components["boundary_ratio"] = _WAN_BOUNDARY_RATIO
    elif "transformer_2" in _init_params(diffusers.WanPipeline):
        components["transformer_2"] = None
    return _make(diffusers.WanPipeline, **components)


_BUILDERS = {
    "sd15": _build_sd15,
    "sdxl": _build_sdxl,
    "sd3": _build_sd3,
    "flux": _build_flux,
    "flux_img2img": _build_flux_img2img,
    "wan21": lambda: _build_wan(False),
    "wan22": lambda: _build_wan(True),
    "sd_controlnet": _build_sd_controlnet,
}
