"""Policies: which component moves when. Pure Python: no torch device, no hook, no runtime."""

from .block_prefetch import blocks_ahead
from .blocks import DEPTH, BlockChoice, Item, choose_blocks, keep_most_used, least_room, streamed_bytes
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
    "BlockChoice",
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
    "apply",
    "blocks_ahead",
    "choose_blocks",
    "keep_most_used",
    "least_room",
    "optimal_bytes",
    "predict_rest",
    "replay",
    "replay_trace",
    "streamed_bytes",
]
