"""Several gateway replicas acting as one: what a replica tells the others, and what it takes in.

Every replica routes with its own balancer. Left alone, each would see only
its own requests on every node, apply the whole of each node's limit, judge
stragglers on a fraction of the samples and quarantine on its own. Here a
replica publishes a :meth:`Peers.report` of what it knows (a JSON-ready dict) and
merges the others' with :meth:`Peers.merge`, a balancer input that is recorded and
replayed like any other (``Balancer.on_peers``). How reports travel (Redis,
``tailguard.adapters.shared_state``) is the driver's business; this module does
no I/O and never waits.

What is merged, per node:

* **load**: the others' in-flight counts and prompt backlogs
  (``Node.remote_in_flight``, ``remote_backlog``). Routing and the TTFT
  predictions use the sum (``fleet_in_flight``, ``fleet_backlog``): this
  replica's own counts, exact, plus the others' last report, extrapolated
  until the next by this replica's own change since, times the others'
  demand over its own (replicas that route alike load a node alike: without
  it, every replica takes the node it just rushed for one the others left
  alone, and they herd for a whole period). A replica whose report stops
  coming (the driver drops it after its TTL) stops counting;
* **speed**: each replica's learned decode and prefill slowdown, averaged in
  log space weighted by samples (at most ``SPEED_WEIGHT_CAP`` each, the
  estimators' memory), so every replica prices a GPU class alike;
* **limit share**: a replica may hold ``share = (d + 1) / sum(d_j + 1)`` of a
  node's limit, ``d`` its demand (requests in flight plus queued): a replica
  that gets more clients gets more of the fleet; shares sum to one, so the
  replicas together never hold more than the limit (up to rounding and one
  period's staleness). The limit is the mean of the replicas' learned ones,
  each learned with every sample weighted by the replica's share of the
  node's requests (so it updates as often as one gateway's would). Admission
  queues stay per replica;
* **detection**: each replica's own samples and outcomes since its last
  report (cumulative counters, differenced here) join this replica's
  current interval, so every detector sees the whole fleet's samples. One
  replica leads (the driver holds a lease): its detector decides, the others
  follow its published states (:meth:`OutlierDetector.adopt`), so a
  quarantine, a probation and a re-admission happen once.

Node states an operator or a health check set (cordoned, draining, down) are
this replica's own; the driver shares operator actions separately.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tailguard.core.estimate import CapacityEstimate
from tailguard.core.events import Event
from tailguard.core.fleet import LIFECYCLE, Node, NodeState
from tailguard.core.outliers import OutlierDetector
from tailguard.core.pool import Pool

SPEED_WEIGHT_CAP = 20.0  # samples one replica's speed estimate counts for, at most


def merged_speed(own: CapacityEstimate,
                 remote: tuple[float, float, float, float]) -> tuple[float, float]:
    """A node's decode and prefill log-slowdowns, this replica's estimate and the others'."""
    out = []
    for est, total, weight in ((own.decode, remote[0], remote[1]),
                               (own.prefill, remote[2], remote[3])):
        w = min(float(est.samples), SPEED_WEIGHT_CAP)
        out.append((est.log_ratio * w + total) / (w + weight) if w + weight > 0.0
                   else est.log_ratio)
    return out[0], out[1]


class PeerLedger:
    """The last sample counters seen from each replica, to difference its next report."""

    __slots__ = ("_seen",)

    def __init__(self) -> None:
        # replica id -> (epoch, node id -> counters)
        self._seen: dict[str, tuple[Any, dict[str, list[float]]]] = {}

    def delta(self, replica: str, epoch: Any, node: str,
              counters: list[float]) -> list[float] | None:
        """What ``replica`` counted on ``node`` since its last report; None: a first sight."""
        seen = self._seen.get(replica)
        if seen is None or seen[0] != epoch:
            seen = self._seen[replica] = (epoch, {})
        last = seen[1].get(node)
        seen[1][node] = counters
        if last is None:
            return None  # a replica met for the first time (or restarted): its past is old news
        out = [a - b for a, b in zip(counters[:6], last[:6], strict=False)]
        if any(x < 0 for x in (out[0], out[2], out[4], out[5])):
            return None  # counters went back: a reset
        return out

    def forget_others(self, live: set[str]) -> None:
        for r in [r for r in self._seen if r not in live]:
            del self._seen[r]


