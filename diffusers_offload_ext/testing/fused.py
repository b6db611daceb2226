"""`fake_fused_fingerprints`: a stand-in for the fused fingerprint kernel of CUDA (`transfer/fused_fingerprint.py`) on
the simulated accelerator, so that the one-pass wiring of change detection runs in the tests. Each call is one
"launch" (counted); its work is the eager folding, hidden from the dispatch modes as a kernel's is, so that a
`TorchDispatchMode` sees what runs around the kernel and nothing inside it. With `wrong=True` it adds one to every
sum, as a miscompiled kernel would: the probe that trusts a fused kernel must then refuse it."""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch.utils._python_dispatch import _disable_current_modes

from ..transfer import fingerprint


class Launches:
    """`count`: the fake kernel's launches so far."""

    def __init__(self) -> None:
        self.count = 0


@contextlib.contextmanager
def fake_fused_fingerprints(wrong: bool = False) -> Iterator[Launches]:
    """Within the block, devices of type `cpu` (the simulated accelerator; the plain CPU too) fingerprint through a
    fake fused kernel. Yields its `Launches`."""
    launches = Launches()

    def factory(device):
        def fused(parts, positions):
            launches.count += 1
            with _disable_current_modes():
                sums = fingerprint._fold_eager(parts, positions)
                return sums + 1 if wrong else sums

        return fused

    saved, engines = fingerprint.FUSED.get("cpu"), dict(fingerprint._engines)
    fingerprint.FUSED["cpu"] = factory
    fingerprint._engines.clear()
    try:
        yield launches
    finally:
        fingerprint._engines.clear()
        fingerprint._engines.update(engines)
        if saved is None:
            fingerprint.FUSED.pop("cpu", None)
        else:
            fingerprint.FUSED["cpu"] = saved
