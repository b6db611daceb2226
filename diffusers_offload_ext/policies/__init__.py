"""Policies: which component moves when. Pure Python: no torch device, no hook, no runtime."""

from .blocks import DEPTH, Item, StreamPlan, keep_most_used, least_room, plan_stream, streamed_bytes
from .base import NOTHING, Decision, Facts, Move, Overflow, Policy, apply
from .chain import ChainPolicy
from .optimum import Optimum, optimal_bytes
from .prediction import predict_rest
from .prefetch import PrefetchPolicy
from .replay import Replay, ReplayedMove, replay, replay_trace
from .residency import MAX_EXACT, ResidencyPolicy

__all__ = [
    "DEPTH",
    "MAX_EXACT",
    "NOTHING",
    "ChainPolicy",
    "Decision",
    "Facts",
    "Item",
    "Move",
    "Optimum",
    "Overflow",
    "Policy",
    "PrefetchPolicy",
    "Replay",
    "ReplayedMove",
    "ResidencyPolicy",
    "StreamPlan",
    "apply",
    "keep_most_used",
    "least_room",
    "optimal_bytes",
    "plan_stream",
    "predict_rest",
    "replay",
    "replay_trace",
    "streamed_bytes",
]