class Peers:
    """This replica's side of the exchange: its report, and the others' merged in."""

    __slots__ = ("ledger", "nodes", "outliers", "pools")

    def __init__(self, nodes: Mapping[str, Node], pools: Mapping[str, Pool],
                 outliers: OutlierDetector | None) -> None:
        self.nodes = nodes
        self.pools = pools
        self.outliers = outliers
        self.ledger = PeerLedger()  # the other replicas' last counters

    def report(self, now: float, leader: bool) -> dict[str, Any]:
        """What this replica publishes: its load, speeds, sample counters and (leading) decisions."""
        det = self.outliers
        nodes: dict[str, Any] = {}
        for nid, n in self.nodes.items():
            d, p = n.capacity.decode, n.capacity.prefill
            entry: dict[str, Any] = {"f": n.in_flight, "b": n.prefill_backlog,
                                     "d": [round(d.log_ratio, 5), d.samples],
                                     "p": [round(p.log_ratio, 5), p.samples]}
            if n.limiter is not None:
                entry["l"] = n.limiter.algorithm.limit
            h = det.health.get(nid) if det is not None else None
            if det is not None and h is not None:
                entry["o"] = [h.prefill.own_n, round(h.prefill.own_total, 5), h.decode.own_n,
                              round(h.decode.own_total, 5), h.own_requests, h.own_failures,
                              h.consecutive_failures]
                if leader and n.state in LIFECYCLE:
                    decided = det.decision(nid, now)
                    ejections, left, reason = decided if decided is not None else (0, 0.0, "")
                    entry["s"] = [n.state.value, round(n.weight_scale, 4), ejections,
                                  round(left, 3), reason]
            nodes[nid] = entry
        return {"leader": leader, "demand": self._own_demand(), "nodes": nodes}

    def merge(self, now: float, reports: Mapping[str, Mapping[str, Any]],
              leader: bool) -> list[Event]:
        """Take in the other replicas' latest ``reports`` (by replica id); ``leader``: this one leads.

        Each report is :meth:`report`'s dict plus ``"epoch"`` (changes when that
        replica restarts). Returns the state changes adopted from the leader.
        """
        nodes = self.nodes
        det = self.outliers
        ledger = self.ledger
        events: list[Event] = []
        if det is not None:
            det.authority = leader or not any(r.get("leader") for r in reports.values())
        load: dict[str, list[float]] = {nid: [0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0] for nid in nodes}
        demand_all = 1.0 + float(self._own_demand())
        own_share = demand_all
        leader_report: tuple[str, Mapping[str, Any]] | None = None
        for replica in sorted(reports):
            rep = reports[replica]
            demand_all += 1.0 + float(rep.get("demand", 0))
            if rep.get("leader") and leader_report is None:
                leader_report = (replica, rep)
            for nid, entry in rep.get("nodes", {}).items():
                acc = load.get(nid)
                if acc is None:
                    continue
                acc[0] += entry.get("f", 0)
                acc[1] += entry.get("b", 0)
                d_lr, d_n = entry.get("d", (0.0, 0))
                p_lr, p_n = entry.get("p", (0.0, 0))
                dw, pw = min(float(d_n), SPEED_WEIGHT_CAP), min(float(p_n), SPEED_WEIGHT_CAP)
                acc[2] += d_lr * dw
                acc[3] += dw
                acc[4] += p_lr * pw
                acc[5] += pw
                if "l" in entry:
                    acc[6] += entry["l"]
                    acc[7] += 1.0
                counters = entry.get("o")
                if det is not None and counters is not None:
                    delta = ledger.delta(replica, rep.get("epoch"), nid, list(counters))
                    if delta is not None and any(delta):
                        det.absorb(nid, (int(delta[0]), delta[1]), (int(delta[2]), delta[3]),
                                   int(delta[4]), int(delta[5]), int(counters[6]))
        ledger.forget_others(set(reports))
        share = own_share / demand_all
        # The others' demand over this one's, at most one per other replica: a
        # replica with few clients must not take each of its requests for many.
        ratio = min((1.0 - share) / share, float(len(reports)))
        for nid, n in nodes.items():
            acc = load[nid]
            n.apply_peers(int(acc[0]), int(acc[1]), ratio,
                          (acc[2], acc[3], acc[4], acc[5]) if acc[3] or acc[5] else None)
            lim = n.limiter
            if lim is not None:
                lim.share = share
                lim.remote = n.remote_in_flight
                lim.fleet_limit = ((lim.algorithm.limit + acc[6]) / (1.0 + acc[7]) if acc[7]
                                   else 0.0)
        if det is not None and not det.authority and leader_report is not None:
            replica, rep = leader_report
            for nid, entry in rep.get("nodes", {}).items():
                node = nodes.get(nid)
                decided = entry.get("s")
                if node is None or decided is None or node.state not in LIFECYCLE:
                    continue
                state = NodeState(decided[0])
                if state not in LIFECYCLE:  # a leader decides only the detector's states
                    continue
                reason = f"{decided[4]} (decided by replica {replica})"
                det.adopt(node, state, float(decided[1]), int(decided[2]), float(decided[3]), reason,
                          now, self.pools.values(), events)
        return events

    def _own_demand(self) -> int:
        d = sum(n.in_flight for n in self.nodes.values())
        for pool in self.pools.values():
            if pool.queue is not None:
                d += pool.queue.length
        return d
