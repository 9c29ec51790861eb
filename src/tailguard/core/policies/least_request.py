"""Least request: the node with the fewest requests in flight (join the shortest queue).

Ties go to the node registered first, which keeps the choice deterministic.
This is Envoy's LEAST_REQUEST with all nodes compared (not sampled), blind to
hardware: an L4 with 3 requests looks as loaded as an H100 with 3.
"""

from __future__ import annotations

from collections.abc import Sequence
from random import Random

from tailguard.core.fleet import NodeView
from tailguard.core.policies.base import RequestInfo, Slo


class LeastRequest:
    name = "least_request"
    Options = None  # no options

    def __init__(self, slo: Slo | None = None, options: None = None) -> None:
        pass

    def choose(
        self, nodes: Sequence[NodeView], req: RequestInfo, now: float, rng: Random
    ) -> str | None:
        best: NodeView | None = None
        best_load = 1 << 62
        for n in nodes:
            if n.fleet_in_flight < best_load:
                best, best_load = n, n.fleet_in_flight
        return best.id if best else None
