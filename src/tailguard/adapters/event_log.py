"""The gateway's recent events: what the core decided, and what remediation did.

A bounded ring (the last ``size`` entries) behind ``GET /admin/events``. Each
entry has a sequence number, so a poller asks ``?since=<seq>`` for the new
ones only, and a wall-clock time (``time``, Unix seconds) for people::

    {"seq": 12, "time": 1764450000.1, "node": "a100-2", "kind": "state",
     "state": "quarantined", "reason": "slow: decode 3.4x class peers ..."}
    {"seq": 13, "time": 1764450000.2, "node": "a100-2", "kind": "action",
     "trigger": "quarantined", "action": "command", "result": "ok", "detail": "exit 0"}
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from tailguard.core.events import Event


class EventLog:
    def __init__(self, size: int = 1000) -> None:
        self._entries: deque[dict[str, Any]] = deque(maxlen=size)
        self._seq = 0

    def add(self, entry: dict[str, Any]) -> dict[str, Any]:
        self._seq += 1
        full = {"seq": self._seq, "time": round(time.time(), 3), **entry}
        self._entries.append(full)
        return full

    def on_core_event(self, ev: Event) -> None:
        entry = {"node": ev.node, "kind": ev.kind, "state": ev.state, "reason": ev.reason}
        if ev.cause:
            entry["cause"] = ev.cause
        if ev.advice:
            entry["advice"] = ev.advice
        self.add(entry)

    def since(self, seq: int = 0) -> list[dict[str, Any]]:
        return [e for e in self._entries if e["seq"] > seq]
