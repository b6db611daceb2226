"""Policies: which component moves when. Pure Python: no torch device, no hook, no runtime."""

from .base import NOTHING, Decision, Facts, Move, Overflow, Policy, apply
from .chain import ChainPolicy
from .optimum import Optimum, optimal_bytes
from .prediction import predict_rest
from .prefetch import PrefetchPolicy
from .replay import Replay, ReplayedMove, replay, replay_trace
from .residency import MAX_EXACT, ResidencyPolicy

__all__ = [
    "MAX_EXACT",
    "NOTHING",
    "ChainPolicy",
    "Decision",
    "Facts",
    "Move",
    "Optimum",
    "Overflow",
    "Policy",
    "PrefetchPolicy",
    "Replay",
    "ReplayedMove",
    "ResidencyPolicy",
    "apply",
    "optimal_bytes",
    "predict_rest",
    "replay",
    "replay_trace",
]
