"""`PipelineLayout`: what model offload sees of a pipeline (its components, the offload sequence, the class's own
exclusions) and how the options arrange it into a chain, hooked components and round trips.

Built once from a live pipeline (`from_pipeline`) or from recorded data (`from_dict`), and used by enable, the
tracer's replays, the planner and the benchmarks alike.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Dict, Iterable, NamedTuple, Optional, Sequence, Tuple


class Arrangement(NamedTuple):
    """How one set of options arranges a layout.

    Args:
        chain (`Tuple[str, ...]`): Components of `model_cpu_offload_seq` that are present and not excluded, in order.
            When one runs, its predecessor in the chain is evicted (stock's rule).
        hooked (`Tuple[str, ...]`): Components that get an offload hook: the chain, then the others that no list
            excludes (they run outside the chain, like a ControlNet).
        round_trip (`Tuple[str, ...]`): Class-excluded components outside the chain: no hook; stock moves them to
            the host and back to the device whenever offload is armed.
        excluded (`Tuple[str, ...]`): `exclude_from_offload`: on the device once, never moved again; no offload hook
            (the chain policy hears when one runs: it evicts its predecessor in `model_cpu_offload_seq`).
    """

    chain: Tuple[str, ...]
    hooked: Tuple[str, ...]
    round_trip: Tuple[str, ...]
    excluded: Tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class PipelineLayout:
    """The pipeline as model offload sees it.

    Args:
        order (`Tuple[str, ...]`): The module components, in the pipeline's order.
        sequence (`Tuple[str, ...]`): `model_cpu_offload_seq` split on `->`.
        class_excluded (`Tuple[str, ...]`, defaults to `()`): The pipeline's `_exclude_from_cpu_offload` (the
            instance's if it has its own), restricted to `order`.
    """

    order: Tuple[str, ...]
    sequence: Tuple[str, ...]
    class_excluded: Tuple[str, ...] = ()

    def arrange(self, excluded: Iterable[str] = ()) -> Arrangement:
        """The chain, hooked components and round trips when `excluded` are excluded from offload."""
        excluded = tuple(n for n in dict.fromkeys(excluded) if n in self.order)
        chain = tuple(n for n in dict.fromkeys(self.sequence) if n in self.order and n not in excluded)
        rest = [n for n in self.order if n not in chain and n not in excluded]
        return Arrangement(
            chain=chain,
            hooked=chain + tuple(n for n in rest if n not in self.class_excluded),
            round_trip=tuple(n for n in rest if n in self.class_excluded),
            excluded=excluded,
        )

    def to_dict(self) -> Dict[str, Any]:
        return {
            "order": list(self.order),
            "sequence": list(self.sequence),
            "class_excluded": list(self.class_excluded),
        }

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "PipelineLayout":
        order = tuple(data["order"])
        return cls(
            order=order,
            sequence=tuple(data["sequence"]),
            class_excluded=tuple(n for n in data.get("class_excluded", ()) if n in order),
        )

    @classmethod
    def from_pipeline(cls, pipe, class_excluded: Optional[Sequence[str]] = None) -> "PipelineLayout":
        """The layout of a live pipeline. Components that are not `torch.nn.Module`s, and those that cannot move
        (`fixed_of`: bitsandbytes 8-bit ones), are left out. `class_excluded` defaults to the pipeline's `_exclude_from_cpu_offload`.
        """
        order = tuple(modules_of(pipe.components))
        if class_excluded is None:
            class_excluded = getattr(pipe, "_exclude_from_cpu_offload", None) or ()
        return cls(
            order=order,
            sequence=split_sequence(getattr(pipe, "model_cpu_offload_seq", None)),
            class_excluded=tuple(n for n in dict.fromkeys(class_excluded) if n in order),
        )


def split_sequence(sequence: Optional[str]) -> Tuple[str, ...]:
    """`"text_encoder->unet->vae"` as `("text_encoder", "unet", "vae")`; `()` for `None`."""
    return tuple(n.strip() for n in sequence.split("->")) if sequence else ()


#: Why a bitsandbytes 8-bit component never moves (`offload_status`'s `why`, the log line naming one).
EIGHT_BIT = (
    "bitsandbytes 8-bit: `.to()` moves its int8 weights but not their row scales (`SCB`) nor each layer's matmul "
    "state, which stay where it was loaded, so it runs only there"
)


def cannot_move(module) -> str:
    """Why component `module` cannot move between the host and the device (`""`: it can)."""
    return EIGHT_BIT if getattr(module, "is_loaded_in_8bit", False) else ""


def modules_of(components, *, movable: bool = True) -> Dict[str, Any]:
    """The components that are `torch.nn.Module`s, in order; with `movable`, without those that cannot move
    (`cannot_move`: bitsandbytes 8-bit ones). Read without importing torch: where it is not loaded, nothing is one."""
    torch = sys.modules.get("torch")
    if torch is None:
        return {}
    return {
        name: value
        for name, value in components.items()
        if isinstance(value, torch.nn.Module) and not (movable and cannot_move(value))
    }


def fixed_of(components) -> Dict[str, Any]:
    """The module components that cannot move (`cannot_move`), in order: they stay where they were loaded."""
    return {name: value for name, value in modules_of(components, movable=False).items() if cannot_move(value)}
