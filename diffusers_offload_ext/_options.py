"""The options of `enable_model_cpu_offload`: validation, normalisation and the sticky merge."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, Dict, Optional, Tuple, Union

import torch

EXCLUDE = "exclude_from_offload"
KEEP = "keep_on_device_during_generation"


@dataclasses.dataclass(frozen=True)
class OffloadOptions:
    """The options in force on one pipeline (what `None` arguments keep on the next enable).

    Args:
        exclude_from_offload (`Tuple[str, ...]`, defaults to `()`): Components pinned on the execution device.
        keep_all (`bool`, defaults to `False`): `keep_on_device_during_generation=True` (every offloaded component).
        keep (`Tuple[str, ...]`, defaults to `()`): Components named in `keep_on_device_during_generation`.
    """

    exclude_from_offload: Tuple[str, ...] = ()
    keep_all: bool = False
    keep: Tuple[str, ...] = ()

    def kept(self, offloaded: Iterable[str]) -> frozenset:
        """The names among `offloaded` that the chain must not evict."""
        offloaded = list(offloaded)
        return frozenset(offloaded) if self.keep_all else frozenset(n for n in self.keep if n in offloaded)

    @property
    def keep_argument(self) -> Union[bool, Tuple[str, ...]]:
        """The value as a user would pass it again."""
        return True if self.keep_all else self.keep


def module_components(components: Mapping[str, Any]) -> Dict[str, torch.nn.Module]:
    """The components that are `torch.nn.Module`s, in the pipeline's order."""
    return {name: value for name, value in components.items() if isinstance(value, torch.nn.Module)}


def _names(argument: str, value: Any, components: Mapping[str, Any]) -> Tuple[str, ...]:
    """Validate a str or an iterable of component names; return them in order, each once."""
    if isinstance(value, str):
        names = [value]
    elif isinstance(value, (bytes, bytearray, Mapping)) or not isinstance(value, Iterable):
        raise TypeError(
            f"`{argument}` must be a component name (str) or a list of component names, got {value!r} "
            f"of type {type(value).__name__}."
        )
    else:
        names = list(value)
        wrong = [name for name in names if not isinstance(name, str)]
        if wrong:
            raise TypeError(f"`{argument}` must contain only component names (str), got {wrong!r} in {names!r}.")
    valid = list(module_components(components))
    unknown = [name for name in names if name not in components]
    if unknown:
        raise ValueError(
            f"`{argument}` names unknown components {unknown!r}. Valid component names are {valid!r}: "
            f"pass only those."
        )
    not_modules = [name for name in names if not isinstance(components[name], torch.nn.Module)]
    if not_modules:
        kinds = {name: type(components[name]).__name__ for name in not_modules}
        raise ValueError(
            f"`{argument}` names components that are not `torch.nn.Module`s ({kinds!r}), so there is nothing to "
            f"offload or keep. Valid component names are {valid!r}."
        )
    return tuple(dict.fromkeys(names))


def resolve_options(
    previous: OffloadOptions,
    components: Mapping[str, Any],
    exclude_from_offload: Any = None,
    keep_on_device_during_generation: Any = None,
) -> OffloadOptions:
    """Validate the new arguments and merge them with the ones in force (`None` keeps what was set before).

    Raises:
        `TypeError`: an argument of the wrong type.
        `ValueError`: a name that is not a component, or whose component is not a `torch.nn.Module`.
    """
    if exclude_from_offload is None:
        exclude = tuple(n for n in previous.exclude_from_offload if isinstance(components.get(n), torch.nn.Module))
    elif isinstance(exclude_from_offload, bool):
        raise TypeError(
            f"`{EXCLUDE}` must be a component name (str) or a list of component names, got {exclude_from_offload!r}. "
            f"Pass `[]` to offload every component."
        )
    else:
        exclude = _names(EXCLUDE, exclude_from_offload, components)

    if keep_on_device_during_generation is None:
        keep_all = previous.keep_all
        keep = tuple(n for n in previous.keep if isinstance(components.get(n), torch.nn.Module))
    elif isinstance(keep_on_device_during_generation, bool):
        keep_all, keep = keep_on_device_during_generation, ()
    else:
        keep_all, keep = False, _names(KEEP, keep_on_device_during_generation, components)
    return OffloadOptions(exclude_from_offload=exclude, keep_all=keep_all, keep=keep)


def resolve_device(
    gpu_id: Any,
    device: Any,
    previous_device: Optional[torch.device],
    previous_gpu_id: Optional[int],
) -> Tuple[torch.device, int]:
    """Pick the execution device the way stock does, with `device=None` keeping the device set before.

    Returns:
        `(torch.device, int)`: the execution device (always with an index, like stock's `cuda:0`) and its index.
    """
    if gpu_id is not None and (isinstance(gpu_id, bool) or not isinstance(gpu_id, int)):
        raise TypeError(f"`gpu_id` must be an int or None, got {gpu_id!r}.")
    if gpu_id is not None and gpu_id < 0:
        raise ValueError(f"`gpu_id` must be >= 0, got {gpu_id!r}.")
    if device is not None and not isinstance(device, (str, torch.device)):
        raise TypeError(f"`device` must be a str, a `torch.device` or None, got {device!r}.")
    if device is None:
        if previous_device is not None:
            device = torch.device(previous_device.type)
        else:
            device = _default_device()
    try:
        torch_device = torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"`device` must name a torch device such as 'cuda' or 'cuda:1', got {device!r}.") from error
    if gpu_id is not None and torch_device.index is not None:
        raise ValueError(
            f"You passed both `gpu_id`={gpu_id!r} and an index in `device`={device!r}. Pass only one of them, "
            f"for example `device={torch_device.type!r}, gpu_id={gpu_id!r}`."
        )
    if gpu_id is not None:
        index = gpu_id
    elif torch_device.index is not None:
        index = torch_device.index
    else:
        index = previous_gpu_id or 0
    return torch.device(torch_device.type, index), index


def _default_device() -> str:
    try:
        from diffusers.utils.torch_utils import get_device
    except ImportError:  # diffusers < 0.33 defaults to CUDA
        return "cuda"
    found = get_device()
    if found == "cpu":
        raise RuntimeError(
            "`enable_model_cpu_offload` requires an accelerator, but none was found. Pass `device='cpu'` to run "
            "the offload machinery on the CPU (useful for tests)."
        )
    return found
