"""The fleet as the decision core sees it: node specs, live nodes and their parts,
the lifecycle's transition table, and the read-only view policies get."""

from tailguard.core.fleet.engine_report import NOT_REPORTED, EngineReport
from tailguard.core.fleet.lifecycle import (
    LIFECYCLE,
    TRANSITIONS,
    Actor,
    IllegalTransition,
    NodeState,
)
from tailguard.core.fleet.node import Node, NodeView
from tailguard.core.fleet.silence import OVERDUE_FACTOR, OWED_S, STALL_S, Awaited
from tailguard.core.fleet.spec import (
    SEED_DEFAULT_WEIGHT,
    SEED_WEIGHTS,
    NodeSpec,
    Outcome,
    seed_weight,
)
from tailguard.core.fleet.speed import OWN_MARGIN, OWN_SAMPLES
from tailguard.core.fleet.work import DUTY_TAU_S

__all__ = [
    "DUTY_TAU_S",
    "LIFECYCLE",
    "NOT_REPORTED",
    "OVERDUE_FACTOR",
    "OWED_S",
    "OWN_MARGIN",
    "OWN_SAMPLES",
    "SEED_DEFAULT_WEIGHT",
    "SEED_WEIGHTS",
    "STALL_S",
    "TRANSITIONS",
    "Actor",
    "Awaited",
    "EngineReport",
    "IllegalTransition",
    "Node",
    "NodeSpec",
    "NodeState",
    "NodeView",
    "Outcome",
    "seed_weight",
]
