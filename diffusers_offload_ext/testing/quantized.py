"""Tiny FLUX pipelines with quantized weights, as users load them: the tiny pipeline saved with `save_pretrained`
and reloaded through each backend's own loading path (transformer and T5 text encoder), for tests and the matrix.

Backends (`BACKENDS`): bitsandbytes NF4, FP4 and 8-bit; GGUF (a Q8_0 file written with the `gguf` library, loaded by
`from_single_file`); torchao int8 weight-only; optimum-quanto int8; diffusers' layerwise casting (fp8 storage,
float32 compute). Each needs its library from PyPI (`make test-quant` installs them); `available(backend)` says.

Two test-only workarounds, nothing a user would do:

- diffusers' bitsandbytes quantizers refuse to load without a GPU (`validate_environment`); `load` lifts that check
  for the duration of the load, and loads on the CPU (or straight onto the simulated accelerator, as `device_map`
  puts 8-bit weights on a GPU: they cannot move after loading).
- safetensors maps weights at offsets that are not 64-byte aligned, and the CPU's matrix kernels round differently
  there than on the aligned copy any move makes (the last bit of an image changes); `load` copies such plain weights
  into fresh memory once, so that "equal to no offload" compares the same arithmetic.
- bitsandbytes repacks 4-bit weights for its CPU kernel on their first forward on a CPU with AVX512-BF16, changing
  their layout and bytes in place; no GPU does that, so `load` turns it off (`support_avx512bf16_for_cpu`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from typing import Optional, Tuple

import torch

from . import tiny

BACKENDS = ("nf4", "fp4", "int8", "gguf", "torchao", "quanto", "layerwise")
#: What each backend needs besides diffusers and transformers.
NEEDS = {
    "nf4": "bitsandbytes",
    "fp4": "bitsandbytes",
    "int8": "bitsandbytes",
    "gguf": "gguf",
    "torchao": "torchao",
    "quanto": "optimum.quanto",
    "layerwise": None,
}
#: The matrix's transformer: wider and deeper than the tiny one (four double and four single blocks of width 64), so
#: that quantized it is still the largest component and a budget below it has blocks to stream.
WIDER = dict(num_layers=4, num_single_layers=4, num_attention_heads=4)
GGUF_FILE = "transformer-q8_0.gguf"


def available(backend: str) -> Tuple[bool, str]:
    """`(True, "")`, or `(False, why)` when the backend's library is not installed."""
    if backend not in BACKENDS:
        raise ValueError(f"`backend` {backend!r} is not one of {BACKENDS}")
    module = NEEDS[backend]
    if module is None:
        import diffusers

        if hasattr(diffusers.ModelMixin, "enable_layerwise_casting"):
            return True, ""
        return False, f"layerwise casting needs diffusers>=0.33 (installed: {diffusers.__version__})"
    if importlib.util.find_spec(module.split(".")[0]) is not None:
        return True, ""
    return False, f"{backend} needs `{module}` (`make test-quant` installs it)"


def save(directory: str) -> str:
    """Save the tiny FLUX pipeline (its transformer `WIDER`) to `directory` with `save_pretrained`, and its transformer as a
    GGUF file beside it when `gguf` is installed; returns `directory`."""
    import diffusers

    pipe = tiny.build("flux")
    config = dict(pipe.transformer.config, **WIDER)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        pipe.transformer = diffusers.FluxTransformer2DModel.from_config(config).eval().requires_grad_(False)
    pipe.save_pretrained(directory)
    if available("gguf")[0]:
        write_gguf(pipe.transformer, os.path.join(directory, GGUF_FILE))
    return directory


def write_gguf(module: torch.nn.Module, path: str) -> None:
    """Write `module`'s state dict as a GGUF file under its own names: 2-D weights whose rows split into Q8_0 blocks
    quantized to Q8_0, everything else float32."""
    import gguf

    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0]
    writer = gguf.GGUFWriter(path, arch="flux")
    for name, tensor in module.state_dict().items():
        array = tensor.detach().to(torch.float32).numpy()
        if name.endswith(".weight") and array.ndim == 2 and array.shape[1] % block == 0:
            data = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@contextlib.contextmanager
