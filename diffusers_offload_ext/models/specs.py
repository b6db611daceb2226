"""Model specs: which pipeline a model is and each component's class, dtype and config. The shipped ones
(`data/specs/<model>.json`, values from the models' published `config.json` files), spec files given by path, and
`--component NAME=CONFIG.json` overrides."""

from __future__ import annotations

import copy
import difflib
import functools
import json
import os
from typing import Dict, List

from .errors import PlanError
from .recorded import SPEC_DIR

#: Component names that are denoisers when a spec does not list its own.
DENOISER_PREFIXES = ("transformer", "unet")
#: The longest spec or config file read (a model's config is a few kilobytes).
MAX_FILE_BYTES = 4 << 20


def shipped_models() -> List[str]:
    """Names of the shipped model specs."""
    return sorted(f[: -len(".json")] for f in os.listdir(SPEC_DIR) if f.endswith(".json"))


@functools.lru_cache(maxsize=1)
def model_names() -> Dict[str, str]:
    """`{name as typed, lower case: shipped model}`: each shipped name and its Hugging Face Hub id
    (`black-forest-labs/flux.1-dev` -> `flux-dev`)."""
    names = {}
    for name in shipped_models():
        names[name.lower()] = name
        repo = read_json(os.path.join(SPEC_DIR, f"{name}.json"), "model spec").get("repo")
        if isinstance(repo, str):
            names[repo.lower()] = name
    return names


def resolve_model(model: str) -> str:
    """The shipped model `model` names (its name or Hub id, in any case), else `model` itself when it is a spec
    file's path.

    Raises:
        `PlanError`: neither; the message suggests the nearest shipped name or Hub id.
    """
    text = str(model).strip()
    shipped = model_names().get(text.lower())
    if shipped is not None:
        return shipped
    if os.path.exists(text) or text.endswith(".json"):
        return text
    known = ", ".join(shipped_models())
    near = difflib.get_close_matches(text.lower(), list(model_names()), n=1, cutoff=0.5)
    hint = f" Did you mean {model_names()[near[0]]!r}?" if near else ""
    raise PlanError(
        f"Unknown model {text[:60]!r}: not a shipped model, nor its Hugging Face Hub id, nor a spec file.{hint} "
        f"Shipped models: {known} (`diffusers-offload plan --list` shows their Hub ids); or pass a spec path.",
        "--model",
    )


def read_json(path: str, what: str, argument: str = "--model") -> dict:
    """The JSON object in file `path`.

    Raises:
        `PlanError`: unreadable, too large, not JSON, or not an object.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(MAX_FILE_BYTES + 1)
    except OSError as error:
        raise PlanError(f"Cannot read {what} {path!r}: {error.strerror or error}.", argument) from None
    except UnicodeDecodeError as error:
        raise PlanError(f"{what.capitalize()} {path!r} is not valid JSON: {error}.", argument) from None
    if len(text) > MAX_FILE_BYTES:
        raise PlanError(f"{what.capitalize()} {path!r} is larger than {MAX_FILE_BYTES >> 20} MiB.", argument)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise PlanError(f"{what.capitalize()} {path!r} is not valid JSON: {error}.", argument) from None
    if not isinstance(data, dict):
        raise PlanError(f"{what.capitalize()} {path!r} must hold a JSON object.", argument)
    return data


def load_spec(model: str) -> dict:
    """The spec of `model`: a shipped name or Hub id (`resolve_model`) or the path of a spec JSON file.

    A spec is `{"name", "title", "pipeline", "tiny", "denoisers", "components": {name: {"class", "library",
    "dtype", "config" or "config_path"}}}`; `config_path` (relative to the spec file) points to a model's own
    `config.json`; `tiny` names the recorded pipeline whose layout and call trace the plan uses.

    Raises:
        `PlanError`: unknown name, unreadable or malformed file.
    """
    model = resolve_model(model)
    shipped = os.path.join(SPEC_DIR, f"{model}.json")
    path = shipped if model in shipped_models() else model
    spec = read_json(path, "model spec")
    base = os.path.dirname(os.path.abspath(path))
    components = spec.get("components")
    if not isinstance(components, dict) or not components:
        raise PlanError(f"Model spec {path!r} has no 'components' object.", "--model")
    for name, entry in components.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("class"), str):
            raise PlanError(f"Component {name!r} of {path!r} needs at least a 'class'.", "--model")
        if "config" not in entry:
            if "config_path" not in entry:
                raise PlanError(f"Component {name!r} of {path!r} needs a 'config' object or a 'config_path'.")
            entry["config"] = read_json(os.path.join(base, str(entry["config_path"])), f"config of {name!r}")
    spec.setdefault("name", os.path.splitext(os.path.basename(path))[0])
    spec.setdefault("denoisers", [n for n in components if n.startswith(DENOISER_PREFIXES)])
    spec["path"] = path
    spec["shipped"] = path == shipped
    return spec


def override_component(spec: dict, text: str) -> dict:
    """A copy of `spec` with `NAME=PATH` or `NAME=CLASS:PATH` (a model's `config.json`) applied.

    The class defaults to the config's `_class_name` (diffusers) or first `architectures` entry (transformers); the
    dtype to the replaced component's.
    """
    if "=" not in text:
        raise PlanError(f"--component takes NAME=CONFIG.json or NAME=CLASS:CONFIG.json, got {text[:80]!r}.")
    name, value = text.split("=", 1)
    class_name = None
    if ":" in value and not os.path.exists(value):
        class_name, value = value.split(":", 1)
    config = read_json(value, f"config of {name!r}", "--component")
    architectures = config.get("architectures") or [None]
    class_name = class_name or config.get("_class_name") or architectures[0]
    if not isinstance(class_name, str) or not class_name:
        raise PlanError(f"Say which class {value!r} configures: --component {name}=CLASS:{value}.", "--component")
    library = "transformers" if config.get("architectures") and not config.get("_class_name") else None
    spec = copy.deepcopy(spec)
    old = spec["components"].get(name, {})
    spec["components"][name] = {
        "class": class_name,
        "library": library,
        "dtype": old.get("dtype", "bfloat16"),
        "config": config,
    }
    return spec
