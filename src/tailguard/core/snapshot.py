"""A frozen read model of the balancer for observers (metrics, the admin API, the
dashboard): :meth:`Balancer.snapshot` copies what they show, so none of them
touches a live node, pool or detector record, and what one page shows was true
at one moment.

Derived figures every observer shows the same way are computed here once:
a node's *slowness* for its own hardware (the detector's calibrated ratio, else
its decode slowdown over its class's) and its *capacity* (decode tokens per
second at the largest batch that keeps its pool's TPOT SLO, at its learned
speed).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from tailguard.core.fleet import EngineReport, Node, NodeSpec, NodeState
from tailguard.core.outliers import OutlierDetector
from tailguard.core.pool import Pool, PoolConfig
from tailguard.core.probes import HealthProbes


@dataclass(frozen=True, slots=True)
class LimitSnapshot:
    """A node's concurrency limiter (pools with ``limits``)."""

    limit: int  # every replica's, together
    in_use: int  # this replica's permits
    allowed_here: int  # this replica's share of the limit
    successes: int
    dropped: int
    ignored: int


@dataclass(frozen=True, slots=True)
class OutlierSnapshot:
    """What the outlier detector holds on a node."""

    slowness: float
    ejections: int
    consecutive_failures: int
    reason: str


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    id: str
    spec: NodeSpec
    state: NodeState
    weight_scale: float
    slots: int
    in_flight: int
    in_flight_elsewhere: int  # the other gateway replicas', as they last said
    prefilling: int
    decoding: int
    dispatched_total: int
    stalls: int
    stalled_s: float
    decode_slowdown: float  # its own, over the roofline prior
    prefill_slowdown: float
    class_decode_slowdown: float
    class_prefill_slowdown: float
    ttft_s: float | None  # recent estimates of what clients got (None: no sample yet)
    tpot_s: float | None
    latency_s: float
    engine: EngineReport
    limiter: LimitSnapshot | None
    outliers: OutlierSnapshot | None
    slowness: float  # for its own hardware (1 = like its class)
    capacity_tokens_per_s: float  # within its pool's TPOT SLO
    probes_failed: int  # health probes failed in a row (core/probes.py)

    @property
    def gpu_class(self) -> str:
        return self.spec.gpu_class

    @property
    def limit(self) -> int:
        """Its concurrency limit: its limiter's, else its slots."""
        return self.limiter.limit if self.limiter is not None else self.slots


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    name: str
    config: PoolConfig
    nodes: tuple[str, ...]
    states: Mapping[NodeState, int]
    queue_depth: int  # 0 without a queue
    shed_total: Mapping[str, int]  # by reason
    capacity_tokens_per_s: float  # its routable nodes', together
    moved: Mapping[str, int]  # ended streams that moved, by "cause/result"


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    at: float
    nodes: Mapping[str, NodeSnapshot]  # in the order they were added
    pools: Mapping[str, PoolSnapshot]
    double_release: int


def snapshot(nodes: Mapping[str, Node], pools: Mapping[str, Pool],
             outliers: OutlierDetector | None, probes: HealthProbes, double_release: int,
             now: float) -> FleetSnapshot:
    """The read model as of ``now`` (see the module docstring)."""
    node_snaps = {nid: _node(n, pools, outliers, probes, now) for nid, n in nodes.items()}
    pool_snaps: dict[str, PoolSnapshot] = {}
    for name, pool in pools.items():
        states = dict.fromkeys(NodeState, 0)
        cap = 0.0
        for n in pool.nodes:
            states[n.state] += 1
            if n.state.routable:
                cap += node_snaps[n.id].capacity_tokens_per_s
        queue = pool.queue
        pool_snaps[name] = PoolSnapshot(
            name, pool.config, tuple(n.id for n in pool.nodes), states,
            queue.length if queue is not None else 0,
            dict(queue.shed_total) if queue is not None else {}, cap, dict(pool.moved))
    return FleetSnapshot(now, node_snaps, pool_snaps, double_release)


def _node(n: Node, pools: Mapping[str, Pool], outliers: OutlierDetector | None,
          probes: HealthProbes, now: float) -> NodeSnapshot:
    lim = n.limiter
    limiter = None if lim is None else LimitSnapshot(
        lim.limit, lim.inflight, lim.allowed, lim.successes, lim.dropped, lim.ignored)
    h = outliers.health.get(n.id) if outliers is not None else None
    seen = None if h is None else OutlierSnapshot(h.slowness, h.ejections,
                                                  h.consecutive_failures, h.reason)
    probed = probes.count(n.id)
    cls = n.class_decode_slowdown
    if h is not None and math.isfinite(h.slowness):
        slowness = float(h.slowness)
    else:
        slowness = n.capacity.decode_slowdown / cls if cls > 0 else 1.0
    return NodeSnapshot(
        n.id, n.spec, n.state, n.weight_scale, n.slots, n.in_flight, n.remote_in_flight,
        n.prefilling, n.decoding, n.dispatched_total, n.stalls, n.stalled_s,
        n.capacity.decode_slowdown, n.capacity.prefill_slowdown, n.class_decode_slowdown,
        n.class_prefill_slowdown, n.ttft.value if n.ttft.count else None,
        n.tpot.value if n.tpot.count else None, n.latency.decayed(now), n.engine, limiter,
        seen, slowness, _capacity(n, pools), probed.failed if probed is not None else 0)


def _capacity(n: Node, pools: Mapping[str, Pool]) -> float:
    """Decode tokens/s the node delivers at the largest batch that keeps its pool's TPOT
    SLO, at its learned decode speed."""
    pool = pools.get(n.spec.models[0]) if n.spec.models else None
    if pool is None:
        return 0.0
    slow = n.capacity.decode_slowdown
    ctx = pool.mean_prompt + pool.mean_output * 0.5
    batch = n.perf.max_batch_for_tpot(pool.config.slo.tpot_s / slow, ctx, limit=n.slots)
    if batch <= 0:
        return 0.0
    return float(n.perf.decode_tokens_per_s(batch, ctx) / slow)


__all__ = ["FleetSnapshot", "LimitSnapshot", "NodeSnapshot", "OutlierSnapshot", "PoolSnapshot",
           "snapshot"]
