"""Test-side observers that do not trust the code under test: a spy on `torch.nn.Module.to` and a recorder of
component calls."""

from __future__ import annotations

import contextlib

import torch

EXEC = torch.device("cpu", 0)  # what `device="cpu"` becomes: stock and we index the execution device
HOST = torch.device("cpu")


def nbytes(module: torch.nn.Module) -> int:
    seen = {}
    for tensor in list(module.parameters()) + list(module.buffers()):
        seen[id(tensor)] = tensor.numel() * tensor.element_size()
    return sum(seen.values())


def modules_of(pipe) -> dict:
    return {n: m for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}


class MoveSpy:
    """Patches `torch.nn.Module.to` and keeps every call made on one of the pipeline's components.

    Onload = a `.to()` to the indexed execution device (`cpu:0`); offload = a `.to()` to plain `cpu`. `placement`
    follows those calls, so it is where the component really is from the point of view of the code that moves it.
    `call_index` is set by the test around each pipeline call.
    """

    def __init__(self, pipe, on_device=(), exec_device=EXEC):
        self.pipe = pipe
        self.exec_device = exec_device
        self.names = {id(m): n for n, m in modules_of(pipe).items()}
        self.calls = []  # (component, target device, call_index), every .to() on a component
        self.placement = {n: (n in on_device) for n in modules_of(pipe)}
        self.initial = dict(self.placement)
        self.call_index = None
        self._original = None

    def __enter__(self):
        spy, original = self, torch.nn.Module.to
        self._original = original

        def to(module, *args, **kwargs):
            name = spy.names.get(id(module))
            if name is not None:
                device = torch._C._nn._parse_to(*args, **kwargs)[0]
                if device is not None:
                    spy.calls.append((name, device, spy.call_index))
                    spy.placement[name] = device == spy.exec_device
            return original(module, *args, **kwargs)

        torch.nn.Module.to = to
        return self

    def __exit__(self, *exc):
        torch.nn.Module.to = self._original

    def moves(self):
        """The calls that changed placement: (component, direction, call_index)."""
        where = dict(self.initial)
        out = []
        for name, device, call_index in self.calls:
            on = device == self.exec_device
            if where.get(name, False) != on:
                out.append((name, "onload" if on else "offload", call_index))
            where[name] = on
        return out


class CallRecorder:
    """Wraps each component's `forward`, `encode` and `decode` on the instance to record which component ran.

    Install it before enabling offload: accelerate then wraps our wrapper, and its hook removal restores it.
    """

    METHODS = ("forward", "encode", "decode")

    def __init__(self, pipe):
        self.calls = [[]]
        for name, module in modules_of(pipe).items():
            for method in self.METHODS:
                bound = getattr(module, method, None)
                if callable(bound) and not hasattr(bound, "_recorded"):
                    setattr(module, method, self._wrap(name, bound))

    def _wrap(self, name, bound):
        def recorded(*args, **kwargs):
            self.calls[-1].append(name)
            return bound(*args, **kwargs)

        recorded._recorded = True
        return recorded

    def next_call(self):
        if self.calls[-1]:
            self.calls.append([])


@contextlib.contextmanager
def calling(spy, index):
    spy.call_index = index
    try:
        yield
    finally:
        spy.call_index = None
