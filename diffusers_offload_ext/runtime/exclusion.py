"""`Exclusion`: the instance-level `_exclude_from_cpu_offload` the extension sets on a pipeline (stock's rules then
skip the excluded components: `_execution_device`, its own offload methods), mirrored on a combined pipeline's
sub-pipelines, and what was there before, so that it can be put back exactly."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from .combined import mirror_exclusion, restore_mirrored

ATTR = "_exclude_from_cpu_offload"


class Exclusion:
    """What the extension changed of one pipeline's `_exclude_from_cpu_offload`."""

    def __init__(self) -> None:
        #: `(had an instance value, that value)` before the extension set its own; `None`: nothing set.
        self.saved: Optional[Tuple[bool, object]] = None
        #: Sub-pipelines' values before a combined pipeline mirrored its own exclusions on them.
        self.mirrored: list = []

    def user(self, pipe) -> List[str]:
        """`_exclude_from_cpu_offload` as the user has it, without the extension's instance-level additions."""
        if self.saved is not None:
            had_instance_value, value = self.saved
            if not had_instance_value:
                value = getattr(type(pipe), ATTR, None)
            return list(value or [])
        return list(getattr(pipe, ATTR, None) or [])

    def apply(self, pipe, user_excluded: Sequence[str], excluded: Sequence[str]) -> None:
        """`exclude_from_offload` (`excluded`) joins what the user excludes, on the instance only."""
        if not excluded:
            return
        self.saved = (ATTR in pipe.__dict__, pipe.__dict__.get(ATTR))
        pipe.__dict__[ATTR] = list(dict.fromkeys([*user_excluded, *excluded]))
        self.mirrored = mirror_exclusion(pipe, excluded)

    def restore(self, pipe) -> None:
        """Undo `apply`, leaving what the user had set."""
        restore_mirrored(self.mirrored)
        self.mirrored = []
        if self.saved is None:
            return
        had_instance_value, value = self.saved
        self.saved = None
        if had_instance_value:
            pipe.__dict__[ATTR] = value
        else:
            pipe.__dict__.pop(ATTR, None)
