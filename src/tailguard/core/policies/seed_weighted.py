"""The classic heterogeneous weighted balancer, kept faithfully as the baseline to beat.

Each node has a static weight by GPU class: H100 1.0, A100 0.8, T4 0.2, any
other 0.5 (a declared ``weight`` overrides it). The score of a node is
``weight / max(current_load, 0.1)`` and the highest score wins; on a tie the
node registered first wins. ``current_load`` counts up by one on dispatch and
(unlike the naive original, which never decremented it) down by one on
completion: it is the node's requests in flight.

Worked example: an idle H100 scores 1.0/0.1 = 10, an A100 with one request
0.8/1 = 0.8, a T4 with none 0.2/0.1 = 2: the H100 gets the request. Once
every node is busy, an H100 with 4 in flight scores 0.25 and a T4 with 1
scores 0.2: the static weights only scale queue lengths, whatever the load
really costs on each GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from random import Random

from tailguard.core.fleet import NodeView, seed_weight
from tailguard.core.policies.base import RequestInfo, Slo


class SeedWeighted:
    name = "seed_weighted"
    Options = None  # no options

    def __init__(self, slo: Slo | None = None, options: None = None) -> None:
        pass

    def choose(
        self, nodes: Sequence[NodeView], req: RequestInfo, now: float, rng: Random
    ) -> str | None:
        best: NodeView | None = None
        best_score = -1.0
        for n in nodes:
            spec = n.spec
            weight = spec.weight if spec.weight is not None else seed_weight(spec.gpu_class)
            score = weight / max(n.fleet_in_flight, 0.1)
            if score > best_score:  # strict: the first registered wins a tie
                best, best_score = n, score
        return best.id if best else None
