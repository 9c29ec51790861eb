"""Several replicas' balancers exchanging reports (core/shared.py), with no I/O."""

from __future__ import annotations

import json
import random
from typing import Any

from tailguard.core.balancer import Balancer, PoolConfig
from tailguard.core.fleet import NodeSpec, NodeState, Outcome
from tailguard.core.hardware import DEFAULT_CATALOG
from tailguard.core.limits import LimitConfig
from tailguard.core.replay import replay

MODEL = "llama-3.1-8b"


def specs(n: int, gpu: str = "A100") -> list[NodeSpec]:
    return [NodeSpec(f"n{i}", DEFAULT_CATALOG.gpu(gpu), gpu, models=(MODEL,)) for i in range(n)]


def exchange(replicas: dict[str, Balancer], now: float, leader: str | None) -> list[Any]:
    """Every replica publishes, then takes in the others' reports (JSON round trip, as Redis)."""
    reports = {r: json.loads(json.dumps({**b.report(now, r == leader), "epoch": 1}))
               for r, b in replicas.items()}
    events = []
    for r, b in replicas.items():
        events += b.on_peers(now, {o: rep for o, rep in reports.items() if o != r}, r == leader)
    return events


def test_the_others_in_flight_steer_routing_and_expire() -> None:
    a = Balancer(specs(2), [PoolConfig(MODEL, "least_request")], random.Random(0))
    b = Balancer(specs(2), [PoolConfig(MODEL, "least_request")], random.Random(1))
    held = [b.take(MODEL, "n0", 100, 0.0) for _ in range(10)]
    assert all(t is not None for t in held)
    exchange({"a": a, "b": b}, 0.1, "a")
    assert a.nodes["n0"].remote_in_flight == 10 and a.nodes["n0"].fleet_in_flight == 10
    got = [t.node_id for t in (a.pick(MODEL, 100, 0.2 + i * 0.01) for i in range(4)) if t]
    assert got == ["n1"] * 4  # n0 carries b's ten
    # until the next report, a takes its own rush to n1 for b's too (b routes alike)
    assert a.nodes["n1"].fleet_in_flight == 8 and a.nodes["n0"].fleet_in_flight == 10
    exchange({"a": a, "b": b}, 0.3, "a")  # b's report: it sent n1 nothing after all
    assert a.nodes["n1"].fleet_in_flight == 4
    # b's report stops coming (its TTL ran out in the driver): its share is gone
    a.on_peers(1.0, {}, True)
    assert a.nodes["n0"].fleet_in_flight == 0


def test_limit_shares_follow_demand_and_sum_to_the_limit() -> None:
    pool = PoolConfig(MODEL, "least_request", limits=LimitConfig(kind="fixed", initial=12))
    a = Balancer(specs(1), [pool], random.Random(0))
    b = Balancer(specs(1), [pool], random.Random(1))
    lim_a, lim_b = a.nodes["n0"].limiter, b.nodes["n0"].limiter
    assert lim_a is not None and lim_b is not None
    assert lim_a.allowed == 12  # alone: the whole limit
    exchange({"a": a, "b": b}, 0.0, "a")
    assert lim_a.allowed == lim_b.allowed == 6  # idle alike: halves
    for i in range(6):
        assert a.pick(MODEL, 10, 0.1 + i * 0.01) is not None
    assert a.pick(MODEL, 10, 0.2) is None  # its share is full
    exchange({"a": a, "b": b}, 0.3, "a")
    # a's demand (6 in flight) against b's none: (6+1)/(6+1+0+1) of 12
    assert (lim_a.allowed, lim_b.allowed) == (10, 2)
    assert lim_a.allowed + lim_b.allowed <= 12


def drive(replicas: list[Balancer], seconds: float, slow_node: str, period: float = 0.25,
          names: list[str] | None = None) -> dict[str, float]:
    """Requests every 0.05 s spread round robin over ``replicas``; ``slow_node`` 4x slow.

    Reports are exchanged every ``period`` when there are several. Returns, per
    replica, when it first saw the slow node degraded or quarantined.
    """
    names = names or [f"r{i}" for i in range(len(replicas))]
    by_name = dict(zip(names, replicas, strict=True))
    seen: dict[str, float] = {}
    next_sync = 0.0
    now = 0.0
    step = 0
    while now < seconds:
        now = step * 0.05
        b = replicas[step % len(replicas)]
        t = b.pick(MODEL, 500, now)
        assert t is not None
        slow = 4.0 if t.node_id == slow_node else 1.0
        b.on_first_token(t, now + 0.05 * slow)
        b.on_finish(t, now + 0.05 * slow + 50 * 0.01 * slow, Outcome.OK, 51)
        if step % 2 == 0:
            for r in replicas:
                r.tick(now)
        if len(replicas) > 1 and now >= next_sync:
            exchange(by_name, now, names[0])
            next_sync = now + period
        for name, r in by_name.items():
            if name not in seen and r.nodes[slow_node].state is not NodeState.HEALTHY:
                seen[name] = now
        step += 1
    return seen


