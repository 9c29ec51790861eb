"""Routing policies on literal fleets: each one's rule, and never an ineligible node."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings, strategies as st

from tailguard.core.balancer import Balancer, PoolConfig
from tailguard.core.fleet import OWED_S, TRANSITIONS, Actor, NodeSpec, NodeState, Outcome
from tailguard.core.hardware import DEFAULT_CATALOG
from tailguard.core.policies import Slo, make_policy, policy_names
from tailguard.core.policies.base import RequestInfo
from tailguard.core.policies.tailguard_options import TailguardOptions
from tailguard.core.predict import (
    decode_step_s,
    interleaved_tpot,
    running_batch,
    saturated_step_s,
)
from tailguard.errors import ConfigError

MODEL = "llama-3.1-8b"


def spec(node_id: str, gpu: str) -> NodeSpec:
    g = DEFAULT_CATALOG.find_gpu(gpu)
    return NodeSpec(node_id, g, g.name if g else gpu, models=(MODEL,))


def balancer(policy: str, gpus: list[str], seed: int = 1) -> Balancer:
    specs = [spec(f"n{i}", g) for i, g in enumerate(gpus)]
    return Balancer(specs, [PoolConfig(MODEL, policy)], random.Random(seed))


def test_registry_has_every_policy() -> None:
    assert set(policy_names()) >= {"round_robin", "random", "least_request", "p2c", "peak_ewma",
                                   "seed_weighted", "tailguard"}
    with pytest.raises(ConfigError, match="unknown policy"):
        make_policy("fastest")


def test_round_robin_cycles() -> None:
    b = balancer("round_robin", ["H100", "L4", "T4"])
    assert [b.pick(MODEL, 100, 0.0).node_id for _ in range(4)] == ["n0", "n1", "n2", "n0"]


def test_least_request_prefers_fewest_in_flight_ties_first() -> None:
    b = balancer("least_request", ["L4", "H100"])
    t1 = b.pick(MODEL, 100, 0.0)
    t2 = b.pick(MODEL, 100, 0.0)
    assert (t1.node_id, t2.node_id) == ("n0", "n1")
    b.on_finish(t1, 1.0, Outcome.OK, 10)
    assert b.pick(MODEL, 100, 1.0).node_id == "n0"


def test_seed_weighted_is_the_classic_rule() -> None:
    b = balancer("seed_weighted", ["T4", "A100", "H100", "L4"])
    picks = [b.pick(MODEL, 100, 0.0) for _ in range(6)]
    # Scores: idle H100 10; then H100 1.0 vs A100 8 -> A100; then H100 1.0, A100 0.8,
    # L4 5 (other: 0.5), T4 2 -> L4; then T4 2; then H100 1.0 ...
    assert [p.node_id for p in picks] == ["n2", "n1", "n3", "n0", "n2", "n1"]
    # Completion counts load back down (unlike the naive original).
    b.on_finish(picks[0], 1.0, Outcome.OK, 5)
    b.on_finish(picks[4], 1.0, Outcome.OK, 5)
    assert b.pick(MODEL, 100, 1.0).node_id == "n2"


def test_tailguard_prefers_fast_gpu_until_it_is_loaded() -> None:
    b = balancer("tailguard", ["L4", "H100"])
    picks = [b.pick(MODEL, 1000, 0.0).node_id for _ in range(30)]
    assert picks[0] == "n1"
    assert picks.count("n1") > picks.count("n0")


def test_tailguard_learns_a_gpu_class_slowdown() -> None:
    b = balancer("tailguard", ["A100", "L40S"])
    assert b.pick(MODEL, 500, 0.0).node_id == "n0"  # the prior favours the A100
    b = balancer("tailguard", ["A100", "L40S"])
    node = b.nodes["n0"]
    for _ in range(40):
        node.capacity.decode.update(5.0, 1.0)
        node.capacity.prefill.update(5.0, 1.0)
    b.tick(1.0)  # publishes the class slowdowns the router uses
    assert node.class_decode_slowdown > 4.0
    picks = [b.pick(MODEL, 500, 1.0).node_id for _ in range(10)]
    assert picks.count("n1") >= 8


def test_tailguard_pools_slowdowns_within_a_class() -> None:
    b = balancer("tailguard", ["A100", "A100"])
    for _ in range(40):
        b.nodes["n0"].capacity.decode.update(4.0, 1.0)
    b.tick(1.0)
    # Identical cards share one multiplier: the geometric mean (sqrt 4 = 2).
    assert abs(b.nodes["n0"].class_decode_slowdown - 2.0) < 0.1
    assert b.nodes["n0"].class_decode_slowdown == b.nodes["n1"].class_decode_slowdown


def test_tailguard_sampling_option() -> None:
    b = Balancer([spec(f"n{i}", "A100") for i in range(8)],
                 [PoolConfig(MODEL, "tailguard", TailguardOptions(sample=2))], random.Random(3))
    seen = {b.pick(MODEL, 100, 0.0).node_id for _ in range(40)}
    assert len(seen) >= 4


def test_tailguard_prices_the_prefill_queue_it_joins() -> None:
    # 4,000-token prompts at one instant: selfish finish time sends the first four
    # to the H100 (16,000 tokens queued) before the A100 wins one; priced with the
    # wait it imposes on the requests behind it, the H100 spills after two.
    def first_spill(queue_weight: float) -> int:
        b = Balancer([spec("n0", "H100"), spec("n1", "A100")],
                     [PoolConfig(MODEL, "tailguard", TailguardOptions(queue_weight=queue_weight))],
                     random.Random(1))
        picks = [b.pick(MODEL, 4000, 0.0).node_id for _ in range(12)]
        return picks.index("n1")

    assert first_spill(0.0) == 4
    assert first_spill(1.0) == 2


def test_tailguard_spreads_an_overload_by_engine_room() -> None:
    # One A100 holds four 6k-token prompts (24k queued), the other ``short``
    # 1k-token prompts. Where the second can still answer within the 1 s TTFT
    # SLO it wins; where both are predicted to miss it by half or more, the
    # request goes to the node with the most engine room (the first: 5 requests
    # in flight against 21), not to the shorter queue that every request would
    # pile onto.
    def pick(short: int, spill: float | None = 0.5, at: float = 0.0) -> str:
        nonlocal b
        options = TailguardOptions(spill_excess=spill)
        b = Balancer([spec("n0", "A100"), spec("n1", "A100")],
                     [PoolConfig(MODEL, "tailguard", options, Slo(1.0, 0.1))], random.Random(1))
        b.set_state("n1", NodeState.DRAINING, Actor.OPERATOR)
        assert all(b.pick(MODEL, 6000, 0.0).node_id == "n0" for _ in range(4))
        b.set_state("n1", NodeState.HEALTHY, Actor.OPERATOR)
        b.set_state("n0", NodeState.DRAINING, Actor.OPERATOR)
        assert all(b.pick(MODEL, 1000, 0.0).node_id == "n1" for _ in range(short))
        b.set_state("n0", NodeState.HEALTHY, Actor.OPERATOR)
        return b.pick(MODEL, 1000, at).node_id

    b: Balancer
    assert pick(10) == "n1"
    assert pick(20) == "n0"
    # What the node a request spilled onto times then is the load's: the detector
    # leaves it out (as a node short of KV cache); the other node is judged.
    assert pick(20, at=10.0) == "n0"
    assert b.nodes["n0"].kv_short_since(10.0) and not b.nodes["n1"].kv_short_since(10.0)
    assert pick(20, spill=None) == "n1"  # the least miss
    assert pick(20, spill=2.0) == "n1"  # it misses by less than that


@settings(max_examples=60, deadline=None)
@given(gpus=st.lists(st.sampled_from(["H100", "A100", "L40S", "L4", "T4"]), min_size=1,
                     max_size=12),
       seed=st.integers(0, 10_000))
def test_tailguard_passing_over_a_class_never_changes_the_choice(gpus: list[str],
                                                                 seed: int) -> None:
    # The policy skips a whole shape whose idle node cannot beat the best cost so
    # far. Checked against the same policy made to examine every shape (an
    # overload spill that never fires turns the skip off), on loaded fleets with
    # learned class speeds, degraded nodes and cached prefixes.
    rng = random.Random(seed)
    b = balancer("tailguard", gpus, seed)
    pool = b.pools[MODEL]
    every = make_policy("tailguard", Slo(), TailguardOptions(spill_excess=1e9))
    for _ in range(rng.randrange(0, 40)):
        b.pick(MODEL, rng.choice([50, 800, 4000, 16000]), 0.0)
    for gpu_class in {n.spec.gpu_class for n in b.nodes.values()}:
        d, p = rng.uniform(0.5, 3.0), rng.uniform(0.5, 3.0)
        for n in b.nodes.values():
            if n.spec.gpu_class == gpu_class:
                n.set_class_speed(d, p, rng.choice([1.0, 1.0, 1.5]))
    for n in b.nodes.values():
        if rng.random() < 0.3:
            n.reweigh(rng.uniform(0.1, 1.0))
    nodes = pool.eligible()
    for _ in range(20):
        prompt = rng.choice([10, 300, 2000, 9000])
        cached = {n.id: rng.randrange(prompt) for n in nodes if rng.random() < 0.3}
        req = RequestInfo(MODEL, prompt, rng.choice([None, 5, 500]), rng.uniform(20, 600),
                          rng.uniform(100, 8000), cached=cached)
        assert pool.policy.choose(nodes, req, 1.0, rng) == every.choose(nodes, req, 1.0, rng)


def test_router_and_learner_cap_the_batch_at_the_engine_slots() -> None:
    b = balancer("tailguard", ["A100"])
    node = b.nodes["n0"]
    perf = node.perf
    assert running_batch(perf, 256, 300, 1200.0) == 256  # max_num_seqs
    assert running_batch(perf, 256, 10, 1200.0) == 10
    kv_slots = int(perf.kv_capacity_tokens / 100_000.0)
    assert running_batch(perf, 256, 300, 100_000.0) == max(1, kv_slots)  # KV-bound
    # A request that met 300 in flight on 256 slots ran at batch 256: the learner
    # must price its step there, or a queueing node looks faster than it is.
    node.slots = 4
    tickets = [b.pick(MODEL, 100, 0.0) for _ in range(8)]
    for t in tickets:
        b.on_first_token(t, 0.1)
    # Three more prompts come in and are computed during its decode (each prompt's
    # work accrues from its dispatch to its predicted first token): each token
    # shared the engine with them.
    later = [b.pick(MODEL, 100, 0.3) for _ in range(3)]
    for t in later:
        b.on_first_token(t, 0.4)
    b.on_finish(tickets[0], 1.1, Outcome.OK, 101)  # 10 ms per token
    pool = tickets[0].pool
    step4 = decode_step_s(perf, 4, pool.mean_prompt + pool.mean_output / 2)
    duty = (node.prefill_work_s - tickets[0].work_at_first) * node.class_prefill_slowdown / 1.0
    assert duty > 0.0
    assert node.prefill_work_s == pytest.approx(sum(t.work for t in tickets + later))
    expected = interleaved_tpot(step4, duty, saturated_step_s(perf, 4, pool.mean_prompt
                                                               + pool.mean_output / 2))
    assert abs(node.capacity.decode.log_ratio - math.log(0.01 / expected) / 3.0) < 1e-9


@settings(max_examples=40, deadline=None)
@given(
    policy=st.sampled_from(sorted(policy_names())),
    states=st.lists(st.sampled_from(list(NodeState)), min_size=1, max_size=8),
    seed=st.integers(0, 1000),
    exclude=st.integers(0, 7),
)
def test_never_returns_an_ineligible_node(policy: str, states: list[NodeState], seed: int,
                                          exclude: int) -> None:
    gpus = ["H100", "A100", "L4", "T4", "L40S", "H200", "A10G", "V100"]
    b = balancer(policy, gpus[: len(states)], seed)
    for i, s in enumerate(states):  # as whichever writer may make that move
        if s is not NodeState.HEALTHY:
            actor = next(a for a in Actor if s in TRANSITIONS[a].get(NodeState.HEALTHY, ()))
            b.set_state(f"n{i}", s, actor)
    excluded = (f"n{exclude}",)
    allowed = {f"n{i}" for i, s in enumerate(states) if s.routable} - set(excluded)
    for _ in range(5):
        t = b.pick(MODEL, 300, 0.0, exclude=excluded)
        if not allowed:
            assert t is None
        else:
            assert t is not None and t.node_id in allowed


def test_a_node_busy_with_prompts_predicts_slower_tokens() -> None:
    """Two idle A100s, one of which has been given 4,000-token prompts for the last
    seconds: its decodes will share the engine with them, so the router prefers the
    other, and the duty it prices fades as the prompts stop (DUTY_TAU_S)."""
    from tailguard.core.fleet import DUTY_TAU_S

    b = balancer("tailguard", ["A100", "A100"])
    busy, calm = b.nodes["n0"], b.nodes["n1"]
    for i in range(10):
        if i % 2 == 0:
            b.tick(i * 0.5)  # the drivers tick every second
        t = b.take(MODEL, "n0", 4000, i * 0.5)
        assert t is not None
        b.on_first_token(t, i * 0.5 + 0.2)
        b.on_finish(t, i * 0.5 + 0.2, Outcome.OK, 1)
    now = 5.0
    b.tick(now)
    duty = busy.duty
    assert 0.3 < duty < 1.0 and calm.duty == calm.duty_sq == 0.0
    assert 0.0 < busy.duty_sq < duty
    assert busy.in_flight == calm.in_flight == 0
    picked = b.pick(MODEL, 100, now)
    assert picked is not None and picked.node_id == "n1"
    # Five time constants later the prompts are history: the tie breaks as before.
    b.tick(now + 5 * DUTY_TAU_S)
    assert busy.duty < 0.01 * duty
    assert interleaved_tpot(0.02, 0.5, 0.1) == pytest.approx(0.04)
    # No more than a step that always carries a prompt chunk.
    assert interleaved_tpot(0.02, 0.9, 0.1) == interleaved_tpot(0.02, 5.0, 0.1) == 0.1


def test_a_card_clearly_slower_than_its_class_keeps_the_slo_at_its_own_speed() -> None:
    """A T4 1.4x slow for its class is below what the detector flags (1.5x), and the
    router prices its class by the class's mean: its own measured speed is what its
    TPOT check uses (Node.decode_excess), against its class's *other* cards. Cards
    that differ by noise keep the class's speed."""
    b = balancer("tailguard", ["T4", "T4", "A100", "A100"])
    slow, peer, a, a2 = (b.nodes[f"n{i}"] for i in range(4))
    for _ in range(20):
        slow.capacity.decode.update(1.4, 1.0)
        peer.capacity.decode.update(1.0, 1.0)
        a.capacity.decode.update(1.05, 1.0)
        a2.capacity.decode.update(0.95, 1.0)
    b.tick(0.0)
    assert slow.decode_excess == pytest.approx(1.4, rel=0.02)
    assert peer.decode_excess == a.decode_excess == a2.decode_excess == 1.0


