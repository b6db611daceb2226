"""diffusers-offload-ext: controllable, fast model CPU offload for diffusers pipelines.

Names are loaded on first use, so that `import diffusers_offload_ext` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.0"

#: Public name -> the module that defines it.
_EXPORTS = {
    "BlockStatus": "blocks.status",
    "ChainPolicy": "policies.chain",
    "ComponentStatus": "runtime.api",
    "DeferredCpuOffload": "runtime.hook",
    "END": "constants",
    "FastPaths": "runtime.fast_paths",
    "HostBytes": "host.account",
    "LearntShape": "recovery.activations",
    "OffloadHandle": "runtime.hook",
    "OffloadMixin": "runtime.install",
    "OffloadOutOfMemoryError": "recovery.guard",
    "OffloadOptions": "runtime.options",
    "OffloadStatus": "runtime.api",
    "PipelineLayout": "layout",
    "ResidencyPolicy": "residency.policy",
    "Trace": "observe.trace",
    "TraceRecord": "observe.trace",
    "TransferLedger": "ledger",
    "TransferRecord": "ledger",
    "block_sizes": "blocks.find",
    "find_blocks": "blocks.find",
    "install": "runtime.install",
    "is_installed": "runtime.install",
    "load_file_backed": "host.loading",
    "module_nbytes": "transfer.book",
    "offload_status": "runtime.api",
    "optimal_bytes": "residency.optimum",
    "release": "runtime.api",
    "replay": "policies.replay",
    "replay_trace": "policies.replay",
    "trace": "observe.trace",
    "transfer_ledger": "runtime.api",
    "uninstall": "runtime.install",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
