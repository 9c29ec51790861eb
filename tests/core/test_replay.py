"""Record a balancer's inputs, replay them into a fresh one, find every differing decision."""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any

from tailguard.core.admission import AdmissionConfig, Waiter
from tailguard.core.balancer import Balancer, PoolConfig, Ticket
from tailguard.core.fleet import NodeSpec, NodeState, Outcome
from tailguard.core.hardware import DEFAULT_CATALOG
from tailguard.core.limits import LimitConfig
from tailguard.core.outliers import OutlierConfig
from tailguard.core.policies import Slo
from tailguard.core.policies.tailguard_options import TailguardOptions
from tailguard.core.replay import replay

MODEL = "llama-3.1-8b"


def drive(policy: str, seed: int, outliers: OutlierConfig | None = None) -> list[dict[str, Any]]:
    log: list[dict[str, Any]] = []
    specs = [NodeSpec(f"n{i}", DEFAULT_CATALOG.gpu(g), DEFAULT_CATALOG.gpu(g).name,
                      models=(MODEL,), labels={"zone": "a"})
             for i, g in enumerate(["H100", "A100", "L4", "A100"])]
    b = Balancer(specs, [PoolConfig(MODEL, policy, None, Slo(1.5, 0.08))],
                 random.Random(seed), recorder=log.append, outliers=outliers)
    rng = random.Random(seed + 1)
    open_tickets = []
    now = 0.0
    for step in range(400):
        now += rng.expovariate(20.0)
        t = b.pick(MODEL, rng.randint(10, 3000), now, max_tokens=rng.choice([None, 64]))
        if t is not None:
            open_tickets.append(t)
        if open_tickets and rng.random() < 0.6:
            t = open_tickets.pop(rng.randrange(len(open_tickets)))
            b.on_first_token(t, now + 0.1)
            b.on_finish(t, now + rng.uniform(0.2, 5.0), rng.choice(list(Outcome)),
                        rng.randint(1, 300))
        if step % 37 == 0:
            b.tick(now)
            b.on_engine_metrics("n1", now, 3, 1, 0.4)
        if step == 200:
            b.set_state("n2", NodeState.CORDONED)
            b.add_node(NodeSpec("n9", DEFAULT_CATALOG.gpu("H200"), "H200", models=(MODEL,)))
            b.replace_pool(PoolConfig(MODEL, policy, None, Slo(2.0, 0.1)))
        if step == 300:
            b.remove_node("n3")
    # The recording must survive a JSON round trip (it is written as JSONL).
    return [json.loads(json.dumps(r)) for r in log]


def test_replay_reproduces_every_decision() -> None:
    for policy in ("tailguard", "p2c", "random", "seed_weighted", "peak_ewma"):
        log = drive(policy, seed=7)
        res = replay(log)
        assert res.decisions > 400
        assert res.differences == [], (policy, res.differences[:3])


def test_replay_reports_a_changed_decision() -> None:
    log = drive("tailguard", seed=3)
    picks = [i for i, r in enumerate(log) if r["op"] == "pick" and r["node"] is not None]
    log[picks[10]]["node"] = "nowhere"
    res = replay(log)
    assert len(res.differences) == 1
    assert res.differences[0]["record"] == picks[10]
    assert res.differences[0]["recorded"] == "nowhere"


def test_replay_uses_the_recorded_detector_settings() -> None:
    cfg = dataclasses.replace(OutlierConfig(), interval_s=1.0, consecutive_intervals=1)
    log = drive("tailguard", seed=11, outliers=cfg)
    assert log[0]["outliers"]["interval_s"] == 1.0
    assert any(r["op"] == "events" for r in log)  # the detector acted during the run
    assert replay(log).differences == []


