"""diffusers-offload-ext: controllable, cheap model CPU offload for diffusers pipelines."""

from ._hook import DeferredCpuOffload, OffloadHandle
from ._install import install, is_installed, uninstall
from ._ledger import TransferLedger, TransferRecord, module_nbytes
from ._mixin import OffloadMixin
from ._options import OffloadOptions
from ._policy import END, ChainPolicy, replay
from ._residency import ResidencyPolicy, optimal_bytes
from ._state import release, transfer_ledger
from ._trace import Trace, TraceRecord, trace

__version__ = "0.1.0"

__all__ = [
    "ChainPolicy",
    "DeferredCpuOffload",
    "END",
    "OffloadHandle",
    "OffloadMixin",
    "OffloadOptions",
    "ResidencyPolicy",
    "TransferLedger",
    "TransferRecord",
    "Trace",
    "TraceRecord",
    "install",
    "is_installed",
    "module_nbytes",
    "optimal_bytes",
    "release",
    "replay",
    "trace",
    "transfer_ledger",
    "uninstall",
]