def test_a_stalled_node_is_avoided_until_it_answers() -> None:
    """A node silent past its oldest prompt's due time (Node.overdue_s) gets no new
    requests: the router sees a stall within a fraction of a second, before any
    learned speed moves, and a request cancelled unanswered (a hedge's loser)
    keeps the evidence until the node answers again, for at most OWED_S."""
    b = balancer("tailguard", ["H100", "H100"])
    n0, n1 = b.nodes["n0"], b.nodes["n1"]
    # Both healthy and answering: load alternates.
    for i in range(6):
        t = b.pick(MODEL, 500, 0.01 * i)
        b.on_first_token(t, 0.01 * i + 0.005)
        b.on_finish(t, 0.01 * i + 0.006, Outcome.OK, 1)
    assert n0.overdue_s(1.0) == n1.overdue_s(1.0) == 0.0
    stuck = b.pick(MODEL, 500, 1.0)
    node, peer = (n0, n1) if stuck.node_id == "n0" else (n1, n0)
    due = stuck.due
    assert 1.0 < due < 1.1  # twice a 500-token prompt's roofline TTFT on an H100
    assert node.overdue_s(due) == 0.0
    # No first token by 0.2 s past its due: later requests go to the peer,
    # even as the peer's load grows.
    picks = [b.pick(MODEL, 500, due + 0.2 + 0.01 * i) for i in range(5)]
    assert node.overdue_s(due + 0.2) == pytest.approx(0.2)
    assert {t.node_id for t in picks} == {peer.spec.id}
    # The stuck request is cancelled (its hedge won elsewhere): still overdue.
    b.on_finish(stuck, due + 0.3, Outcome.CLIENT_CANCELLED, 0)
    assert node.overdue_s(due + 0.4) == pytest.approx(0.4)
    picks.append(b.pick(MODEL, 500, due + 0.4))
    assert picks[-1].node_id == peer.spec.id
    # ... for OWED_S, after which one request may probe it.
    assert node.overdue_s(due + 0.3 + OWED_S + 0.01) == 0.0
    # A request cancelled before its due time says nothing; nor does one that
    # failed after it (failures are the outlier detector's evidence).
    other = balancer("tailguard", ["H100"])
    early = other.pick(MODEL, 500, 0.0)
    other.on_finish(early, early.due / 2, Outcome.CLIENT_CANCELLED, 0)
    assert other.nodes["n0"].overdue_s(10.0) == 0.0
    failed = other.pick(MODEL, 500, 10.0)
    other.on_finish(failed, failed.due + 1.0, Outcome.CONNECT_FAILURE, 0)
    assert other.nodes["n0"].overdue_s(failed.due + 1.1) == 0.0
    # The node answers again (a first token): the stall is over, and it is
    # priced by its load once more.
    probe = b.take(MODEL, node.spec.id, 500, due + 0.5)
    assert probe is not None
    b.on_first_token(probe, due + 0.51)
    b.on_finish(probe, due + 0.52, Outcome.OK, 1)
    for t in picks:  # the peer decodes the six it took
        b.on_first_token(t, due + 0.55)
    assert node.overdue_s(due + 0.6) == peer.overdue_s(due + 0.6) == 0.0
    assert b.pick(MODEL, 500, due + 0.6).node_id == node.spec.id


