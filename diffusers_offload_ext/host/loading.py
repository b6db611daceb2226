"""`load_file_backed`: load a pipeline from a local folder of safetensors checkpoints so that its weights stay views of
their files (file-backed: in the page cache, which the kernel may drop and read again) instead of anonymous memory,
one component at a time, so that a pipeline whose weights exceed RAM can be loaded at all.

diffusers (0.32 and later) and transformers (4.51 and later) already load a safetensors checkpoint as slices of a
private mapping of its file when no dtype conversion is asked (measured: `docs/residency.md`, Host memory). This
helper makes it sure: it refuses a `torch_dtype` that would convert (and so copy) the weights, loads each torch
component by itself, and re-maps at once onto its files (`remap.py`) any weight its loader left in anonymous memory,
before the next component is loaded; the pipeline is then assembled from those components.
"""

from __future__ import annotations

import importlib
import json
import os
from typing import Dict, Optional

import torch
from diffusers.utils import logging

from ..units import format_size
from .files import stored_tensors
from .regions import Regions
from .remap import remap

logger = logging.get_logger(f"diffusers.{__name__}")

#: Libraries whose components are loaded here (the others, tokenizers and schedulers, by the pipeline).
LIBRARIES = ("diffusers", "transformers")
#: Of the keyword arguments, those each component's `from_pretrained` is given too.
COMPONENT_ARGUMENTS = ("variant", "revision", "use_safetensors", "local_files_only")


def load_file_backed(path: str, *, pipeline_class=None, torch_dtype: Optional[torch.dtype] = None, **kwargs):
    """Load the pipeline in the local folder `path` with its weights left in their safetensors files.

    Args:
        path (`str` or `os.PathLike`): A local folder with a `model_index.json` (what `save_pretrained` writes, or a
            hub snapshot's folder).
        pipeline_class (`type`, *optional*): The pipeline class; defaults to the one `model_index.json` names.
        torch_dtype (`torch.dtype`, *optional*): Only the checkpoint's own floating dtype is accepted (a conversion
            would copy every weight into anonymous memory); `None`: each component's checkpoint's own (where
            `from_pretrained` would load float32 by default).
        kwargs: Passed to the pipeline's `from_pretrained`; `variant`, `revision`, `use_safetensors` and
            `local_files_only` to each component's too.

    Returns:
        The pipeline. Its weights are file-backed where their files hold them unchanged; one info line says what
        stayed anonymous (and why), if anything did.

    Raises:
        `ValueError`: `path` is not a local pipeline folder, or `torch_dtype` differs from a component's
            checkpoint dtype.

    Example:

    ```py
    >>> import diffusers_offload_ext as doe

    >>> pipe = doe.load_file_backed("/models/FLUX.1-dev")
    >>> pipe.enable_model_cpu_offload(host_memory_budget="auto")
    ```
    """
    index = _index(path)
    classes = _components(path, index)
    dtypes = {name: _stored_dtype(path, name) for name in classes}
    _check_dtypes(dtypes, torch_dtype)
    loaded, kept = {}, {}
    shared = {key: kwargs[key] for key in COMPONENT_ARGUMENTS if key in kwargs}
    for name, cls in classes.items():
        dtype = torch_dtype or dtypes[name]  # the checkpoint's own: a loader's default (float32) would convert
        module = cls.from_pretrained(path, subfolder=name, torch_dtype=dtype, **shared)
        done = remap(module, os.path.join(path, name), Regions.read())
        if done.kept:
            kept[name] = done
        loaded[name] = module
    if pipeline_class is None:
        pipeline_class = getattr(importlib.import_module("diffusers"), index["_class_name"])
    pipe = pipeline_class.from_pretrained(path, torch_dtype=torch_dtype, **loaded, **kwargs)
    for name, done in kept.items():
        reasons = "; ".join(f"{format_size(n)}: {why}" for why, n in sorted(done.reasons.items()))
        logger.info(f"`{name}`: {format_size(done.kept)} of its weights stay in anonymous memory ({reasons}).")
    return pipe


def _index(path) -> dict:
    try:
        with open(os.path.join(path, "model_index.json"), encoding="utf-8") as f:
            index = json.load(f)
    except (OSError, ValueError):
        index = None
    if not isinstance(index, dict) or not isinstance(index.get("_class_name"), str):
        raise ValueError(
            f"`path`={str(path)!r} is not a local pipeline folder (no readable `model_index.json`). Pass the folder "
            "`save_pretrained` wrote, or a hub snapshot's folder (`DiffusionPipeline.download(repo_id)` returns it)."
        )
    return index


def _components(path, index: dict) -> Dict[str, type]:
    """The torch components of the pipeline in `path` that have safetensors files: name -> class."""
    found = {}
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, list) or len(entry) != 2 or entry[0] not in LIBRARIES:
            continue
        cls = getattr(importlib.import_module(entry[0]), str(entry[1]), None)
        if isinstance(cls, type) and issubclass(cls, torch.nn.Module) and stored_tensors(os.path.join(path, name)):
            found[name] = cls
    return found


def _stored_dtype(path, name: str) -> Optional[torch.dtype]:
    """The one floating dtype of component `name`'s checkpoint files, `None` where they hold several or none."""
    stored = {s.dtype for items in stored_tensors(os.path.join(path, name)).values() for s in items}
    floating = {dtype for dtype in stored if dtype.is_floating_point}
    return floating.pop() if len(floating) == 1 else None


def _check_dtypes(dtypes: Dict[str, Optional[torch.dtype]], torch_dtype: Optional[torch.dtype]) -> None:
    """`ValueError` where `torch_dtype` would convert a component whose floating weights are all of another dtype."""
    if torch_dtype is None:
        return
    wrong = {n: str(d).replace("torch.", "") for n, d in dtypes.items() if d is not None and d != torch_dtype}
    if wrong:
        raise ValueError(
            f"`torch_dtype`={torch_dtype!r} would convert the weights of {wrong!r} (their checkpoints' dtypes), "
            "copying them into anonymous memory. Pass `torch_dtype=None` (the checkpoint's own), or the `variant` "
            "whose files hold that dtype."
        )
