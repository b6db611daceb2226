"""Outputs of a `Trace`: a summary `dict` (`summary`), a `rich` table (`table`) and a matplotlib timeline
(`timeline`, with `slots` placing events on the step axis and `panel` drawing one trace), on an Agg canvas with no
pyplot state."""

from .summary import call_key, summarize
from .table import format_seconds, summary_table
from .timeline import plot_traces

__all__ = ["call_key", "format_seconds", "plot_traces", "summarize", "summary_table"]
