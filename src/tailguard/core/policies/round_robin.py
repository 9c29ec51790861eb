"""Round robin: each eligible node in turn, blind to hardware and load (a baseline)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from random import Random
from typing import Any

from tailguard.core.fleet import NodeView
from tailguard.core.policies.base import RequestInfo, Slo


class RoundRobin:
    name = "round_robin"

    def __init__(self, slo: Slo | None = None, options: Mapping[str, Any] | None = None) -> None:
        self._next = 0

    def choose(
        self, nodes: Sequence[NodeView], req: RequestInfo, now: float, rng: Random
    ) -> str | None:
        if not nodes:
            return None
        node = nodes[self._next % len(nodes)]
        self._next += 1
        return node.id
