"""Real models without their weights: the shipped model data (specs, layouts, exact component sizes, call-trace
templates) and the transfer planner behind `diffusers-offload plan`. Importing it needs no torch."""

from .errors import MissingPackage, PlanError
from .model import Model, load_model
from .plan import plan
from .request import DEFAULT_BANDWIDTH, DEFAULT_PINNED_BANDWIDTH, DEFAULT_RESERVE, DEFAULT_VRAM
from .specs import shipped_models

__all__ = [
    "DEFAULT_BANDWIDTH",
    "DEFAULT_PINNED_BANDWIDTH",
    "DEFAULT_RESERVE",
    "DEFAULT_VRAM",
    "MissingPackage",
    "Model",
    "PlanError",
    "load_model",
    "plan",
    "shipped_models",
]
