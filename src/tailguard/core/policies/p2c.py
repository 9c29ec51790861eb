"""Power of two choices on requests in flight (Mitzenmacher, 2001).

Sample two distinct nodes at random, send to the one with fewer requests in
flight. With ``n`` nodes the maximum load drops from ``log n / log log n``
(random) to ``log log n / log d`` (``d`` choices), without a global scan, and
several gateway replicas do not herd onto the same "best" node.
"""

from __future__ import annotations

from collections.abc import Sequence
from random import Random

from tailguard.core.fleet import NodeView
from tailguard.core.policies.base import RequestInfo, Slo


def sample_two(nodes: Sequence[NodeView], rng: Random) -> tuple[NodeView, NodeView]:
    """Two distinct nodes (the same one twice when there is only one)."""
    k = len(nodes)
    i = rng.randrange(k)
    if k == 1:
        return nodes[i], nodes[i]
    j = rng.randrange(k - 1)
    if j >= i:
        j += 1
    return nodes[i], nodes[j]


class PowerOfTwo:
    name = "p2c"
    Options = None  # no options

    def __init__(self, slo: Slo | None = None, options: None = None) -> None:
        pass

    def choose(
        self, nodes: Sequence[NodeView], req: RequestInfo, now: float, rng: Random
    ) -> str | None:
        if not nodes:
            return None
        a, b = sample_two(nodes, rng)
        return (a if a.fleet_in_flight <= b.fleet_in_flight else b).id
