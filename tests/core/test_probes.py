"""The health-probe rule: failures in a row take a node out, passes bring it back."""

from __future__ import annotations

import random

from tailguard.core.balancer import Balancer, PoolConfig
from tailguard.core.fleet import Actor, NodeSpec, NodeState
from tailguard.core.hardware import DEFAULT_CATALOG
from tailguard.core.probes import HealthProbes, ProbeRule
from tailguard.core.replay import replay


def test_the_rule_counts_in_a_row() -> None:
    p = HealthProbes(ProbeRule(failures=2, successes=2))
    assert [p.observe("n", ok) for ok in (False, True, False, False, False)] == \
        [None, None, None, False, None]  # two in a row, once
    assert [p.observe("n", ok) for ok in (True, False, True, True, True)] == \
        [None, None, None, True, None]


def test_probes_move_a_node_down_and_back_and_replay() -> None:
    records: list[dict[str, object]] = []
    spec = NodeSpec("n0", DEFAULT_CATALOG.gpu("A100"), "A100-80GB", models=("m",))
    b = Balancer([spec], [PoolConfig("m", "round_robin")], random.Random(0),
                 recorder=records.append, probes=ProbeRule(failures=2))
    assert b.on_probe("n0", False, 1.0) is None and b.nodes["n0"].state is NodeState.HEALTHY
    assert b.on_probe("n0", False, 2.0) is False and b.nodes["n0"].state is NodeState.DOWN
    assert b.pick("m", 10, 2.5) is None
    assert b.on_probe("n0", True, 3.0) is True and b.nodes["n0"].state is NodeState.HEALTHY
    # A node the probes find failing while an operator holds it stays the operator's.
    b.set_state("n0", NodeState.CORDONED, Actor.OPERATOR)
    b.on_probe("n0", False, 4.0)
    b.on_probe("n0", False, 5.0)
    assert b.nodes["n0"].state is NodeState.CORDONED
    assert b.on_probe("gone", False, 6.0) is None  # a node removed meanwhile
    result = replay(records)
    assert result.decisions > 0 and not result.differences
