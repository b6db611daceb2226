"""A tiny Kandinsky 2.2 image-to-image combined pipeline built from configs (a prior pipeline and a decoder pipeline
sharing the combined pipeline's components): the combined pipeline the every-pipeline tests run end to end."""

from __future__ import annotations

import torch

from .tiny_models import _clip_text, _clip_tokenizer, _seeded

SIZE = 32
STEPS = 2
PRIOR_STEPS = 2


def _vision(seed: int):
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    config = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        projection_dim=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
        num_channels=3,
    )
    return _seeded(seed, lambda: CLIPVisionModelWithProjection(config))


def _unet(seed: int):
    from diffusers import UNet2DConditionModel

    return _seeded(
        seed,
        lambda: UNet2DConditionModel(
            sample_size=8,
            in_channels=4,
            out_channels=8,
            addition_embed_type="image",
            down_block_types=("ResnetDownsampleBlock2D", "SimpleCrossAttnDownBlock2D"),
            up_block_types=("SimpleCrossAttnUpBlock2D", "ResnetUpsampleBlock2D"),
            mid_block_type="UNetMidBlock2DSimpleCrossAttn",
            block_out_channels=(16, 32),
            layers_per_block=1,
            encoder_hid_dim=32,
            encoder_hid_dim_type="image_proj",
            cross_attention_dim=32,
            attention_head_dim=4,
            resnet_time_scale_shift="scale_shift",
            norm_num_groups=8,
        ),
    )


def _movq(seed: int):
    from diffusers import VQModel

    return _seeded(
        seed,
        lambda: VQModel(
            block_out_channels=(32, 64),
            down_block_types=("DownEncoderBlock2D", "AttnDownEncoderBlock2D"),
            up_block_types=("AttnUpDecoderBlock2D", "UpDecoderBlock2D"),
            in_channels=3,
            out_channels=3,
            latent_channels=4,
            layers_per_block=1,
            norm_num_groups=8,
            norm_type="spatial",
            num_vq_embeddings=12,
            vq_embed_dim=4,
        ),
    )


def build_kandinsky22_img2img_combined():
    """A `KandinskyV22Img2ImgCombinedPipeline` with tiny random components, on the host."""
    from diffusers import DDIMScheduler, KandinskyV22Img2ImgCombinedPipeline, PriorTransformer, UnCLIPScheduler
    from transformers import CLIPImageProcessor

    prior = _seeded(
        3, lambda: PriorTransformer(num_attention_heads=2, attention_head_dim=16, embedding_dim=32, num_layers=1)
    )
    pipe = KandinskyV22Img2ImgCombinedPipeline(
        unet=_unet(4),
        scheduler=DDIMScheduler(
            num_train_timesteps=1000, beta_schedule="linear", beta_start=0.00085, beta_end=0.012, clip_sample=False
        ),
        movq=_movq(5),
        prior_prior=prior,
        prior_image_encoder=_vision(2),
        prior_text_encoder=_clip_text(1, with_projection=True),
        prior_tokenizer=_clip_tokenizer(),
        prior_scheduler=UnCLIPScheduler(variance_type="fixed_small_log", prediction_type="sample", clip_sample=True),
        prior_image_processor=CLIPImageProcessor(crop_size=32, size=32),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run(pipe, *, seed: int = 0) -> torch.Tensor:
    """One call with a fixed prompt and input image; the images as a float32 CPU tensor."""
    generator = torch.Generator("cpu").manual_seed(seed)
    from PIL import Image

    pixels = torch.rand(SIZE, SIZE, 3, generator=torch.Generator("cpu").manual_seed(1234))
    image = Image.fromarray((pixels * 255).to(torch.uint8).numpy())  # a PIL image: every diffusers version takes it
    out = pipe(
        prompt="a red cat",
        image=image,
        num_inference_steps=STEPS,
        prior_num_inference_steps=PRIOR_STEPS,
        height=SIZE,
        width=SIZE,
        strength=0.6,
        generator=generator,
        output_type="pt",
    )
    return torch.as_tensor(out.images).detach().to("cpu", torch.float32)
