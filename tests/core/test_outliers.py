"""Outlier detection and the quarantine lifecycle, on literal samples and a manual clock."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

import pytest

from tailguard.core.balancer import Balancer, PoolConfig
from tailguard.core.fleet import Actor, Node, NodeSpec, NodeState, Outcome
from tailguard.core.hardware import DEFAULT_CATALOG, PerfModel
from tailguard.core.outliers import OutlierConfig, OutlierDetector

MODEL = "llama-3.1-8b"
CFG = OutlierConfig(jitter=0.0)


class FakePool:
    def __init__(self, nodes: list[Node]) -> None:
        self.nodes = nodes
        self.invalidated = 0

    def invalidate(self) -> None:
        self.invalidated += 1


def make_nodes(gpus: list[str]) -> dict[str, Node]:
    out: dict[str, Node] = {}
    counts: dict[str, int] = {}
    for g in gpus:
        gpu = DEFAULT_CATALOG.gpu(g)
        i = counts.get(gpu.name, 0)
        counts[gpu.name] = i + 1
        spec = NodeSpec(f"{gpu.name}#{i}", gpu, gpu.name, models=(MODEL,))
        out[spec.id] = Node(spec, PerfModel(gpu, DEFAULT_CATALOG.model(MODEL)))
    return out


class Rig:
    """A detector, its nodes and a manual clock ticking once a second."""

    def __init__(self, gpus: list[str], cfg: OutlierConfig = CFG) -> None:
        self.nodes = make_nodes(gpus)
        self.pool = FakePool(list(self.nodes.values()))
        self.det = OutlierDetector(cfg)
        self.rng = random.Random(0)
        self.now = 0.0
        self.events: list[tuple[float, str, str]] = []
        self.tick()  # starts the first interval at t = 0

    def tick(self) -> None:
        for e in self.det.tick(self.now, self.nodes, [self.pool], self.rng):
            self.events.append((e.t, e.node, e.state))

    def run(self, seconds: int, ratios: dict[str, float], per_s: int = 2) -> None:
        """Each node reports ``per_s`` decode and prefill samples a second at its ratio."""
        for _ in range(seconds):
            self.now += 1.0
            for nid, node in self.nodes.items():
                if not node.state.routable:
                    continue
                r = ratios.get(nid, 1.0)
                for _ in range(per_s):
                    self.det.on_prefill(node, 0.2 * r, 0.2, self.now)
                    self.det.on_decode(node, 0.02 * r, 0.02)
                    self.det.on_outcome(node, Outcome.OK, self.now)
            self.tick()

    def state(self, nid: str) -> NodeState:
        return self.nodes[nid].state


def test_worked_example_of_the_docstring() -> None:
    rig = Rig(["A100"] * 4)
    noise = random.Random(1)
    for _ in range(30):  # healthy: decode noise sigma 0.15 around the class level
        rig.now += 1.0
        for node in rig.nodes.values():
            rig.det.on_decode(node, 0.02 * math.exp(noise.gauss(0.0, 0.15)), 0.02)
        rig.tick()
    assert rig.events == []
    slow, peer = rig.nodes["A100-80GB#3"], rig.nodes["A100-80GB#1"]
    for _ in range(3):  # throttled to 40%: 2.5x
        rig.det.on_decode(slow, 0.02 * 2.5, 0.02)
        rig.det.on_decode(peer, 0.02 * 1.1, 0.02)  # 10% slower than the median
    v = rig.det.verdicts(rig.nodes)
    assert v["A100-80GB#3"].flagged
    # the recent slowness moves half of the way per sample: 2.5 ** (1 - 0.5 ** 3) = 2.23x
    assert v["A100-80GB#3"].slowness == pytest.approx(2.23, rel=0.1)
    assert "class peers" in v["A100-80GB#3"].why
    assert rig.det.health["A100-80GB#3"].decode.cusum >= CFG.evidence  # three samples suffice
    assert not v["A100-80GB#1"].flagged and rig.det.health["A100-80GB#1"].decode.cusum < 1.0


def test_evidence_accumulates_across_intervals_at_low_rates() -> None:
    """One sample per node every other second: no interval has three, the CUSUM still decides."""
    rig = Rig(["A100"] * 3)
    for second in range(60):
        rig.now += 1.0
        for nid, node in rig.nodes.items():
            if second % 2 == 0:
                r = 3.0 if nid == "A100-80GB#2" and second >= 30 else 1.0
                rig.det.on_decode(node, 0.02 * r, 0.02)
                rig.det.on_outcome(node, Outcome.OK, rig.now)
        rig.tick()
    assert [(n, s) for _, n, s in rig.events] == [("A100-80GB#2", "degraded")]
    assert rig.events[0][0] <= 30 + 20


def test_decode_judged_at_its_batch() -> None:
    """On a CPU a step of batch 2 takes twice one of batch 1: a node that runs at batch 2
    more often is not slow for it (it was read 2.6x slow against its class median)."""
    rig = Rig(["A100"] * 3)
    busy = rig.nodes["A100-80GB#0"]
    for _ in range(60):
        rig.now += 1.0
        for node in rig.nodes.values():
            batches = (2, 2, 2) if node is busy else (1, 1, 2)
            for batch in batches:  # the roofline expects the same step at both
                rig.det.on_decode(node, 0.02 * batch, 0.02, batch)
        rig.tick()
    assert rig.events == []


def test_slow_from_its_first_request_in_a_class_of_two() -> None:
    rig = Rig(["H100", "H100", "L4", "L4"])
    rig.run(20, {"H100-SXM#0": 2.5})
    assert rig.state("H100-SXM#0") is NodeState.DEGRADED
    assert rig.state("H100-SXM#1") is NodeState.HEALTHY
    assert [n for _, n, _ in rig.events] == ["H100-SXM#0"]


def test_throttled_node_degraded_then_quarantined_peers_untouched() -> None:
    rig = Rig(["A100"] * 4)
    spread = {"A100-80GB#0": 0.9, "A100-80GB#1": 1.1, "A100-80GB#2": 1.0, "A100-80GB#3": 1.05}
    rig.run(60, spread)
    assert rig.events == []  # +-10% card-to-card spread never triggers
    rig.run(10, {**spread, "A100-80GB#2": 2.5})  # two flagged intervals
    assert rig.state("A100-80GB#2") is NodeState.DEGRADED
    assert rig.nodes["A100-80GB#2"].weight_scale == pytest.approx(1 / 2.5 * 1.0, rel=0.1)
    rig.run(30, {**spread, "A100-80GB#2": 2.5})  # 2.5x < quarantine_ratio: stays degraded
    assert rig.state("A100-80GB#2") is NodeState.DEGRADED
    rig.run(14, spread)  # throttle over: three clean intervals
    assert rig.state("A100-80GB#2") is NodeState.DEGRADED
    rig.run(1, spread)
    assert rig.state("A100-80GB#2") is NodeState.HEALTHY
    assert rig.nodes["A100-80GB#2"].weight_scale == 1.0
    assert [s for _, n, s in rig.events if n != "A100-80GB#2"] == []
    assert rig.det.detected_ejections == 0


def test_very_slow_node_quarantined_after_degraded() -> None:
    rig = Rig(["A100"] * 4)
    rig.run(15, {"A100-80GB#2": 4.0})
    assert [s for _, _, s in rig.events] == ["degraded", "quarantined"]
    assert rig.det.detected_ejections == rig.det.enforced_ejections == 1


def test_stalls_do_not_lower_what_the_samples_agree_on() -> None:
    """A node 4x slow that also stalls now and then (silent 1.5 s in each 5) is
    still quarantined: its stalls (4.5 s silent in 30) read 1.18x, which must not
    become the floor that quarantine waits for."""
    rig = Rig(["A100"] * 4)
    slow = rig.nodes["A100-80GB#2"]
    for i in range(3):  # its stalls, as the router saw them end
        t = 0.5 + 5.0 * i
        owed = Waiting(due=t, t_dispatch=t - 0.1)
        slow.awaits(owed)
        owed.t_first = t + 1.5
        slow.progressed(t + 1.5)
    assert slow.stalls == 3
    rig.run(15, {"A100-80GB#2": 4.0})
    assert [s for _, _, s in rig.events] == ["degraded", "quarantined"]


def test_backoff_probation_ramp_and_recovery() -> None:
    rig = Rig(["A100"] * 4)
    rig.run(15, {"A100-80GB#1": 4.0})
    assert rig.state("A100-80GB#1") is NodeState.QUARANTINED
    t_q = rig.events[-1][0]
    rig.run(int(30 - (rig.now - t_q)) - 1, {})
    assert rig.state("A100-80GB#1") is NodeState.QUARANTINED  # base backoff 30 s
    rig.run(1, {})
    assert rig.state("A100-80GB#1") is NodeState.PROBATION
    assert rig.nodes["A100-80GB#1"].weight_scale == pytest.approx(0.1)
    rig.run(15, {})  # half the slow start: weight half way to 1
    assert rig.nodes["A100-80GB#1"].weight_scale == pytest.approx(0.55, abs=0.04)
    rig.run(15, {})
    assert rig.state("A100-80GB#1") is NodeState.HEALTHY
    assert rig.nodes["A100-80GB#1"].weight_scale == 1.0


def test_slow_on_probation_goes_back_with_doubled_backoff() -> None:
    rig = Rig(["A100"] * 4)
    rig.run(15, {"A100-80GB#1": 4.0})
    rig.run(31, {})
    assert rig.state("A100-80GB#1") is NodeState.PROBATION
    rig.run(5, {"A100-80GB#1": 4.0})
    assert rig.state("A100-80GB#1") is NodeState.QUARANTINED
    t_q = rig.events[-1][0]
    rig.run(int(t_q + 59 - rig.now), {})
    assert rig.state("A100-80GB#1") is NodeState.QUARANTINED  # 30 * 2^1 = 60 s now
    rig.run(int(t_q + 61 - rig.now), {})
    assert rig.state("A100-80GB#1") is NodeState.PROBATION


def test_jitter_comes_from_the_injected_rng() -> None:
    cfg = OutlierConfig(jitter=0.1)
    ends = []
    for seed in (1, 2):
        rig = Rig(["A100"] * 4, cfg)
        rig.rng = random.Random(seed)
        rig.run(15, {"A100-80GB#1": 4.0})
        ends.append(rig.det.health["A100-80GB#1"].eject_until - rig.events[-1][0])
    assert all(27.0 <= e <= 33.0 for e in ends) and ends[0] != ends[1]


def test_consecutive_failures_quarantine_at_the_next_tick() -> None:
    rig = Rig(["L4"] * 3)
    node = rig.nodes["L4#0"]
    for _ in range(4):
        rig.det.on_outcome(node, Outcome.UPSTREAM_5XX, 0.5)
    rig.det.on_outcome(node, Outcome.UPSTREAM_429, 0.5)  # overload says nothing about health
    rig.det.on_outcome(node, Outcome.CLIENT_ERROR, 0.5)
    rig.now = 1.0
    rig.tick()
    assert node.state is NodeState.HEALTHY
    rig.det.on_outcome(node, Outcome.CONNECT_FAILURE, 1.5)
    rig.now = 2.0
    rig.tick()
    assert node.state is NodeState.QUARANTINED


def test_failure_ratio_over_an_interval() -> None:
    rig = Rig(["L4"] * 3)
    node = rig.nodes["L4#2"]
    for i in range(12):  # one in three fails: never 5 in a row
        rig.det.on_outcome(node, Outcome.TIMEOUT if i % 3 == 0 else Outcome.OK, 1.0)
    rig.now = 5.0
    rig.tick()
    assert node.state is NodeState.HEALTHY  # 12 requests: too few to judge
    for i in range(12):
        rig.det.on_outcome(node, Outcome.TIMEOUT if i % 3 == 0 else Outcome.OK, 6.0)
    rig.now = 10.0
    rig.tick()  # 8 of 24 over the window
    assert node.state is NodeState.QUARANTINED


def test_hang_requests_waiting_without_progress() -> None:
    rig = Rig(["L4"] * 3, replace(CFG, hang_s=10.0))
    node = rig.nodes["L4#1"]
    node.in_flight = node.prefilling = 2
    for _ in range(10):
        rig.now += 1.0
        rig.tick()
    assert node.state is NodeState.HEALTHY
    rig.now += 2.0
    rig.tick()
    assert node.state is NodeState.QUARANTINED


def test_max_ejection_share_degrades_instead() -> None:
    rig = Rig(["A100"] * 3)  # one node is 33% of the pool's capacity
    for nid in ("A100-80GB#0", "A100-80GB#1"):
        for _ in range(5):
            rig.det.on_outcome(rig.nodes[nid], Outcome.UPSTREAM_5XX, 0.5)
    rig.now = 1.0
    rig.tick()
    states = sorted(n.state.value for n in rig.nodes.values())
    assert states == ["degraded", "healthy", "quarantined"]
    assert rig.det.detected_ejections == 2 and rig.det.enforced_ejections == 1


def test_a_class_of_one_uses_its_own_history() -> None:
    rig = Rig(["H100", "L4", "L4"])
    rig.run(30, {"H100-SXM#0": 1.3})  # its normal: 1.3x the roofline
    assert rig.events == []
    rig.run(10, {"H100-SXM#0": 1.3 * 2.0})
    assert rig.state("H100-SXM#0") is NodeState.DEGRADED
    assert "own history" in rig.det.health["H100-SXM#0"].reason
    assert rig.state("L4#0") is NodeState.HEALTHY


def test_a_class_of_one_prices_its_prompt_chunks_at_its_clean_prefill_speed() -> None:
    # Its class's prefill speed is its own: learnt from a throttle, it would price
    # the chunks in its decode pieces at the throttled speed, and half of every
    # piece's slowdown would read as expected. It may rise only 1.1x an interval.
    rig = Rig(["H100", "L4", "L4"])
    lone, l4s = rig.nodes["H100-SXM#0"], [rig.nodes["L4#0"], rig.nodes["L4#1"]]
    lone.set_class_speed(1.0, 1.3, 1.0)
    rig.run(10, {})  # two clean intervals
    assert rig.det.judged_prefill_slowdown(lone) == pytest.approx(1.3)
    lone.set_class_speed(1.0, 2.6, 1.0)  # it learns a throttle's prefill speed
    assert rig.det.judged_prefill_slowdown(lone) == pytest.approx(1.3)
    rig.run(5, {})
    assert rig.det.judged_prefill_slowdown(lone) == pytest.approx(1.3 * 1.1)
    lone.set_class_speed(1.0, 1.2, 1.0)  # faster: followed at once
    assert rig.det.judged_prefill_slowdown(lone) == pytest.approx(1.2)
    for n in l4s:  # a node with class peers is priced at its class's speed
        n.set_class_speed(1.0, 2.6, 1.0)
        assert rig.det.judged_prefill_slowdown(n) == pytest.approx(2.6)


def test_a_slowdown_caught_at_an_interval_close_does_not_become_the_history() -> None:
    # The first seconds of a slowdown may close an interval before the CUSUM has
    # moved: the own history they write rises 1.1x at most, so what follows is
    # still judged against the node's healthy level.
    rig = Rig(["H100", "L4", "L4"])
    rig.run(30, {"H100-SXM#0": 1.3})
    ev = rig.det.health["H100-SXM#0"].decode
    (b, before), = ev.history.items()
    assert before == pytest.approx(math.log(1.3), abs=0.02)
    ev.learn(b, math.log(2.6), 0, 16.0, 0)  # a level already at the slowdown...
    ev.close(1.0, clean=True)  # ...at a clean close
    assert ev.history[b] == pytest.approx(before + math.log(1.1))


def test_operator_states_are_left_alone_and_uncordon_resets() -> None:
    rig = Rig(["A100"] * 4)
    node = rig.nodes["A100-80GB#0"]
    node.state = NodeState.CORDONED
    for _ in range(10):
        rig.det.on_outcome(node, Outcome.UPSTREAM_5XX, 0.5)
    rig.now = 1.0
    rig.tick()
    assert node.state is NodeState.CORDONED
    node.state = NodeState.HEALTHY
    rig.det.health[node.id].consecutive_failures = 0
    rig.now = 2.0
    rig.tick()
    assert node.state is NodeState.HEALTHY
    times = rig.det.time_in_states(2.0)[node.id]
    assert times == {"healthy": 1.0, "cordoned": 1.0}


def test_balancer_tick_returns_detection_events() -> None:
    specs = [NodeSpec(f"n{i}", DEFAULT_CATALOG.gpu("A100"), "A100-80GB", models=(MODEL,))
             for i in range(4)]
    b = Balancer(specs, [PoolConfig(MODEL, "round_robin")], random.Random(0))
    events = []
    now = 0.0
    for step in range(400):
        now = step * 0.1
        t = b.pick(MODEL, 500, now)
        assert t is not None
        node = t.node
        # n3 answers every request four times slower than its peers.
        slow = 4.0 if node.id == "n3" else 1.0
        b.on_first_token(t, now + 0.05 * slow)
        b.on_finish(t, now + 0.05 * slow + 50 * 0.01 * slow, Outcome.OK, 51)
        if step % 10 == 0:
            events += b.tick(now)
    assert [(e.node, e.state) for e in events][:2] == [("n3", "degraded"), ("n3", "quarantined")]
    assert b.nodes["n3"] not in b.pools[MODEL].eligible()


def test_detection_off() -> None:
    specs = [NodeSpec("n0", DEFAULT_CATALOG.gpu("A100"), "A100-80GB", models=(MODEL,))]
    b = Balancer(specs, [PoolConfig(MODEL)], random.Random(0),
                 outliers=OutlierConfig(enabled=False))
    assert b.outliers is None
    t = b.pick(MODEL, 10, 0.0)
    assert t is not None
    b.on_finish(t, 0.1, Outcome.UPSTREAM_5XX, 0)
    assert b.tick(1.0) == []


def test_class_speed_is_its_healthy_nodes() -> None:
    specs = [NodeSpec(f"n{i}", DEFAULT_CATALOG.gpu("A100"), "A100-80GB", models=(MODEL,))
             for i in range(3)]
    b = Balancer(specs, [PoolConfig(MODEL)], random.Random(0))
    for n, ratio in zip(b.nodes.values(), (1.0, 1.0, 8.0), strict=True):
        n.capacity.decode.log_ratio = math.log(ratio)
    b.tick(0.0)
    assert b.nodes["n0"].class_decode_slowdown == pytest.approx(2.0)  # 8 ** (1/3)
    b.set_state("n2", NodeState.DEGRADED, Actor.LEADER)
    b.tick(1.0)
    # The degraded straggler is priced by its weight, not through its peers.
    assert b.nodes["n0"].class_decode_slowdown == pytest.approx(1.0)
    assert b.nodes["n2"].class_decode_slowdown == pytest.approx(1.0)


def test_probation_gets_its_canary_share() -> None:
    specs = [NodeSpec(f"n{i}", DEFAULT_CATALOG.gpu("A100"), "A100-80GB", models=(MODEL,))
             for i in range(4)]
    b = Balancer(specs, [PoolConfig(MODEL)], random.Random(0))
    b.tick(0.0)
    b.set_state("n3", NodeState.PROBATION, Actor.LEADER)
    b.tick(1.0)  # the detector notices; the weight starts at the canary weight
    assert b.nodes["n3"].weight_scale == pytest.approx(0.1, abs=0.01)
    hits = 0
    for i in range(2000):
        t = b.pick(MODEL, 100, 1.0 + i * 1e-4)
        assert t is not None
        hits += t.node_id == "n3"
        b.on_finish(t, 1.0 + i * 1e-4, Outcome.CLIENT_CANCELLED, 0)
    # The tailguard policy alone would never pick a node at a tenth of the weight.
    assert 20 <= hits <= 70


def test_what_every_node_meets_at_once_is_not_one_nodes_slowness() -> None:
    """Per-token times that rise and fall on every node together (a burst of load, a
    shared host's contention: an emulated fleet's moved 1.3x within a second) are
    judged against the peers' levels of the same moment. A reference kept for the
    whole interval flagged one of two healthy peers 1.56x slow within 4 s."""
    rig = Rig(["A100"] * 2)
    noise = random.Random(3)
    for second in range(120):
        drift = 1.3 * math.sin(second / 3.0)  # common to both, period ~19 s
        for _ in range(20):  # interleaved, as their streams' pieces arrive
            for node in rig.nodes.values():
                x = math.exp(0.5 * drift + noise.gauss(0.0, 0.1))
                rig.det.on_decode(node, 0.02 * x, 0.02, 32, rig.now, rig.now - 1.0)
            rig.now += 0.05
        rig.tick()
    assert rig.events == []
    # ...while a node 2.5x slow beside the same drift is caught.
    slow = rig.nodes["A100-80GB#1"]
    for second in range(10):
        drift = 1.3 * math.sin((120 + second) / 3.0)
        for _ in range(20):
            for node in rig.nodes.values():
                x = math.exp(0.5 * drift + noise.gauss(0.0, 0.1)) * (2.5 if node is slow else 1.0)
                rig.det.on_decode(node, 0.02 * x, 0.02, 32, rig.now, rig.now - 1.0)
            rig.now += 0.05
        rig.tick()
    assert [(n, s) for _, n, s in rig.events] == [("A100-80GB#1", "degraded")]


def test_a_windows_samples_are_one_sample() -> None:
    """Where decode is judged in pieces, the dozens of samples a busy node gives in one
    second timed the same moments of it: they count as one. A healthy node 1.2x its
    peers' level (a batch bucket they run faster), its 40 streams a second sharing
    each second's ups and downs, is left alone; counted one by one (the whole-answer
    way, ``segment_s`` 0) the same samples degrade it. A node 2x slow is still caught
    within 3 s."""
    def run(bias: float, seconds: int, cfg: OutlierConfig = CFG) -> list[tuple[float, str, str]]:
        rig = Rig(["A100"] * 3, cfg)
        noise = random.Random(5)
        odd = rig.nodes["A100-80GB#2"]
        for second in range(seconds):
            moment = {n: math.exp(noise.gauss(0.0, 0.1)) for n in rig.nodes}  # per node
            for _ in range(40):
                for nid, node in rig.nodes.items():
                    r = bias if node is odd and second >= 60 else 1.0
                    x = r * moment[nid] * math.exp(noise.gauss(0.0, 0.03))
                    rig.det.on_decode(node, 0.02 * x, 0.02, 64, rig.now, rig.now - 0.5)
                rig.now += 0.025
            rig.tick()
        return rig.events

    assert run(1.2, 180) == []
    assert ("A100-80GB#2", "degraded") in [(n, s) for _, n, s in
                                           run(1.2, 180, replace(CFG, segment_s=0.0))]
    caught = run(2.0, 70)  # its first slow window closes at 61 s
    assert [(n, s) for _, n, s in caught] == [("A100-80GB#2", "degraded")]
    assert caught[0][0] <= 60 + 3


def test_a_fast_own_history_does_not_stand_against_slower_recent_peers() -> None:
    """A node whose peers ran its batch lately but not this second is judged against
    its own history only where that is not faster than they were: a history keeps
    the node's fastest moments (a shared host's quiet ones), and a healthy llama.cpp
    engine read 2.35x its own history at the CPU share its busy peer had. A class
    of one, with no peers, is still judged against its own history."""
    def run(gpus: list[str], peer_ratio: float | None) -> list[tuple[str, str]]:
        rig = Rig(gpus)
        lone = next(iter(rig.nodes.values()))
        peers = [n for n in rig.nodes.values() if n.spec.gpu_class == lone.spec.gpu_class
                 and n is not lone]

        def second(ratio: float, batch: int, peer_batch: int, peer_r: float) -> None:
            for _ in range(10):
                rig.det.on_decode(lone, 0.02 * ratio, 0.02, batch, rig.now, rig.now - 0.5)
                for p in peers:
                    rig.det.on_decode(p, 0.02 * peer_r, 0.02, peer_batch, rig.now,
                                      rig.now - 0.5)
                rig.now += 0.1
            rig.tick()

        for _ in range(20):  # a quiet host: the node's history at batch 8 is the roofline
            second(1.0, 8, 1, 1.0)
        if peer_ratio is not None:
            for _ in range(2):  # the peers run batch 8 at the busy host's pace...
                second(1.0, 1, 8, peer_ratio)
        for _ in range(6):  # ...and the node does, seconds later, while they run batch 1
            second(2.5, 8, 1, 1.0)
        return [(n, s) for _, n, s in rig.events]

    assert run(["A100"] * 3, 2.5) == []
    assert run(["A100"] * 3, None) == [("A100-80GB#0", "degraded")]  # no recent peer level
    assert run(["A100"] * 3, 1.0) == [("A100-80GB#0", "degraded")]  # peers were fast
    assert run(["H100", "L4"], None) == [("H100-SXM#0", "degraded")]  # a class of one


@dataclass
class Waiting:
    """A prompt a node owes its first token (what Node.overdue_s reads)."""

    due: float
    t_dispatch: float
    t_first: float = -1.0
    released: bool = False
    presumed: bool = False
    allowance: float = -1.0  # due less dispatch, unless given

    def __post_init__(self) -> None:
        if self.allowance < 0.0:
            self.allowance = self.due - self.t_dispatch


def test_a_stall_is_a_silence_past_a_due_prompt() -> None:
    """Node.spans_stall: a silence of STALL_S or more past a due prompt is a stall,
    while it lasts and once an answer ends it; work timed across it times the
    stall. A shorter silence is a slow answer, the learner's to price, and so is
    one shorter than twice the prompt's allowance (due less dispatch): a node 3x
    slow is late by 1.5 allowances."""
    node = make_nodes(["A100"])["A100-80GB#0"]
    late = Waiting(due=1.0, t_dispatch=0.9)
    node.awaits(late)
    assert not node.spans_stall(0.5, 1.5)  # 0.5 s past due: not (yet) a stall
    assert node.spans_stall(0.5, 2.5)  # 1.5 s: a stall under way
    late.t_first = 3.0
    node.progressed(3.0)
    assert (node.stall_from, node.stall_to, node.stalls, node.stalled_s) == (1.0, 3.0, 1, 2.0)
    assert node.spans_stall(0.5, 3.5)  # began before it, ended after
    assert node.spans_stall(2.0, 3.2)  # begun inside it (a piece read on a clock)
    assert not node.spans_stall(3.0, 4.0)  # after it
    brief = Waiting(due=5.0, t_dispatch=4.9)
    node.awaits(brief)
    brief.t_first = 5.5
    node.progressed(5.5)  # 0.5 s late: slow, not stalled
    assert (node.stalls, node.stall_to) == (1, 3.0)
    # A prompt allowed 1 s (expected at 0.5 s): 1.5 s past its due at 3x slow is
    # slow; 2.5 s past it (6.5x), stalled.
    slow = Waiting(due=11.0, t_dispatch=10.0)
    node.awaits(slow)
    assert not node.spans_stall(10.5, 12.5)
    slow.t_first = 12.5
    node.progressed(12.5)
    assert node.stalls == 1
    stuck = Waiting(due=21.0, t_dispatch=20.0)
    node.awaits(stuck)
    assert node.spans_stall(20.5, 23.5)
    stuck.t_first = 23.5
    node.progressed(23.5)
    assert (node.stalls, node.stall_from, node.stall_to) == (2, 21.0, 23.5)


def test_a_stall_whose_prompts_were_hedged_away_is_still_a_stall() -> None:
    """A hedge's loser, cancelled past its due while the node's streams are
    frozen, leaves a debt: the answer that ends the silence records the stall
    (with hedging on, stalls case 3 of benchmarks/stragglers.py had the stalling
    A100 degraded 6 times for 'slow decode', its pieces across the pauses). A
    node idle meanwhile owed nothing: no stall from an idle gap."""
    node = make_nodes(["A100"])["A100-80GB#0"]

    def cancelled(due: float, allowance: float, at: float) -> None:
        w = Waiting(due=due, t_dispatch=due - allowance)
        node.awaits(w)
        w.released = True
        node.left_unanswered(w.due, at, allowance)

    def answered(due: float, at: float) -> None:
        w = Waiting(due=due, t_dispatch=due - 0.2)
        node.awaits(w)
        w.t_first = at
        node.progressed(at)

    node.decoding = 2  # streams in flight, frozen by the pause
    cancelled(1.0, 0.1, at=1.3)  # the hedge won
    node.progressed(3.0)  # a stream finishes: the pause is over
    assert (node.stall_from, node.stall_to, node.stalls) == (1.0, 3.0, 1)
    assert node.spans_stall(0.5, 3.5)
    cancelled(11.0, 1.0, at=11.2)  # the allowance rule holds for a debt too:
    node.progressed(12.5)  # 1.5 allowances late is slow
    assert node.stalls == 1
    node.decoding = 0  # cancelled with nothing else in flight, then idle
    cancelled(21.0, 0.1, at=21.5)
    answered(30.2, at=30.1)
    assert node.stalls == 1
    node.decoding = 1  # in flight when cancelled, idle before the next request
    cancelled(41.0, 0.1, at=41.5)
    node.decoding = 0  # the stream ended (a failure: no progress)
    answered(50.2, at=50.1)
    assert node.stalls == 1


def test_a_pause_that_freezes_only_streams_is_a_stall() -> None:
    """Node.stream_silent: a pause that catches no prompt waiting shows only as the
    gap its streams resume from; at STALL_S or more (and the caller's limit, the
    engine's longest healthy step four times) it is a stall, told once however
    many of the node's streams tell it, and merged with the one its prompts tell.
    A gap in which the node answered anything, or after which a prompt still
    waits (one computed whole holds every stream), or while it was short of KV
    cache or recomputing what it preempted then, is no stall."""
    node = make_nodes(["A100"])["A100-80GB#0"]
    node.decoding = 4
    node.stream_silent(10.0, 10.8, 0.2)  # under STALL_S: a slow step
    node.stream_silent(10.0, 11.5, 2.0)  # under the engine's longest step, four times
    assert node.stalls == 0
    node.stream_silent(20.0, 22.0, 0.5)
    assert (node.stall_from, node.stall_to, node.stalls, node.stalled_s) == (20.0, 22.0, 1, 2.0)
    assert node.spans_stall(19.5, 22.5)  # the decode timed across it is left out
    node.stream_silent(20.02, 22.01, 0.5)  # the same pause, by another stream
    node.stream_silent(19.99, 22.1, 0.5)
    assert (node.stalls, node.stall_to) == (1, 22.1)
    assert abs(node.stalled_s - 2.1) < 1e-9
    # A pause that a prompt waited through too: its first token tells the same stall.
    late = Waiting(due=30.1, t_dispatch=30.05)
    node.awaits(late)
    node.prefilling = 1
    node.stream_silent(30.0, 32.0, 0.5)
    assert node.stalls == 1  # the prompt still waits: it may be what held the engine
    late.t_first = 32.05
    node.prefilling = 0
    node.progressed(32.05)
    assert (node.stalls, node.stall_from, node.stall_to) == (2, 30.1, 32.05)
    node.stream_silent(30.0, 32.1, 0.5)  # the node answered in the gap: told already
    assert node.stalls == 2
    node.kv_short(40.5)
    node.stream_silent(40.0, 42.0, 0.5)  # queued for KV room: the load's doing
    assert node.stalls == 2
    # A preemption at 50 whose recompute (the node's context at its prefill speed)
    # outlasts the gap that begins after it: the recompute's, not a stall.
    node.kv_short(50.0, 8.0)
    node.stream_silent(52.0, 54.0, 0.5)
    late = Waiting(due=53.0, t_dispatch=52.5)
    node.awaits(late)
    late.t_first = 55.0
    node.progressed(55.0)
    assert node.stalls == 2
    node.stream_silent(60.0, 62.0, 0.5)  # after the recovery: a stall again
    assert node.stalls == 3


def test_a_prompt_waiting_for_an_engine_slot_is_due_once_one_frees() -> None:
    """All of a node's engine slots taken: the next prompt waits for a running
    answer to end, which the roofline does not price, so its first token is due
    only from then (a llama.cpp server with two slots at a third of its speed had
    each queued prompt taken for a stall, and its decode evidence left out)."""
    spec = NodeSpec("n0", DEFAULT_CATALOG.gpu("L4"), "L4", models=(MODEL,), max_num_seqs=2)
    b = Balancer([spec], [PoolConfig(MODEL, "round_robin")], random.Random(0))
    node = b.nodes["n0"]
    running = [b.pick(MODEL, 200, 0.0) for _ in range(2)]
    queued = b.pick(MODEL, 200, 0.0)
    assert all(t is not None for t in running) and queued is not None
    assert all(t.due < math.inf for t in running if t is not None)
    assert queued.due == math.inf and queued.allowance > 0.0
    for t in running:
        assert t is not None
        b.on_first_token(t, 0.1)
    # The running answers take 3 s: the queued prompt is not overdue meanwhile
    assert node.overdue_s(2.9) == 0.0 and not node.spans_stall(0.5, 2.9)
    first = running[0]
    assert first is not None
    b.on_finish(first, 3.0, Outcome.OK, 60)  # a slot frees: its wait for a first token begins
    assert queued.due == 3.0 + queued.allowance
    assert node.overdue_s(3.0 + queued.allowance + 0.5) == pytest.approx(0.5)
    # ...and a silence past that due is a stall as before
    assert node.spans_stall(3.0, 3.0 + queued.allowance + 2.0 * queued.allowance + 1.5)
    # One that found a slot no answer of ours freed (another replica's, or an engine
    # with more slots than its fleet entry says) frees one all the same at its end.
    second, third = b.pick(MODEL, 200, 3.1), b.pick(MODEL, 200, 3.1)
    assert second is not None and third is not None
    assert second.due == math.inf and third.due == math.inf
    b.on_first_token(second, 3.2)
    b.on_finish(second, 4.0, Outcome.OK, 20)
    assert third.due == 4.0 + third.allowance


def test_stalls_are_not_slowness_but_many_are_flagged() -> None:
    """A node as fast as its peers that stalls 2 s in every 10 (the router dodges
    each stall as it happens) gives no evidence of slowness: the decode pieces
    timed across its stalls, which read 3x slow, are left out (from a node
    whose silences were never past a due prompt, the same pieces are evidence).
    One silent 6 s in every 10 is degraded for its stalls, weighted at the
    share of time it works."""
    def run(pause: int, stalls: bool) -> tuple[Rig, Node, float]:
        rig = Rig(["A100"] * 3)
        odd = rig.nodes["A100-80GB#2"]
        owed = Waiting(math.inf, 0.0)
        most = 0.0  # the most decode evidence against it
        for second in range(120):
            phase = second % 10
            for node in rig.nodes.values():
                if node is odd and second >= 20 and phase <= pause:
                    if phase == 0 and stalls:
                        owed = Waiting(due=rig.now + 0.1, t_dispatch=rig.now)
                        node.awaits(owed)
                    if phase < pause:
                        continue  # silent
                    if stalls:  # the answer that ends it
                        owed.t_first = rig.now
                        node.progressed(rig.now)
                    for _ in range(4):  # the pieces across the stall
                        rig.det.on_decode(node, 0.02 * (1 + pause), 0.02, 64, rig.now,
                                          rig.now - pause - 1.0)
                    continue
                for _ in range(10):
                    rig.det.on_decode(node, 0.02, 0.02, 64, rig.now, rig.now - 0.5)
            rig.now += 1.0
            rig.tick()
            most = max(most, rig.det.health[odd.id].decode.cusum)
        return rig, odd, most

    rig, odd, most = run(2, stalls=True)
    assert rig.events == [] and most == 0.0
    assert rig.det.stall_samples == 4 * 10
    assert odd.stalls == 10
    rig, odd, most = run(2, stalls=False)
    assert most >= 3.0 and rig.det.stall_samples == 0
    rig, odd, _ = run(6, stalls=True)
    assert [(n, s) for _, n, s in rig.events] == [("A100-80GB#2", "degraded")]
    assert rig.det.health[odd.id].reason.startswith("slow: stalls")
    # Silent 5.9 s of each 10 (from its prompt's due): about 2.4x.
    assert odd.weight_scale == pytest.approx(1.0 - 3 * 5.9 / 30.0, abs=0.05)


def test_a_node_short_of_kv_cache_is_loaded_not_slow() -> None:
    """Samples timed while the node's engine was short of KV cache (it queued prompts
    and preempted decodes), or while the gateway's own count of its requests' KV
    said so, are the load's: left out, so overload degrades nobody."""
    from tailguard.core.fleet import EngineReport

    rig = Rig(["A100"] * 4)
    rig.run(10, {})
    busy = rig.nodes["A100-80GB#2"]
    for _ in range(20):
        rig.now += 1.0
        busy.report_engine(EngineReport(running=40, waiting=3, kv_usage=0.97, at=rig.now))
        for _ in range(2):
            rig.det.on_decode(busy, 0.02 * 3.0, 0.02, 40, rig.now, rig.now - 1.0)
            rig.det.on_prefill(busy, 0.2 * 4.0, 0.2, rig.now)
        rig.tick()
    assert rig.events == []
    assert rig.det.kv_short_samples == 80
    # By the gateway's count alone: requests whose prompts fill 90% of its KV.
    other = rig.nodes["A100-80GB#1"]
    assert not other.note_kv(rig.now, 200.0, other.perf.kv_capacity_tokens, 1.0)
    for _ in range(4):
        other.dispatched(other.perf.kv_capacity_tokens // 4, other.perf.kv_capacity_tokens // 4)
    assert other.note_kv(rig.now, 200.0, other.perf.kv_capacity_tokens, 1.0)
    # Once it has had room again for a while, it is judged as before.
    rig.now += 10.0
    rig.det.on_decode(busy, 0.02 * 3.0, 0.02, 40, rig.now, rig.now - 1.0)
    assert rig.det.kv_short_samples == 80


def test_an_engine_that_counts_its_preemptions_says_when_it_is_short_of_kv() -> None:
    """Where the engine reports its preemptions (vLLM), a node is short of KV cache
    when it has preempted since its last report, or queues requests with its cache
    full, not by the gateway's count of what its requests would need at once:
    prompts queued behind a prompt backlog hold no KV, and a node computing a
    burst of them with its cache a fifth used is judged as ever."""
    from tailguard.core.fleet import EngineReport

    rig = Rig(["A100"] * 4)
    rig.run(10, {})
    node = rig.nodes["A100-80GB#1"]
    for _ in range(4):
        node.dispatched(node.perf.kv_capacity_tokens // 4, node.perf.kv_capacity_tokens // 4)
    kv = node.perf.kv_capacity_tokens
    assert node.note_kv(rig.now, 200.0, kv, 1.0)  # no report: the gateway's count
    node.kv_short_until = -math.inf
    node.report_engine(EngineReport(running=8, waiting=90, kv_usage=0.2, at=rig.now,
                                    preemptions=5))
    assert not node.note_kv(rig.now, 200.0, kv, 1.0)
    assert not node.kv_short_since(rig.now - 1.0)
    rig.now += 1.0
    node.report_engine(EngineReport(running=8, waiting=90, kv_usage=0.2, at=rig.now,
                                    preemptions=5))
    assert not node.kv_short_since(rig.now - 1.0)
    rig.now += 1.0
    node.report_engine(EngineReport(running=8, waiting=90, kv_usage=0.85, at=rig.now,
                                    preemptions=6))  # one preempted since the last report
    assert node.kv_short_since(rig.now)
    rig.det.on_decode(node, 0.06, 0.02, 8, rig.now + 1.0, rig.now - 0.5)
    assert rig.det.kv_short_samples == 1
    # A report withdrawn as stale: the gateway's count again.
    node.report_engine(EngineReport(at=rig.now + 2.0))
    assert node.note_kv(rig.now + 2.0, 200.0, kv, 1.0)


def test_a_class_of_one_counts_its_pieces_whole_ratio_at_their_shares_weight() -> None:
    """A node alone in its class is judged against its own history only, and its
    decode pieces are mostly prompt chunks where prompts are long (a share of
    0.3-0.45 on the Azure code shape). Weighting the log-ratio by the share read
    a half-speed throttle there as 1.27x, under the flag, while the history rose
    with it each clean interval (a lone H100 caught 19 s after the fault, 42 s on
    another draw). A lone node's window counts the whole ratio, with the share as
    the weight of its evidence: a throttle slows every part of a piece and is
    caught; a large ratio in a piece that is nearly all prompt chunks (a duty the
    model mispriced) moves the evidence little."""
    def run(ratio: float, share: float, seconds: int) -> list[tuple[float, str, str]]:
        rig = Rig(["H100", "A100", "A100"])
        lone = rig.nodes["H100-SXM#0"]

        def second(r: float, s: float) -> None:
            for _ in range(10):
                rig.det.on_decode(lone, 0.02 * r, 0.02, 8, rig.now, rig.now - 0.5, s)
                rig.now += 0.1
            rig.tick()

        for _ in range(30):
            second(1.0, 0.35)
        t0 = rig.now
        for _ in range(seconds):
            second(ratio, share)
        return [(t - t0, n, s) for t, n, s in rig.events]

    caught = run(2.0, 0.35, 20)
    assert [(n, s) for _, n, s in caught] == [("H100-SXM#0", "degraded")]
    assert caught[0][0] <= 12.0
    assert run(1.6, 0.1, 60) == []
