"""A minimal quantized weight for tests that need no quantization library: a wrapper tensor subclass (as torchao's
and optimum-quanto's are) whose bytes are an int8 `qdata` and a float32 per-row `scale`, dequantized for any other
operation. Its `numel() * element_size()` is the float32 size; its storages hold about a quarter of that."""

from __future__ import annotations

import torch

aten = torch.ops.aten


class Int8Rows(torch.Tensor):
    """`qdata * scale` (rows of int8 times one float32 per row), held in two inner tensors."""

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=torch.float32, device=qdata.device)

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor):
        self.qdata = qdata
        self.scale = scale

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> "Int8Rows":
        scale = weight.detach().abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127
        return cls(torch.round(weight.detach() / scale).to(torch.int8), scale.to(torch.float32))

    def dequantize(self) -> torch.Tensor:
        return self.qdata.to(torch.float32) * self.scale

    def __tensor_flatten__(self):
        return ["qdata", "scale"], None

    @staticmethod
    def __tensor_unflatten__(inner, context, size, stride):
        return Int8Rows(inner["qdata"], inner["scale"])

    def __repr__(self):
        return f"Int8Rows(shape={tuple(self.shape)}, device={self.qdata.device})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.clone.default, aten._to_copy.default):
            self = args[0]
            # A move (device) applies to both inner tensors; a dtype conversion would dequantize: not supported.
            inner = {k: v for k, v in kwargs.items() if k in ("device", "non_blocking", "memory_format")}
            return Int8Rows(func(self.qdata, **inner), func(self.scale, **inner))
        if func is aten.copy_.default:
            args[0].qdata.copy_(args[1].qdata)
            args[0].scale.copy_(args[1].scale)
            return args[0]

        def plain(value):
            return value.dequantize() if isinstance(value, Int8Rows) else value

        args = torch.utils._pytree.tree_map(plain, args)
        kwargs = torch.utils._pytree.tree_map(plain, kwargs)
        return func(*args, **kwargs)


def quantize_linears(module: torch.nn.Module, min_features: int = 1) -> torch.nn.Module:
    """Replace the weight of every `Linear` under `module` by its `Int8Rows` (in place); returns `module`."""
    for sub in module.modules():
        if isinstance(sub, torch.nn.Linear) and sub.in_features >= min_features:
            sub.weight = torch.nn.Parameter(Int8Rows.quantize(sub.weight), requires_grad=False)
    return module


def true_bytes(module: torch.nn.Module) -> int:
    """Bytes of `module`'s storages, written out from what this file knows: each `Int8Rows` is its int8 rows and
    its float32 scales, every other tensor its own elements (the tiny pipelines tie no weights)."""
    total = 0
    seen = set()
    for tensor in list(module.parameters()) + list(module.buffers()):
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if isinstance(tensor, Int8Rows):
            total += tensor.qdata.numel() * 1 + tensor.scale.numel() * 4
        else:
            total += tensor.numel() * tensor.element_size()
    return total
