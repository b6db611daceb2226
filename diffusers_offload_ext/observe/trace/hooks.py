"""Wrapping what can move weights: every offload hook method (accelerate's `_hf_hook` objects and the hooks they
chain, diffusers' hook registries) and the pipeline's class (its calls, progress bar and offload methods) are
wrapped so that each tells the tracer; `Wrappers.restore` puts every one back."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Set, Tuple

import torch

from ...marks import MARK

#: Pipeline methods that may move weights; each is bracketed by a look at every tensor.
PIPELINE_METHODS = (
    "enable_model_cpu_offload",
    "enable_sequential_cpu_offload",
    "enable_group_offload",
    "maybe_free_model_hooks",
    "remove_all_hooks",
    "reset_device_map",
    "to",
)
#: Class attribute of a traced pipeline's class that holds its tracer.
TRACER_ATTR = "_offload_ext_tracer"
_HOOK_METHODS = ("pre_forward", "post_forward", "init_hook")
_GROUP_METHODS = ("pre_forward", "post_forward")


def hook_chain(hook) -> List[Any]:
    """An accelerate hook and the hooks it chains (`SequentialHook.hooks`)."""
    found = [hook]
    for inner in getattr(hook, "hooks", None) or ():
        found.extend(hook_chain(inner))
    return found


def registry_hooks(module) -> List[Any]:
    """The hooks of a diffusers hook registry on `module` (group offload's among them)."""
    registry = getattr(module, "_diffusers_hook", None)
    hooks = getattr(registry, "hooks", None)
    return list(hooks.values()) if isinstance(hooks, dict) else []


class Wrappers:
    """The hook methods wrapped so far, each once, and how to put each back.

    Args:
        bracket (`Callable`): `bracket(run, scopes, label)` runs `run()` between two looks at `scopes`.
        group_event (`Callable`): `group_event(hook, module, component, method)` after a group-offload hook method.
    """

    def __init__(self, bracket: Callable, group_event: Callable) -> None:
        self.bracket = bracket
        self.group_event = group_event
        self.wrapped: List[Tuple[Any, str, bool, Any]] = []
        self.ids: Set[Tuple[int, str]] = set()

    def wrap_all(self, modules: Dict[str, torch.nn.Module], everything: List) -> None:
        """Wrap the hook methods found on every sub-module of `modules`; a component's root hook is bracketed by a
        look at `everything`, a sub-module's by a look at its own subtree."""
        for component, root in modules.items():
            for prefix, module in root.named_modules():
                hook = getattr(module, "_hf_hook", None)
                scopes = everything if module is root else [(component, module, prefix)]
                if hook is not None:
                    for inner in hook_chain(hook):
                        for method in _HOOK_METHODS:
                            self.wrap(inner, method, component, scopes, prefix)
                for hook in registry_hooks(module):
                    fn_ref = getattr(hook, "fn_ref", None)
                    if fn_ref is not None:
                        for method in _GROUP_METHODS:
                            self.wrap(fn_ref, method, component, scopes, prefix, (hook, module))

    def wrap(self, owner, method: str, component: str, scopes, prefix: str, group=None) -> None:
        original = getattr(owner, method, None)
        if original is None or (id(owner), method) in self.ids:
            return
        bracket, group_event = self.bracket, self.group_event
        label = f"{type(group[0] if group else owner).__name__}.{method}({component}{'.' + prefix if prefix else ''})"

        def wrapper(*args, **kwargs):
            result = bracket(lambda: original(*args, **kwargs), scopes, label)
            if group is not None:
                group_event(group[0], group[1], component, method)
            return result

        had_own = method in getattr(owner, "__dict__", {})
        self.wrapped.append((owner, method, had_own, original if had_own else None))
        self.ids.add((id(owner), method))
        setattr(owner, method, wrapper)

    def restore(self) -> None:
        for owner, attr, had_own, previous in reversed(self.wrapped):
            if had_own:
                setattr(owner, attr, previous)
            else:
                try:
                    delattr(owner, attr)
                except AttributeError:
                    pass
        self.wrapped.clear()
        self.ids.clear()


def traced_class(cls: type, tracer) -> type:
    """A subclass of the pipeline's class whose calls, progress bars and offload methods tell `tracer`
    (`begin_call`, `end_call`, `wrap_bar`, `bracket_pipeline`)."""

    def __call__(self, *args, **kwargs):
        failed = True
        tracer.begin_call()
        try:
            result = super(traced, self).__call__(*args, **kwargs)
            failed = False
            return result
        finally:
            tracer.end_call(failed)

    setattr(__call__, MARK, cls.__call__)

    def progress_bar(self, iterable=None, total=None):
        bar = super(traced, self).progress_bar(iterable=iterable, total=total)
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        return tracer.wrap_bar(bar, total)

    def pipeline_method(name):
        def method(self, *args, **kwargs):
            stock = getattr(super(traced, self), name)
            return tracer.bracket_pipeline(name, lambda: stock(*args, **kwargs))

        method.__name__ = name
        return method

    namespace = {"__call__": __call__, "progress_bar": progress_bar, TRACER_ATTR: tracer}
    namespace.update(__module__=cls.__module__, __qualname__=cls.__qualname__, __doc__=cls.__doc__)
    namespace.update({name: pipeline_method(name) for name in PIPELINE_METHODS if hasattr(cls, name)})
    traced = type(cls.__name__, (cls,), namespace)
    return traced
