"""Uniform random choice among eligible nodes (a baseline)."""

from __future__ import annotations

from collections.abc import Sequence
from random import Random

from tailguard.core.fleet import NodeView
from tailguard.core.policies.base import RequestInfo, Slo


class RandomChoice:
    name = "random"
    Options = None  # no options

    def __init__(self, slo: Slo | None = None, options: None = None) -> None:
        pass

    def choose(
        self, nodes: Sequence[NodeView], req: RequestInfo, now: float, rng: Random
    ) -> str | None:
        if not nodes:
            return None
        return nodes[rng.randrange(len(nodes))].id
