"""Real models without their weights: the shipped model data (specs, layouts, exact component sizes, call-trace
templates) and the transfer planner behind `diffusers-offload plan`. Importing it needs no torch."""

from .errors import MissingPackage, PlanError
from .model import Model, load_model
from .plan import plan
from .profiles import DEFAULT_PROFILE, Profile, load_profile, shipped_profiles, write_profile
from .request import DEFAULT_BANDWIDTH, DEFAULT_PINNED_BANDWIDTH, DEFAULT_RESERVE, DEFAULT_VRAM
from .specs import shipped_models

__all__ = [
    "DEFAULT_BANDWIDTH",
    "DEFAULT_PINNED_BANDWIDTH",
    "DEFAULT_PROFILE",
    "DEFAULT_RESERVE",
    "DEFAULT_VRAM",
    "MissingPackage",
    "Model",
    "PlanError",
    "Profile",
    "load_model",
    "load_profile",
    "plan",
    "shipped_models",
    "shipped_profiles",
    "write_profile",
]
