"""The tiny pipelines live in the package (`diffusers_offload_ext/testing/tiny.py` and its parts, `tiny_models.py`;
the demo and the model-data recorder use them); the shared suite loads those files by path, so that
`--offload-impl=patched` runs without importing the package."""

from simulated_accelerator import load_by_path

_models = load_by_path("_tiny_models", "tiny_models.py")  # what tiny.py imports when it is not in the package
_module = load_by_path("_tiny_pipelines", "tiny.py")
globals().update({k: v for k, v in vars(_models).items() if not k.startswith("__")})  # private helpers too
globals().update({k: v for k, v in vars(_module).items() if not k.startswith("__")})
