"""`doe.trace(pipe)`: which component's weights really moved, in which call and step, how many bytes, how long.

Three sources of records, always named in the record (`source`) and in every output:

- `"extension"`: a move this extension made, reported by its session to its observers and timed around the transfer.
- `"observed"`: parameters or buffers found on another device than the last time they were looked at. The trace
  looks before and after every offload hook method (accelerate's `_hf_hook` objects, diffusers' hook registries)
  and every pipeline method that moves weights, and when a component starts running. It never infers a move from a
  hook's name or type: only a changed `tensor.device` counts.
- `"replayed"`: on the CPU the execution device is the host, so stock's model offload and group offload move
  nothing that can be seen. The trace then records the component-call trace and derives stock's moves from stock's
  policy (`ChainPolicy` for model offload, the hooks' groups for group offload). These are predictions, not
  measurements.

Modules: `records` (the data and its JSON form), `document` (`Trace` and `trace()`), `tracer` (start, stop and
wiring), `pipeline` (what the tracer sees of a pipeline), `hooks` (wrapping), `placement` (reading tensor devices),
`devices` (device names), `phases` (calls, steps and phases), `recorder` (making records), `extension` (the
extension's own moves), `stock` (replays of stock offload on the CPU), `timing` (clocks, NVTX and profiler ranges).
"""

from .document import Trace, trace
from .records import (
    BETWEEN,
    EXTENSION,
    FORMAT,
    FORMAT_VERSION,
    OBSERVED,
    REPLAYED,
    SOURCES,
    CallInfo,
    ComponentUse,
    TraceRecord,
)
from .timing import nvtx_range

__all__ = [
    "BETWEEN",
    "EXTENSION",
    "FORMAT",
    "FORMAT_VERSION",
    "OBSERVED",
    "REPLAYED",
    "SOURCES",
    "CallInfo",
    "ComponentUse",
    "Trace",
    "TraceRecord",
    "nvtx_range",
    "trace",
]
