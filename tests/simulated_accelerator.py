"""The simulated accelerator lives in the package (`diffusers_offload_ext/testing/simulated_accelerator.py`); the
suite loads that one file by path, so that it works where the package is not installed (`--offload-impl=patched`)."""

import importlib.util
import pathlib
import sys

_path = (
    pathlib.Path(__file__).resolve().parent.parent / "diffusers_offload_ext" / "testing" / "simulated_accelerator.py"
)
_spec = importlib.util.spec_from_file_location("_simulated_accelerator", _path)
_module = importlib.util.module_from_spec(_spec)
sys.modules["_simulated_accelerator"] = _module
_spec.loader.exec_module(_module)
globals().update({k: v for k, v in vars(_module).items() if not k.startswith("__")})
