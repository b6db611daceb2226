"""Policies: which component moves when. Pure Python: no torch device, no hook, no runtime."""

from .base import NOTHING, Decision, Facts, Keep, Move, Overflow, Policy, apply
from .chain import ChainPolicy
from .replay import Replay, ReplayedMove, replay, replay_trace

__all__ = [
    "NOTHING",
    "ChainPolicy",
    "Decision",
    "Facts",
    "Keep",
    "Move",
    "Overflow",
    "Policy",
    "Replay",
    "ReplayedMove",
    "apply",
    "replay",
    "replay_trace",
]
