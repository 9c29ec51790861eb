"""The balancer's read model: a frozen copy observers read, with the figures they share."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from tailguard.core.admission import AdmissionConfig
from tailguard.core.balancer import Balancer, PoolConfig
from tailguard.core.fleet import Actor, NodeSpec, NodeState, Outcome
from tailguard.core.hardware import DEFAULT_CATALOG
from tailguard.core.limits import LimitConfig

MODEL = "llama-3.1-8b"


def _balancer() -> Balancer:
    specs = [NodeSpec(f"n{i}", DEFAULT_CATALOG.gpu("A100"), "A100-80GB", models=(MODEL,))
             for i in range(2)] + [NodeSpec("t", DEFAULT_CATALOG.gpu("T4"), "T4", models=(MODEL,))]
    pool = PoolConfig(MODEL, "least_request", limits=LimitConfig(kind="fixed", initial=2),
                      admission=AdmissionConfig(queue_max=1))
    return Balancer(specs, [pool], random.Random(0))


def test_a_snapshot_is_a_frozen_copy_of_one_moment() -> None:
    b = _balancer()
    t = b.pick(MODEL, 500, 0.0)
    assert t is not None
    snap = b.snapshot(1.0)
    node = snap.nodes[t.node_id]
    assert (node.in_flight, node.prefilling, node.limit, node.limiter.in_use if node.limiter
            else None) == (1, 1, 2, 1)
    b.on_first_token(t, 1.5)
    b.on_finish(t, 2.0, Outcome.OK, 20)
    assert node.in_flight == 1  # the copy did not move with the node
    assert b.snapshot(2.0).nodes[t.node_id].in_flight == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        node.in_flight = 5  # type: ignore[misc]


def test_the_figures_observers_share() -> None:
    b = _balancer()
    b.set_state("t", NodeState.DOWN, Actor.HEALTH)
    snap = b.snapshot(0.0)
    pool = snap.pools[MODEL]
    assert pool.states[NodeState.DOWN] == 1 and pool.states[NodeState.HEALTHY] == 2
    assert pool.queue_depth == 0 and pool.shed_total == {}
    a100 = snap.nodes["n0"]
    assert a100.capacity_tokens_per_s > 0 and a100.ttft_s is None
    # The pool's capacity is its routable nodes': the down T4 counts for nothing.
    assert pool.capacity_tokens_per_s == pytest.approx(
        snap.nodes["n0"].capacity_tokens_per_s + snap.nodes["n1"].capacity_tokens_per_s)
    # Slowness for its own hardware: the detector's ratio once it keeps a record of the
    # node, before that the node's own decode slowdown over its class's.
    b.nodes["n0"].capacity.decode.log_ratio = math.log(1.5)
    early = b.snapshot(0.0).nodes["n0"]
    assert early.outliers is None and early.slowness == pytest.approx(1.5)
    b.tick(1.0)
    judged = b.snapshot(1.0).nodes["n0"]
    assert judged.outliers is not None and math.isfinite(judged.slowness)
