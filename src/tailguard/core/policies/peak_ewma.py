"""Peak-EWMA with power of two choices (Finagle ``PeakEwma``, Linkerd's default).

Each node keeps a peak-sensitive EWMA of its request latency (see
:class:`tailguard.core.estimate.PeakEwma`, tau 10 s); its load is
``cost * (in_flight + 1)``. Two nodes are sampled and the lower load wins.
A node that has not answered yet has cost 0 and so is tried first, which is
how the algorithm discovers new nodes.

Worked example: node A has cost 0.8 s and 3 in flight (load 3.2), node B has
cost 2.0 s and 1 in flight (load 4.0): A wins although it is busier.
"""

from __future__ import annotations

from collections.abc import Sequence
from random import Random

from tailguard.core.fleet import NodeView
from tailguard.core.policies.base import RequestInfo, Slo
from tailguard.core.policies.p2c import sample_two


class PeakEwmaP2C:
    name = "peak_ewma"
    Options = None  # no options

    def __init__(self, slo: Slo | None = None, options: None = None) -> None:
        pass

    def choose(
        self, nodes: Sequence[NodeView], req: RequestInfo, now: float, rng: Random
    ) -> str | None:
        if not nodes:
            return None
        a, b = sample_two(nodes, rng)
        la = a.latency.decayed(now) * (a.fleet_in_flight + 1)
        lb = b.latency.decayed(now) * (b.fleet_in_flight + 1)
        return (a if la <= lb else b).id