def test_pooled_samples_detect_as_fast_as_one_gateway_and_followers_obey() -> None:
    def make(seed: int) -> Balancer:
        return Balancer(specs(4), [PoolConfig(MODEL, "round_robin")], random.Random(seed))

    alone = drive([make(0)], 40.0, "n3")["r0"]
    three = drive([make(0), make(1), make(2)], 40.0, "n3")
    assert set(three) == {"r0", "r1", "r2"}
    # the leader, on everyone's samples: as soon as one gateway would be, give or take
    # the syncs that bring the others' samples (every 0.25 s)
    assert three["r0"] <= max(1.5 * alone, alone + 1.0)
    assert max(three["r1"], three["r2"]) <= three["r0"] + 0.5  # followers within two syncs


def test_only_the_leader_decides_and_a_follower_takes_over() -> None:
    reps = {n: Balancer(specs(4), [PoolConfig(MODEL, "round_robin")], random.Random(i))
            for i, n in enumerate(("a", "b"))}
    drive(list(reps.values()), 40.0, "n3", names=["a", "b"])
    a, b = reps["a"], reps["b"]
    assert a.outliers is not None and b.outliers is not None
    assert a.outliers.authority and not b.outliers.authority
    assert b.nodes["n3"].state is a.nodes["n3"].state
    # a quarantined n3 and b follows, with the leader's count of ejections
    assert a.outliers.detected_ejections >= 1 and b.outliers.detected_ejections == 0
    assert b.outliers.health["n3"].ejections == a.outliers.health["n3"].ejections
    # a is gone: b hears from no leader and decides again
    b.on_peers(100.0, {}, False)
    assert b.outliers.authority


def test_a_recording_with_peer_reports_replays_exactly() -> None:
    rec: list[dict[str, Any]] = []
    a = Balancer(specs(4), [PoolConfig(MODEL, "round_robin")], random.Random(0),
                 recorder=lambda r: rec.append(json.loads(json.dumps(r))))
    b = Balancer(specs(4), [PoolConfig(MODEL, "round_robin")], random.Random(1))
    drive([b, a], 30.0, "n2", names=["b", "a"])  # b leads, a follows
    assert any(r["op"] == "peers" for r in rec)
    assert any(r["op"] == "events" for r in rec)  # a adopted b's decisions
    out = replay(rec)
    assert out.differences == []


def test_a_borrowed_budget_spends_into_debt() -> None:
    from tailguard.core.hedging import HedgeConfig, Hedger
    from tailguard.core.retry_budget import RetryBudget

    b = RetryBudget(0.2, 0.0)
    assert not b.try_spend(0.0)
    b.lent = 1.5  # half of another replica's 3 tokens
    assert b.try_spend(0.0) and b.balance == -1.0
    assert not b.try_spend(0.0)  # 0.5 left to borrow: not a whole retry
    h = Hedger(HedgeConfig(enabled=True))
    h.credit, h.lent = 0.0, 2.0
    assert h.try_hedge() and h.credit == -1.0


def test_a_leader_report_cannot_cordon_or_take_a_node_down() -> None:
    """A leader adopts only the detector's own states: an operator's or the probes'
    in a report are not a leader's to decide (the lifecycle table refuses them)."""
    b = Balancer(specs(1), [PoolConfig(MODEL)], random.Random(0))
    b.tick(0.0)
    for state in ("cordoned", "down", "draining"):
        report = {"leader": True, "demand": 0, "epoch": 1,
                  "nodes": {"n0": {"f": 0, "b": 0, "d": [0.0, 0], "p": [0.0, 0],
                                   "s": [state, 1.0, 0, 0.0, "rogue"]}}}
        assert b.on_peers(1.0, {"r1": report}, leader=False) == []
        assert b.nodes["n0"].state is NodeState.HEALTHY


def test_a_leader_cannot_quarantine_past_the_ejection_cap_or_zero_a_weight() -> None:
    """A leader's decisions are held to the detector's own rules: quarantining every node
    takes out at most ``max_ejection_share`` of the pool (the rest are degraded), and a
    routable node keeps at least ``min_weight``."""
    b = Balancer(specs(4), [PoolConfig(MODEL)], random.Random(0))
    b.tick(0.0)
    decided = ["quarantined", 0.0, 1, 300.0, "claimed"]
    report = {"leader": True, "demand": 0, "epoch": 1,
              "nodes": {f"n{i}": {"f": 0, "b": 0, "s": decided} for i in range(4)}}
    b.on_peers(1.0, {"r1": report}, leader=False)
    states = [n.state for n in b.nodes.values()]
    cap = b.outliers.config.max_ejection_share if b.outliers is not None else 0.0
    assert 0 < states.count(NodeState.QUARANTINED) <= cap * 4
    assert states.count(NodeState.DEGRADED) == 4 - states.count(NodeState.QUARANTINED)
    weights = [n.weight_scale for n in b.nodes.values() if n.state.routable]
    assert weights and min(weights) > 0.0
    ticket = b.pick(MODEL, 100, 2.0)
    assert ticket is not None and ticket.node.state.routable