def test_leaving_the_prefix_holder_is_charged_the_prefill_it_adds() -> None:
    """Moving a prompt off the node that holds most of it costs the fleet the prefill
    the holder would have skipped, which delays the queue behind it at its new node
    as a backlog of that size would: the policy charges it beside the wait. A
    4,000-token prompt, 3,900 of them held by n0, which has 3,000 prompt tokens
    queued: at n0 it costs 3,100 tokens of TTFT plus 3,000 of queueing (6,100); at
    the idle n1 4,000 of TTFT, which alone would move it, plus the 3,900 it adds
    (7,900), so it stays. Behind 6,000 tokens (12,100) it moves."""
    from tailguard.core.policies import RequestInfo
    policy = make_policy("tailguard")

    def choice(backlog: int) -> str | None:
        b = balancer("tailguard", ["H100", "H100"])
        b.take(MODEL, "n0", backlog, 0.0)  # in flight on the holder, not yet prefilled
        b.take(MODEL, "n1", 1, 0.0)  # the same batch on both
        req = RequestInfo(MODEL, 4000, expected_output=50, cached={"n0": 3900})
        return policy.choose(list(b.nodes.values()), req, 0.0, random.Random(1))

    assert choice(3000) == "n0"
    assert choice(6000) == "n1"


def test_the_awaited_requests_stay_bounded_under_any_policy() -> None:
    """Node.awaited is trimmed as requests get their first tokens or leave, not only
    when the tailguard policy reads it: round robin never does."""
    b = balancer("round_robin", ["H100", "H100"])
    for i in range(2000):
        t = b.pick(MODEL, 100, float(i))
        if i % 3:
            b.on_first_token(t, i + 0.01)
        b.on_finish(t, i + 0.02, Outcome.OK if i % 5 else Outcome.CLIENT_CANCELLED, 4)
    assert all(len(n.awaited) <= 1 for n in b.nodes.values())
