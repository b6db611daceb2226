"""The words every layer shares: move directions, eviction kinds, the end-of-call marker and byte units."""

#: A component's weights go to the execution device.
ONLOAD = "onload"
#: A component's weights leave the execution device for the host.
OFFLOAD = "offload"
DIRECTIONS = (ONLOAD, OFFLOAD)

#: The weights crossed the bus (host to device for an onload, device to host for an offload).
COPY = "copy"
#: An offload that only released the device copy, because an unchanged host copy was kept (zero-copy eviction).
DROP = "drop"
#: An onload started ahead of use (a policy's decision direction, and the ledger kind of that onload): on a device
#: with a copy stream it overlaps the running component; before the component runs, its completion is waited on.
PREFETCH = "prefetch"
KINDS = (COPY, DROP, PREFETCH)
#: A policy's decision direction: run a component larger than the room the budget leaves it by streaming its blocks
#: (the most used stay on the device, the others pass through a ring of device buffers); see `blocks/`.
STREAM = "stream"
#: A policy's decision direction: the component keeps exactly the blocks its `Keep` names on the device (`Decision.kept`);
#: while it runs, its other blocks stream through its ring. Residency block by block (`residency/blockwise.py`).
KEEP = "keep"

#: The cause of a move an out-of-memory recovery forced (`TransferRecord.cause`): evictions that made room, a component
#: restarted to stream its blocks in less room.
OUT_OF_MEMORY = "out-of-memory"

#: The cause of an eviction the end of a call made (`TransferRecord.cause`), and of one made when offload is armed,
#: by the chain and by the residency manager (its budget).
END_OF_CALL = "end of call"
ARMING = ("arming", "budget")

#: In a recorded trace, the end of a pipeline call (`maybe_free_model_hooks()`).
END = "<end of call>"

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

#: Default `memory_reserve`: what the automatic CUDA budget leaves free for activations.
DEFAULT_RESERVE = 3 * GiB
#: How many completed call traces a pipeline remembers (the policies predict from the last one).
HISTORY = 8