def drive_admission(seed: int) -> list[dict[str, Any]]:
    """An overloaded pool with limits and a queue: tickets, queue places, 429s,
    dispatches from the queue, cancelled waiters, all recorded; the policy's options
    (sampled candidates, the overload spill) go through the record too."""
    log: list[dict[str, Any]] = []
    specs = [NodeSpec(f"n{i}", DEFAULT_CATALOG.gpu(g), DEFAULT_CATALOG.gpu(g).name,
                      models=(MODEL,)) for i, g in enumerate(["A100", "L4", "L4"])]
    options = TailguardOptions(sample=2, spill_excess=0.5)
    pool = PoolConfig(MODEL, "tailguard", options, Slo(1.0, 0.1),
                      limits=LimitConfig(kind="gradient"),
                      admission=AdmissionConfig(queue_max=16))
    b = Balancer(specs, [pool], random.Random(seed), recorder=log.append)
    rng = random.Random(seed + 1)
    running: list[tuple[float, Ticket]] = []  # (finish time, ticket)
    waiting: list[Waiter] = []
    now = 0.0
    for step in range(1500):
        now += rng.expovariate(60.0)  # far more than 1 A100 + 2 L4 serve
        for fin, t in sorted(running, key=lambda x: x[0]):
            if fin <= now:
                running.remove((fin, t))
                b.on_first_token(t, max(t.t_dispatch, fin - 1.0))
                b.on_finish(t, fin, Outcome.OK, rng.randint(20, 120))
        got = b.admit(MODEL, rng.randint(100, 2000), now, priority=rng.choice([0, 1, 1, 2]))
        if isinstance(got, Ticket):
            running.append((now + rng.uniform(1.0, 6.0), got))
        elif isinstance(got, Waiter):
            waiting.append(got)
        if step % 5 == 0:
            for w, d in b.poll_queue(now):
                if w in waiting:
                    waiting.remove(w)
                if isinstance(d, Ticket):
                    running.append((now + rng.uniform(1.0, 6.0), d))
        if waiting and rng.random() < 0.05:
            w = waiting.pop(rng.randrange(len(waiting)))
            b.cancel_queued(w)  # its client went away
        if step % 50 == 0:
            b.tick(now)
    return [json.loads(json.dumps(r)) for r in log]


def test_replay_reproduces_admission_decisions() -> None:
    log = drive_admission(seed=3)
    ops = {r["op"] for r in log}
    assert {"admit", "poll_queue", "cancel_queued"} <= ops and "pick" not in ops
    results = [r["result"] for r in log if r["op"] == "admit"]
    assert any("ticket" in r for r in results)
    assert any("queued" in r for r in results)
    assert any("shed" in r for r in results)
    assert any(d for r in log if r["op"] == "poll_queue" for d in r["decisions"])
    res = replay(log)
    assert res.differences == [], res.differences[:3]
    # A recorded 429 that the replay would not give is reported.
    i = next(i for i, r in enumerate(log) if r["op"] == "admit" and "shed" in r["result"])
    log[i] = {**log[i], "result": {"shed": "made_up"}}
    assert any(d["op"] == "admit" and d["record"] == i for d in replay(log).differences)


def test_replay_reproduces_an_endpoint_pickers_rank_and_take() -> None:
    """The picker's fallback lists (rank) and the fallbacks Envoy used (take) replay too."""
    for policy in ("tailguard", "p2c", "round_robin"):
        log: list[dict[str, Any]] = []
        specs = [NodeSpec(f"n{i}", DEFAULT_CATALOG.gpu(g), DEFAULT_CATALOG.gpu(g).name,
                          models=(MODEL,)) for i, g in enumerate(["H100", "A100", "L4"])]
        b = Balancer(specs, [PoolConfig(MODEL, policy, None, Slo(1.5, 0.08))],
                     random.Random(3), recorder=log.append)
        rng = random.Random(4)
        now = 0.0
        for _ in range(200):
            now += rng.expovariate(10.0)
            t = b.pick(MODEL, rng.randint(10, 2000), now)
            assert t is not None
            ranked = b.rank(MODEL, 500, now, exclude=(t.node_id,), n=2)
            if rng.random() < 0.3:  # the data plane fell back to the first of the list
                b.on_finish(t, now, Outcome.CONNECT_FAILURE, 0)
                t = b.take(MODEL, ranked[0], 500, now)
                assert t is not None
            b.on_first_token(t, now + 0.05)
            b.on_finish(t, now + 0.5, Outcome.OK, rng.randint(1, 100))
        res = replay([json.loads(json.dumps(r)) for r in log])
        assert res.differences == [], (policy, res.differences[:3])
        assert sum(1 for r in log if r.get("op") == "take") > 20
