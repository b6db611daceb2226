"""The four offload strategies the planner compares: the policy `enable_model_cpu_offload` arms for each on a
layout, and the call a user writes to get it."""

from __future__ import annotations

import math
from typing import Dict, Mapping, NamedTuple, Optional, Sequence, Tuple

from ..constants import GiB
from ..layout import PipelineLayout
from ..policies import ChainPolicy, Policy
from ..residency.policy import ResidencyPolicy
from ..units import parse_size

#: In the order ties are broken.
STRATEGIES = ("stock", "exclude_denoiser", "keep_during_generation", "residency")
#: Short labels for tables (`LEGEND` says what each means).
LABELS = {"stock": "stock", "exclude_denoiser": "exclude", "keep_during_generation": "keep", "residency": "budget"}
CALL = "pipe.enable_model_cpu_offload({})"


class Strategy(NamedTuple):
    """One strategy: its key, short label, the call that arms it, a fresh policy, whether evictions are free, and
    the residency manager's budget in bytes (`None` for the others)."""

    name: str
    label: str
    call: str
    policy: Policy
    zero_copy: bool
    budget: Optional[int] = None


def budget_option(budget: int) -> Tuple[str, int]:
    """`memory_budget` text for at most `budget` bytes, rounded down to 0.1 GiB, and the bytes it means."""
    text = f"{math.floor(budget * 10 / GiB) / 10:.1f}GiB"
    return text, parse_size(text)


def chain_strategies(layout: PipelineLayout, denoisers: Sequence[str]) -> Dict[str, Strategy]:
    """Stock, `exclude_from_offload=[denoisers]` and `keep_on_device_during_generation=True`."""
    names = ", ".join(f'"{n}"' for n in denoisers)
    return {
        "stock": Strategy("stock", LABELS["stock"], CALL.format(""), ChainPolicy.for_layout(layout), False),
        "exclude_denoiser": Strategy(
            "exclude_denoiser",
            LABELS["exclude_denoiser"],
            CALL.format(f"exclude_from_offload=[{names}]"),
            ChainPolicy.for_layout(layout, excluded=denoisers),
            False,
        ),
        "keep_during_generation": Strategy(
            "keep_during_generation",
            LABELS["keep_during_generation"],
            CALL.format("keep_on_device_during_generation=True"),
            ChainPolicy.for_layout(layout, keep=True),
            False,
        ),
    }


def residency_strategy(
    layout: PipelineLayout, sizes: Mapping[str, int], budget: int, budget_text: Optional[str] = None
) -> Strategy:
    """The residency manager within `budget` bytes (written `budget_text` in the call, e.g. `'"21.0GiB"'`), kept
    between generations, with zero-copy eviction."""
    arranged = layout.arrange()
    policy = ResidencyPolicy(
        order=layout.order,
        chain=arranged.chain,
        hooked=arranged.hooked,
        sizes=sizes,
        round_trip=arranged.round_trip,
        budget=budget,
        keep_between=True,
        zero_copy=True,
    )
    call = CALL.format(f"memory_budget={budget_text or budget}, keep_on_device_between_generations=True")
    return Strategy("residency", LABELS["residency"], call, policy, True, budget)


def largest_offloaded(layout: PipelineLayout, sizes: Mapping[str, int]) -> Optional[str]:
    """The largest component the residency manager moves (`None` when it moves none)."""
    hooked = layout.arrange().hooked
    return max(hooked, key=lambda n: sizes[n]) if hooked else None


def all_strategies(
    layout: PipelineLayout,
    sizes: Mapping[str, int],
    denoisers: Sequence[str],
    budget: Optional[int],
    held: int = 0,
) -> Dict[str, Strategy]:
    """Every strategy with a fresh policy; the residency manager (its budget rounded down to 0.1 GiB) only when
    `budget` leaves room for weights. `held`: bytes of components that cannot move, on the device all the time: the
    budget counts them, so its policy gets what they leave (its `budget` field)."""
    strategies = chain_strategies(layout, denoisers)
    if budget is not None and budget > 0:
        text, nbytes = budget_option(budget)
        residency = residency_strategy(layout, sizes, max(nbytes - held, 0), f'"{text}"')
        strategies["residency"] = residency._replace(budget=max(nbytes - held, 0))
    return strategies
