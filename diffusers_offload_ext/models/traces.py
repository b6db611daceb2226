"""Call-trace templates: one pipeline call's component uses as before the loop, each denoising step and after the
loop (with and without a preview decoded every step), from which the trace of any step count is generated.

A step's entries name components, or `EXPERT` where a two-expert pipeline (Wan 2.2) runs the expert of that step
(`schedule.experts_per_step`)."""

from __future__ import annotations

from typing import Iterable, List, Mapping, Optional, Sequence, Tuple

from ..calls import AFTER, BEFORE, LOOP
from .schedule import experts_per_step

#: In a step template, the expert that runs the step.
EXPERT = "<expert>"
#: The template variants: without a step callback, and with a preview decoded every step.
VARIANTS = ("plain", "preview")


class TemplateError(ValueError):
    """A recorded call does not have the shape of a template (the steps differ, uses outside the three phases)."""


def call_trace(template: Mapping, steps: int, preview: bool = False) -> List[str]:
    """The component uses of one pipeline call of `steps` denoising steps.

    Args:
        template (`Mapping`): A recorded template: `{"plain": {"before", "step", "after"}, "preview": {...},
            "experts": None or {...}}`.
        steps (`int`): Denoising steps.
        preview (`bool`, defaults to `False`): A step callback decodes a preview with the VAE every step.
    """
    variant = template[VARIANTS[bool(preview)]]
    experts = experts_per_step(template["experts"], steps) if template.get("experts") else None
    trace = list(variant["before"])
    for index in range(steps):
        expert = experts[index] if experts else None
        trace.extend(expert if name == EXPERT else name for name in variant["step"])
    trace.extend(variant["after"])
    return trace


def template_from_uses(uses: Sequence[Tuple[str, str, Optional[int]]], steps: int, experts=None) -> dict:
    """The template variant of one recorded call: `uses` are `(component, phase, step)` in the order they ran.

    Raises:
        `TemplateError`: the call does not split into before / `steps` equal steps / after.
    """
    before = [c for c, phase, _ in uses if phase == BEFORE]
    after = [c for c, phase, _ in uses if phase == AFTER]
    per_step: List[List[str]] = [[] for _ in range(steps)]
    for component, phase, step in uses:
        if phase == LOOP:
            if step is None or not 0 <= step < steps:
                raise TemplateError(f"A use of {component} in the loop has step {step!r} of {steps}.")
            per_step[step].append(component)
        elif phase not in (BEFORE, AFTER):
            raise TemplateError(f"A use of {component} in phase {phase!r}, outside the call's three phases.")
    names = experts_per_step(experts, steps) if experts else [None] * steps
    shapes = [_with_placeholder(entries, names[i], experts) for i, entries in enumerate(per_step)]
    if any(shape != shapes[0] for shape in shapes):
        raise TemplateError(f"The denoising steps differ: {shapes}.")
    variant = {"before": before, "step": shapes[0], "after": after}
    if before + [c for entries in per_step for c in entries] + after != [c for c, _, _ in uses]:
        raise TemplateError("Uses of the three phases are interleaved: the call is not before / loop / after.")
    return variant


def _with_placeholder(entries: Iterable[str], expert: Optional[str], experts) -> List[str]:
    if experts is None:
        return list(entries)
    other = experts["low_noise"] if expert == experts["high_noise"] else experts["high_noise"]
    entries = list(entries)
    if other in entries:
        raise TemplateError(f"A step of expert {expert} also runs {other}.")
    return [EXPERT if name == expert else name for name in entries]


def check_template(template: Mapping) -> None:
    """Raise `ValueError` unless `template` has both variants with lists of names, and valid experts."""
    for variant in VARIANTS:
        parts = template.get(variant)
        if not isinstance(parts, Mapping):
            raise ValueError(f"The call-trace template has no {variant!r} variant.")
        for part in ("before", "step", "after"):
            if not isinstance(parts.get(part), list) or not all(isinstance(n, str) for n in parts[part]):
                raise ValueError(f"The call-trace template's {variant}.{part} is not a list of names.")
    experts = template.get("experts")
    uses_expert = any(EXPERT in template[v]["step"] for v in VARIANTS)
    if uses_expert and experts is None:
        raise ValueError(f"The call-trace template uses {EXPERT} but names no experts.")
    if experts is not None:
        experts_per_step(experts, 1)
