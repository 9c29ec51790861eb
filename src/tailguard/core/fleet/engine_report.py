"""What the engine itself last reported on its ``/metrics`` page."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineReport:
    """The engine's own count of running and waiting requests and its KV cache use,
    as of ``at`` (-1 each: not reported, or withdrawn as stale). Swapped whole."""

    running: int = -1
    waiting: int = -1
    kv_usage: float = -1.0
    at: float = -1.0


NOT_REPORTED = EngineReport()
