"""The shipped model data recorded from the specs (`data/recorded/<model>.json`): the pipeline layout, the exact
element counts of every component and the call-trace template. Reading and checking it needs no torch; `testing/record_model_data.py`
writes it."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from typing import Dict, List, Mapping

from ..layout import PipelineLayout
from .errors import PlanError
from .sizes import ITEMSIZE
from .traces import check_template

FORMAT = "diffusers-offload-model-data"
VERSION = 1
DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
SPEC_DIR = os.path.join(DATA_DIR, "specs")
RECORDED_DIR = os.path.join(DATA_DIR, "recorded")
REGENERATE = "python -m diffusers_offload_ext.testing.record_model_data"


def config_key(class_name: str, config: Mapping) -> str:
    """A short digest of a component's class and config: equal keys, equal element counts."""
    text = json.dumps({"class": class_name, "config": config}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def recorded_models() -> List[str]:
    """The models with recorded data."""
    return sorted(f[: -len(".json")] for f in os.listdir(RECORDED_DIR) if f.endswith(".json"))


@functools.lru_cache(maxsize=None)
def load_recorded(model: str) -> dict:
    """The recorded data of shipped model `model`, checked.

    Raises:
        `PlanError`: no data for `model`, or data this version cannot read (regenerate it with `REGENERATE`).
    """
    path = os.path.join(RECORDED_DIR, f"{model}.json")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError:
        raise PlanError(f"No recorded model data for {model!r} (regenerate it: {REGENERATE}).") from None
    try:
        check_recorded(data)
    except (ValueError, KeyError, TypeError) as error:
        raise PlanError(
            f"The recorded data of {model!r} is unusable ({error}); regenerate it: {REGENERATE}."
        ) from None
    return data


def check_recorded(data: Mapping) -> None:
    """Raise `ValueError` unless `data` is recorded model data of this format version."""
    if data.get("format") != FORMAT or data.get("version") != VERSION:
        raise ValueError(f"not {FORMAT} version {VERSION}")
    layout = PipelineLayout.from_dict(data["layout"])
    for name, counts in data["components"].items():
        numbers = [counts["parameters"], counts["floating"], *counts["other"].values()]
        if not all(isinstance(n, int) and n >= 0 for n in numbers):
            raise ValueError(f"component {name!r} has counts that are not whole numbers")
        unknown = [d for d in counts["other"] if d not in ITEMSIZE]
        if unknown:
            raise ValueError(f"component {name!r} has tensors of unknown dtypes {unknown}")
    missing = [n for n in layout.order if n not in data["components"]]
    if missing:
        raise ValueError(f"no counts for components {missing} of the layout")
    check_template(data["trace"])


def recorded_for_pipeline(tiny: str) -> dict:
    """The recorded data of a shipped model recorded from tiny pipeline `tiny` (its layout and template).

    Raises:
        `PlanError`: no shipped model was recorded from `tiny`.
    """
    pipelines = {}
    for model in recorded_models():
        data = load_recorded(model)
        pipelines.setdefault(data["tiny"], data)
    if tiny not in pipelines:
        known = ", ".join(sorted(pipelines))
        raise PlanError(f"No call trace is recorded for pipeline {tiny!r}; the spec's 'tiny' must be one of: {known}.")
    return pipelines[tiny]


@functools.lru_cache(maxsize=1)
def known_counts() -> Dict[str, dict]:
    """`{config_key: counts}` of every recorded component, so that a spec reusing a shipped config needs no build."""
    counts = {}
    for model in recorded_models():
        for entry in load_recorded(model)["components"].values():
            counts[entry["config_key"]] = entry
    return counts
