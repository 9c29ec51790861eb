"""A node's parts: each the only writer of its fields; the lifecycle's transition table."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest

from tailguard.core.balancer import Balancer, PoolConfig
from tailguard.core.fleet import (
    TRANSITIONS,
    Actor,
    IllegalTransition,
    Node,
    NodeSpec,
    NodeState,
)
from tailguard.core.fleet.lifecycle import Lifecycle
from tailguard.core.fleet.load import Load
from tailguard.core.fleet.peers import PeerView
from tailguard.core.fleet.silence import Silence
from tailguard.core.fleet.speed import Speed
from tailguard.core.fleet.work import PromptWork
from tailguard.core.hardware import DEFAULT_CATALOG, perf_model

SRC = Path(__file__).resolve().parents[2] / "src" / "tailguard"
FLEET = SRC / "core" / "fleet"
PARTS = {Lifecycle: "lifecycle.py", Load: "load.py", PromptWork: "work.py",
         Silence: "silence.py", PeerView: "peers.py", Speed: "speed.py"}
OWN = ("engine", "id", "limiter", "perf", "slots", "spec")  # Node's own, written in node.py


def _writes(path: Path) -> list[tuple[int, str, str]]:
    """(line, attribute, target) of every ``x.attr = / += / : T =`` in ``path`` where
    ``x`` is not ``self`` (outside the fleet, ``self`` is some other object)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                if isinstance(el, ast.Attribute) and not (
                        isinstance(el.value, ast.Name) and el.value.id == "self"):
                    out.append((node.lineno, el.attr, ast.unparse(el)))
    return out


def test_no_node_field_is_written_outside_its_part() -> None:
    owner = {f: FLEET / module for part, module in PARTS.items() for f in part.FIELDS}
    owner.update({f: FLEET / "node.py" for f in OWN})
    assert set(owner) == set(Node.__slots__)
    # A ticket's, a copy's and a waiter's ``state`` are theirs: only names that
    # stand for a node count there.
    others = {"state"}
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        for line, attr, target in _writes(path):
            home = owner.get(attr)
            if home is None or home == path:
                continue
            if attr in others and target.split(".")[0] not in ("node", "n"):
                continue
            bad.append(f"{path.relative_to(SRC)}:{line}: {target}")
    assert not bad, "node fields written outside their part:\n" + "\n".join(bad)


def _node() -> Node:
    return Node(NodeSpec("n0", DEFAULT_CATALOG.gpu("A100"), "A100-80GB"),
                perf_model("A100-80GB", "llama-3.1-8b"))


def test_each_writer_makes_only_its_own_moves() -> None:
    n = _node()
    with pytest.raises(IllegalTransition):
        n.move(NodeState.QUARANTINED, Actor.OPERATOR)  # quarantine is the detector's
    with pytest.raises(IllegalTransition):
        n.move(NodeState.PROBATION, Actor.DETECTOR)  # probation follows a quarantine
    assert n.move(NodeState.CORDONED, Actor.OPERATOR)
    for actor in (Actor.DETECTOR, Actor.LEADER, Actor.HEALTH):  # a cordon holds
        for to in NodeState:
            if to is not NodeState.CORDONED:
                with pytest.raises(IllegalTransition):
                    n.move(to, actor)
    assert n.move(NodeState.HEALTHY, Actor.OPERATOR)
    assert n.move(NodeState.DOWN, Actor.HEALTH)
    with pytest.raises(IllegalTransition):
        n.move(NodeState.DEGRADED, Actor.DETECTOR)  # a down node is the probes'
    assert n.move(NodeState.HEALTHY, Actor.HEALTH)
    assert not n.move(NodeState.HEALTHY, Actor.HEALTH)  # there already


def test_the_detector_lifecycle_is_a_cycle_back_to_healthy() -> None:
    n = _node()
    for to in (NodeState.DEGRADED, NodeState.QUARANTINED, NodeState.PROBATION,
               NodeState.DEGRADED, NodeState.HEALTHY):
        n.reweigh(0.3)
        assert n.move(to, Actor.DETECTOR)
    assert n.weight_scale == 1.0  # healthy again means the full weight, whoever moved it
    n.reweigh(1.7)
    assert n.weight_scale == 1.0  # a weight only lowers a node's share (the router's bounds)
    # Every state any writer reaches, some writer can leave.
    reachable = {s for table in TRANSITIONS.values() for outs in table.values() for s in outs}
    assert all(any(table.get(s) for table in TRANSITIONS.values()) for s in reachable)


def test_every_move_reaches_the_balancers_pools() -> None:
    specs = [NodeSpec(f"n{i}", DEFAULT_CATALOG.gpu("A100"), "A100-80GB", models=("m",))
             for i in range(3)]
    b = Balancer(specs, [PoolConfig("m", policy="round_robin")], random.Random(0))
    assert len(b.pools["m"].eligible()) == 3
    b.nodes["n1"].move(NodeState.QUARANTINED, Actor.DETECTOR)  # not through set_state
    assert [n.id for n in b.pools["m"].eligible()] == ["n0", "n2"]
    b.set_state("n1", NodeState.CORDONED)
    b.set_state("n2", NodeState.DOWN, Actor.HEALTH)
    assert [n.id for n in b.pools["m"].eligible()] == ["n0"]
    with pytest.raises(IllegalTransition):
        b.set_state("n0", NodeState.DOWN)  # the operator does not fake a failed probe
