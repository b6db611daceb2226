"""The tiny pipelines live in the package (`diffusers_offload_ext/testing/tiny.py`, the demo and the model-data
recorder use them); the shared suite loads that one file by path, so that `--offload-impl=patched` runs without
importing the package."""

import importlib.util
import pathlib
import sys

_path = pathlib.Path(__file__).resolve().parent.parent / "diffusers_offload_ext" / "testing" / "tiny.py"
_spec = importlib.util.spec_from_file_location("_tiny_pipelines", _path)
_module = importlib.util.module_from_spec(_spec)
sys.modules["_tiny_pipelines"] = _module
_spec.loader.exec_module(_module)
globals().update({k: v for k, v in vars(_module).items() if not k.startswith("__")})  # private helpers too
