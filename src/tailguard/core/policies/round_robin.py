"""Round robin: each eligible node in turn, blind to hardware and load (a baseline)."""

from __future__ import annotations

from collections.abc import Sequence
from random import Random

from tailguard.core.fleet import NodeView
from tailguard.core.policies.base import RequestInfo, Slo


class RoundRobin:
    name = "round_robin"
    Options = None  # no options

    def __init__(self, slo: Slo | None = None, options: None = None) -> None:
        self._next = 0

    def choose(
        self, nodes: Sequence[NodeView], req: RequestInfo, now: float, rng: Random
    ) -> str | None:
        if not nodes:
            return None
        node = nodes[self._next % len(nodes)]
        self._next += 1
        return node.id
