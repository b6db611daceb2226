"""How the extension's methods get onto pipeline classes: `install()` / `uninstall()` for every `DiffusionPipeline`,
and `OffloadMixin` for one class of your own."""

from __future__ import annotations

from typing import List, Tuple

from diffusers import DiffusionPipeline
from diffusers.utils import logging

from ..marks import ADAPTED, MARK
from .methods import METHODS, guard_call
from .overrides import adapt, own_override

logger = logging.get_logger(f"diffusers.{__name__}")

_NOTHING = object()

# What install() changed, so that uninstall() can put it back exactly.
_saved_methods: dict = {}
_saved_init_subclass = _NOTHING
_wrapped_calls: List[Tuple[type, object]] = []
_adapted: List[Tuple[type, object]] = []
_installed = False


def is_installed() -> bool:
    """Whether `install()` is in effect."""
    return _installed


def _subclasses(cls: type):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _wrap_call(cls: type) -> None:
    """Guard the class's own `__call__`, and give its own `enable_model_cpu_offload` (if any) the new options."""
    call = cls.__dict__.get("__call__")
    if call is not None and getattr(call, MARK, None) is None:
        cls.__call__ = guard_call(call)
        _wrapped_calls.append((cls, call))
    enable = cls.__dict__.get("enable_model_cpu_offload")
    if cls is not DiffusionPipeline and enable is not None and getattr(enable, ADAPTED, None) is None:
        cls.enable_model_cpu_offload = adapt(enable)
        _adapted.append((cls, enable))


def _init_subclass(cls, **kwargs):
    if _saved_init_subclass is _NOTHING:
        super(DiffusionPipeline, cls).__init_subclass__(**kwargs)
    else:
        _saved_init_subclass.__get__(None, cls)(**kwargs)
    _wrap_call(cls)


def install() -> None:
    """Add `exclude_from_offload` and `keep_on_device_during_generation` to every `DiffusionPipeline`.

    Replaces `enable_model_cpu_offload`, `remove_all_hooks`, `to`, `maybe_free_model_hooks`, `progress_bar` and
    `__setattr__` on `DiffusionPipeline` (each calls stock's and tells the pipeline's offload session), and wraps the
    `__call__` of every pipeline class, those imported already and those imported later, so that calls are tracked
    and a call that raises still offloads. Calling it again does nothing; `uninstall()` undoes it.

    Example:

    ```py
    >>> import diffusers_offload_ext as doe

    >>> doe.install()
    >>> pipe.enable_model_cpu_offload(exclude_from_offload=["transformer"])
    ```
    """
    global _installed, _saved_init_subclass
    if _installed:
        return
    for name, method in METHODS.items():
        _saved_methods[name] = DiffusionPipeline.__dict__[name]
        setattr(DiffusionPipeline, name, method)
    _saved_init_subclass = DiffusionPipeline.__dict__.get("__init_subclass__", _NOTHING)
    DiffusionPipeline.__init_subclass__ = classmethod(_init_subclass)
    for cls in [DiffusionPipeline, *_subclasses(DiffusionPipeline)]:
        _wrap_call(cls)
    _installed = True
    logger.info("diffusers-offload-ext installed on DiffusionPipeline.")


def uninstall() -> None:
    """Undo `install()`: stock methods back on `DiffusionPipeline`, every wrapped `__call__` unwrapped.

    Pipelines that enabled the extension's offload keep their hooks until they re-enable offload, remove the
    hooks, or are deleted; classes and pipelines created afterwards carry no trace of the extension.
    """
    global _installed, _saved_init_subclass
    if not _installed:
        return
    for name, method in _saved_methods.items():
        setattr(DiffusionPipeline, name, method)
    _saved_methods.clear()
    if _saved_init_subclass is _NOTHING:
        del DiffusionPipeline.__init_subclass__
    else:
        DiffusionPipeline.__init_subclass__ = _saved_init_subclass
    _saved_init_subclass = _NOTHING
    for cls, call in reversed(_wrapped_calls):
        cls.__call__ = call
    _wrapped_calls.clear()
    for cls, enable in reversed(_adapted):
        cls.enable_model_cpu_offload = enable
    _adapted.clear()
    _installed = False
    logger.info("diffusers-offload-ext uninstalled.")


class OffloadMixin:
    """Put before a `DiffusionPipeline` class to get the new offload options without `install()`.

    Example:

    ```py
    >>> import diffusers_offload_ext as doe
    >>> from diffusers import FluxPipeline


    >>> class MyFlux(doe.OffloadMixin, FluxPipeline):
    ...     pass


    >>> pipe = MyFlux.from_pretrained("black-forest-labs/FLUX.1-dev", torch_dtype=torch.bfloat16)
    >>> pipe.enable_model_cpu_offload(keep_on_device_during_generation=True)
    ```
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if not issubclass(cls, DiffusionPipeline):
            return
        if not getattr(cls.__dict__.get("__call__"), MARK, None):
            cls.__call__ = guard_call(cls.__call__)
        override = own_override(cls)
        if override is not None and "enable_model_cpu_offload" not in cls.__dict__:
            cls.enable_model_cpu_offload = adapt(override)


for _name, _method in METHODS.items():  # the replaced methods, on the mixin
    setattr(OffloadMixin, _name, _method)
