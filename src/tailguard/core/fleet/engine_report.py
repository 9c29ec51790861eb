"""What the engine itself last reported on its ``/metrics`` page."""

from __future__ import annotations

from typing import NamedTuple


class EngineReport(NamedTuple):
    """The engine's own count of running and waiting requests, its KV cache use and
    how many requests it has preempted since it started, as of ``at`` (-1 each:
    not reported, or withdrawn as stale). Swapped whole (a named tuple: one is
    made per node per scrape, and it is the cheapest immutable record)."""

    running: int = -1
    waiting: int = -1
    kv_usage: float = -1.0
    at: float = -1.0
    preemptions: int = -1  # vLLM's count; the other engines export none


NOT_REPORTED = EngineReport()
