"""The tiny pipelines live in the package (`diffusers_offload_ext/testing/tiny.py` and its parts, `tiny_models.py`;
the demo and the model-data recorder use them); the shared suite loads those files by path, so that
`--offload-impl=patched` runs without importing the package."""

import importlib.util
import pathlib
import sys

_here = pathlib.Path(__file__).resolve().parent.parent / "diffusers_offload_ext" / "testing"


def _load(name: str, filename: str):
    spec = importlib.util.spec_from_file_location(name, _here / filename)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_models = _load("_tiny_models", "tiny_models.py")  # what tiny.py imports when it is not in the package
_module = _load("_tiny_pipelines", "tiny.py")
globals().update({k: v for k, v in vars(_models).items() if not k.startswith("__")})  # private helpers too
globals().update({k: v for k, v in vars(_module).items() if not k.startswith("__")})
