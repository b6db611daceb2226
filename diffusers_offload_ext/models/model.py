"""A model ready to plan: its layout, call-trace template and component sizes in the dtypes asked for, from the
shipped model data when it has them, else from a build on the meta device."""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ..layout import PipelineLayout
from .errors import PlanError
from .recorded import config_key, known_counts, load_recorded, recorded_for_pipeline
from .sizes import CANNOT_MOVE, describe, parse_dtype, parse_dtype_overrides
from .specs import load_spec, override_component
from .traces import call_trace


@dataclasses.dataclass(frozen=True)
class Model:
    """What the planner needs of a model.

    Args:
        name (`str`), title (`str` or `None`), pipeline (`str`): The model, its display name, its pipeline class.
        layout (`PipelineLayout`): The pipeline as model offload sees it (components without a size left out).
        template (`dict`): The call-trace template (`traces.call_trace`).
        components (`Dict[str, dict]`): Per component `class`, `dtype`, `parameters`, `elements`, `nbytes`.
        denoisers (`Tuple[str, ...]`): The components `exclude_from_offload` names in the planner's "exclude".
        trace_source (`str`): Where the template was recorded.
        fixed (`Tuple[str, ...]`): Components that cannot move (bitsandbytes 8-bit, `int8`): out of the layout, held
            on the device where they are loaded, counted in every peak and against the budget, never moved.
    """

    name: str
    title: Optional[str]
    pipeline: str
    layout: PipelineLayout
    template: dict
    components: Dict[str, dict]
    denoisers: Tuple[str, ...]
    trace_source: str
    fixed: Tuple[str, ...] = ()

    @property
    def sizes(self) -> Dict[str, int]:
        return {name: entry["nbytes"] for name, entry in self.components.items()}

    @property
    def fixed_bytes(self) -> int:
        """Bytes of the components that cannot move, on the device all the time."""
        return sum(self.components[name]["nbytes"] for name in self.fixed)

    def call_trace(self, steps: int, preview: bool = False) -> List[str]:
        """One call's component uses, restricted to the components of the layout."""
        order = set(self.layout.order)
        return [name for name in call_trace(self.template, steps, preview) if name in order]


def load_model(model: str, dtypes: Sequence[str] = (), components: Sequence[str] = ()) -> Model:
    """The `Model` for a shipped name or spec path, with `--dtype` and `--component` overrides applied.

    Raises:
        `PlanError`: bad name, file, override or dtype. `MissingPackage`: a class to build needs a missing package.
    """
    spec = load_spec(model)
    for text in components:
        spec = override_component(spec, text)
    if spec.get("shipped"):
        recorded = load_recorded(spec["name"])
    elif spec.get("tiny"):
        recorded = recorded_for_pipeline(str(spec["tiny"]))
    else:
        raise PlanError(f"Model spec {spec['path']!r} needs a 'tiny' entry naming the recorded pipeline it runs.")
    denoisers = tuple(n for n in spec.get("denoisers", ()) if n in spec["components"])
    overrides = parse_dtype_overrides(dtypes, spec["components"], denoisers)
    described = {}
    for name, entry in spec["components"].items():
        own = parse_dtype(entry.get("dtype", "float32"), argument=f"the dtype of {name!r}", formats=False)
        described[name] = describe(_counts(entry), overrides.get(name) or own, entry["class"], rest=own)
    layout = PipelineLayout.from_dict(recorded["layout"])
    missing = [n for n in layout.order if n not in described]
    if missing:
        raise PlanError(f"Model spec {spec['path']!r} has no components {missing} of {recorded['pipeline']}.")
    fixed = tuple(n for n in layout.order if described[n]["dtype"] in CANNOT_MOVE)
    return Model(
        name=spec["name"],
        title=spec.get("title"),
        pipeline=recorded["pipeline"],
        layout=_without(layout, fixed),
        template=recorded["trace"],
        components={n: described[n] for n in spec["components"] if n in layout.order},
        denoisers=tuple(n for n in denoisers if n in layout.order and n not in fixed),
        trace_source=f"the tiny {recorded['pipeline']} ({recorded['tiny']}) of the shipped model data",
        fixed=fixed,
    )


def _without(layout: PipelineLayout, fixed: Sequence[str]) -> PipelineLayout:
    """`layout` as offload sees it when `fixed` cannot move: without them (`layout.modules_of` leaves them out)."""
    return PipelineLayout(
        order=tuple(n for n in layout.order if n not in fixed),
        sequence=tuple(n for n in layout.sequence if n not in fixed),
        class_excluded=tuple(n for n in layout.class_excluded if n not in fixed),
    )


def _counts(entry: Mapping) -> dict:
    """Element counts of one spec component: recorded when its class and config were, else built on meta."""
    counts = known_counts().get(config_key(entry["class"], entry["config"]))
    if counts is not None:
        return counts
    from .meta import count_elements

    return count_elements(entry["class"], entry.get("library"), entry["config"])
