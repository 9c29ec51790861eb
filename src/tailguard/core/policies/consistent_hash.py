"""consistent_hash: session affinity on a hash ring (Karger et al., STOC 1997).

Each node owns ``replicas`` points (default 100) on a ring of 64-bit hashes;
a request goes to the first eligible node clockwise from its key's hash, so a
session (its ``x-session-id`` header, else the body's OpenAI ``user`` field)
always lands on the same node while that node is eligible, and losing a node
moves only its own sessions. It is the sticky-session baseline of Envoy's
``RING_HASH`` and of the routers' ``consistent_hash`` policies: blind to load,
hardware and caches alike. A request without a session key hashes its prompt's
first block (prefix affinity), and without either goes to the least loaded node.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from random import Random

from tailguard.core.fleet import NodeView
from tailguard.core.policies.base import RequestInfo, Slo

_RINGS_KEPT = 64  # rings of recent eligible sets (a node going down changes the set)


def _h(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@dataclass(frozen=True, slots=True)
class ConsistentHashOptions:
    """``policy_options`` of ``consistent_hash``."""

    replicas: int = 100  # points per node on the ring


class ConsistentHash:
    name = "consistent_hash"
    Options = ConsistentHashOptions

    def __init__(self, slo: Slo | None = None,
                 options: ConsistentHashOptions | None = None) -> None:
        self.replicas = (options or ConsistentHashOptions()).replicas
        self._rings: dict[tuple[str, ...], tuple[list[int], list[str]]] = {}

    def _ring(self, ids: tuple[str, ...]) -> tuple[list[int], list[str]]:
        ring = self._rings.get(ids)
        if ring is None:
            points = sorted((_h(f"{node}#{k}"), node) for node in ids
                            for k in range(self.replicas))
            ring = ([p for p, _ in points], [n for _, n in points])
            if len(self._rings) >= _RINGS_KEPT:
                self._rings.clear()
            self._rings[ids] = ring
        return ring

    def choose(
        self, nodes: Sequence[NodeView], req: RequestInfo, now: float, rng: Random
    ) -> str | None:
        if not nodes:
            return None
        if req.session is not None:
            key = _h(req.session)
        elif req.prefix:
            key = req.prefix[0] & ((1 << 64) - 1)
        else:
            return min(nodes, key=lambda n: n.fleet_in_flight).id
        points, owners = self._ring(tuple(sorted(n.id for n in nodes)))
        i = bisect_left(points, key)
        return owners[i % len(owners)]
