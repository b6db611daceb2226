"""Where the block streamer's code runs around a block's call: as forward hooks, or, for a block compiled in place
(`module.compile()`, as diffusers' regional compilation `compile_repeated_blocks()` compiles each block), around its
compiled call, outside the graph: a forward hook would run inside the compiled `_call_impl`, where Dynamo breaks the
graph at it (and `fullgraph=True` refuses it)."""

from __future__ import annotations

from typing import Callable, Optional

import torch


class Around:
    """`before()` and `after()` around every call of `module` until `remove()`; `after` runs even when the call
    raises (`always_call`)."""

    def __init__(self, module: torch.nn.Module, before: Callable[[], None], after: Optional[Callable[[], None]]):
        self.module, self.handles = module, []
        self.compiled = getattr(module, "_compiled_call_impl", None)
        if self.compiled is None:
            self.call = None
            self.handles.append(module.register_forward_pre_hook(lambda m, args: before()))
            if after is not None:
                self.handles.append(module.register_forward_hook(lambda m, a, out: after(), always_call=True))
            return

        compiled = self.compiled

        def call(*args, **kwargs):
            before()
            if after is None:
                return compiled(*args, **kwargs)
            try:
                return compiled(*args, **kwargs)
            finally:
                after()

        self.call = module._compiled_call_impl = call

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if self.call is not None and getattr(self.module, "_compiled_call_impl", None) is self.call:
            self.module._compiled_call_impl = self.compiled
        self.call = None
