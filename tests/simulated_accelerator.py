"""The simulated accelerator lives in the package (`diffusers_offload_ext/testing/simulated_accelerator.py` and its
parts, `simulated_tensors.py` and `simulated_memory.py`); the suite loads those files by path, so that it works where
the package is not installed (`--offload-impl=patched`)."""

import importlib.util
import pathlib
import sys

_here = pathlib.Path(__file__).resolve().parent.parent / "diffusers_offload_ext" / "testing"


def load_by_path(name: str, filename: str):
    """Module `name` from the package's `testing/filename`, without importing the package."""
    spec = importlib.util.spec_from_file_location(name, _here / filename)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


load_by_path("_simulated_tensors", "simulated_tensors.py")  # what simulated_accelerator.py imports outside the package
load_by_path("_simulated_memory", "simulated_memory.py")
_module = load_by_path("_simulated_accelerator", "simulated_accelerator.py")
globals().update({k: v for k, v in vars(_module).items() if not k.startswith("__")})