def _bitsandbytes_without_gpu():
    """Test-only: diffusers' bitsandbytes quantizers load on a machine without a GPU (see the module docstring)."""
    from diffusers.quantizers.bitsandbytes import bnb_quantizer

    classes = (bnb_quantizer.BnB4BitDiffusersQuantizer, bnb_quantizer.BnB8BitDiffusersQuantizer)
    saved = [(cls, cls.validate_environment, cls.update_device_map) for cls in classes]

    def pretend(original):
        def validate_environment(self, *args, **kwargs):
            is_available = torch.cuda.is_available
            torch.cuda.is_available = lambda: True
            try:
                return original(self, *args, **kwargs)
            finally:
                torch.cuda.is_available = is_available

        return validate_environment

    try:
        for cls, validate, _ in saved:
            cls.validate_environment = pretend(validate)
            cls.update_device_map = lambda self, device_map: device_map
        yield
    finally:
        for cls, validate, update in saved:
            cls.validate_environment, cls.update_device_map = validate, update


def _configs(backend: str):
    """`(diffusers config, transformers config)` for `backend`'s transformer and T5; `None` where not quantized
    that way."""
    import diffusers
    import transformers

    if backend in ("nf4", "fp4"):
        kwargs = dict(load_in_4bit=True, bnb_4bit_quant_type=backend, bnb_4bit_compute_dtype=torch.float32)
        return diffusers.BitsAndBytesConfig(**kwargs), transformers.BitsAndBytesConfig(**kwargs)
    if backend == "int8":
        return diffusers.BitsAndBytesConfig(load_in_8bit=True), transformers.BitsAndBytesConfig(load_in_8bit=True)
    if backend == "torchao":
        from torchao.quantization import Int8WeightOnlyConfig

        return diffusers.TorchAoConfig(Int8WeightOnlyConfig()), transformers.TorchAoConfig(Int8WeightOnlyConfig())
    if backend == "quanto":
        return diffusers.QuantoConfig(weights_dtype="int8"), transformers.QuantoConfig(weights="int8")
    return None, None


def _transformer(backend: str, directory: str, config, device_map):
    import diffusers

    cls = diffusers.FluxTransformer2DModel
    if backend == "gguf":
        gguf_config = diffusers.GGUFQuantizationConfig(compute_dtype=torch.float32)
        path = os.path.join(directory, GGUF_FILE)
        return cls.from_single_file(
            path, quantization_config=gguf_config, config=directory, subfolder="transformer", torch_dtype=torch.float32
        )
    transformer = cls.from_pretrained(
        directory, subfolder="transformer", quantization_config=config, torch_dtype=torch.float32, **device_map
    )
    if backend == "layerwise":
        transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    return transformer


def load(backend: str, directory: str, *, device: Optional[torch.device] = None):
    """The pipeline saved in `directory` (`save`) with its transformer and T5 (`text_encoder_2`) quantized by
    `backend` (GGUF: the transformer only; transformers reads GGUF T5 files only under llama.cpp's names).

    Args:
        backend (`str`): One of `BACKENDS`.
        directory (`str`): Where `save` wrote the pipeline.
        device (`torch.device`, *optional*): Load bitsandbytes 8-bit weights straight onto this device, as
            `device_map` does on a GPU (8-bit weights cannot move once loaded); others load on the CPU.
    """
    import diffusers
    import transformers

    ok, why = available(backend)
    if not ok:
        raise RuntimeError(why)
    config, text_config = _configs(backend)
    device_map = {"device_map": {"": device}} if backend == "int8" and device is not None else {}
    with _bitsandbytes_without_gpu():
        transformer = _transformer(backend, directory, config, device_map)
    text_encoder_2 = transformers.T5EncoderModel.from_pretrained(
        directory, subfolder="text_encoder_2", quantization_config=text_config, dtype=torch.float32, **device_map
    )
    if backend == "layerwise":
        from diffusers.hooks import apply_layerwise_casting

        # T5's `wo` casts its input to its weight's dtype itself: it stays float32, as do norms and embeddings.
        skip = ("norm", "wo", "shared", "embed")
        apply_layerwise_casting(
            text_encoder_2, storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32, skip_modules_pattern=skip
        )
    pipe = diffusers.FluxPipeline.from_pretrained(
        directory, transformer=transformer, text_encoder_2=text_encoder_2, torch_dtype=torch.float32
    )
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            _as_on_a_gpu(module)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _as_on_a_gpu(module: torch.nn.Module) -> None:
    """No CPU-only repacking of 4-bit weights; plain weights in aligned memory (see the module docstring)."""
    for sub in module.modules():
        if hasattr(sub, "support_avx512bf16_for_cpu"):
            sub.support_avx512bf16_for_cpu = False
        for table in (sub._parameters, sub._buffers):
            for tensor in table.values():
                if type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.data_ptr() % 64:
                    tensor.data = tensor.data.clone()
