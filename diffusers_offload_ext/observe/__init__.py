"""Observation: the trace and its reports. Observers read the ledger and the marks the extension leaves on
pipelines, import nothing from the runtime, and never write its state."""
