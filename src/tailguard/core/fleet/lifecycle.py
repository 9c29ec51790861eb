"""A node's lifecycle: its state and routing weight, changed only through one
transition table.

Three kinds of writer move a node, each with the moves it may make
(:data:`TRANSITIONS`); anything else is a bug in the writer and raises
:class:`IllegalTransition`:

* the **detector** moves a routable node between healthy, degraded, quarantined
  and probation, and scales its weight (``1 / slowness`` while degraded, the
  canary ramp on probation);
* the **leader**, a replica whose decisions a follower adopts
  (:meth:`OutlierDetector.adopt`), may set any of the detector's states;
* an **operator** (the admin API, discovery, a shared operator action, a
  replayed recording) cordons, drains or puts back any node;
* the **health** probes take a routable node down and bring a down one back.

A node that becomes healthy has its full weight back, whoever moved it. The
node tells its ``on_state_change`` hook (the balancer's: pools re-list their
routable nodes) after each move.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, ClassVar


class NodeState(enum.Enum):
    HEALTHY = "healthy"
    DEGRADED = "degraded"  # still routed, with its weight scaled down
    QUARANTINED = "quarantined"  # no new requests; in-flight ones finish
    PROBATION = "probation"  # a small canary share, ramping up
    CORDONED = "cordoned"  # taken out by an operator
    DRAINING = "draining"  # being removed: no new requests
    DOWN = "down"  # failing the driver's active health checks: no new requests

    @property
    def routable(self) -> bool:
        return self in (NodeState.HEALTHY, NodeState.DEGRADED, NodeState.PROBATION)


class Actor(enum.Enum):
    """Who moves a node (see the module docstring)."""

    DETECTOR = "detector"
    LEADER = "leader"
    OPERATOR = "operator"
    HEALTH = "health"


_H, _D, _Q, _P = NodeState.HEALTHY, NodeState.DEGRADED, NodeState.QUARANTINED, NodeState.PROBATION
# The detector's own states: a leader publishes these, a follower adopts them.
LIFECYCLE = frozenset({_H, _D, _Q, _P})
_ANY = frozenset(NodeState)

# actor -> state now -> the states it may move the node to
TRANSITIONS: Mapping[Actor, Mapping[NodeState, frozenset[NodeState]]] = {
    Actor.DETECTOR: {
        _H: frozenset({_D, _Q}),
        _D: frozenset({_H, _Q}),
        _Q: frozenset({_P}),
        _P: frozenset({_H, _D, _Q}),
    },
    Actor.LEADER: {s: LIFECYCLE - {s} for s in LIFECYCLE},
    Actor.OPERATOR: {s: frozenset({_H, NodeState.CORDONED, NodeState.DRAINING}) - {s}
                     for s in _ANY},
    Actor.HEALTH: {
        **{s: frozenset({NodeState.DOWN}) for s in _ANY if s.routable},
        NodeState.DOWN: frozenset({_H}),
    },
}


class IllegalTransition(ValueError):
    """A writer tried a move the transition table does not give it."""


class Lifecycle:
    """The node's state and weight scale (a part of :class:`~tailguard.core.fleet.Node`)."""

    if not TYPE_CHECKING:  # slots are the node's (mypy would take these as the part's)
        __slots__ = ()
    FIELDS: ClassVar[tuple[str, ...]] = ("on_state_change", "state", "weight_scale")

    id: str
    state: NodeState
    # What the router divides a node's cost by: 1 healthy, 1/slowness degraded,
    # the canary ramp on probation.
    weight_scale: float
    on_state_change: Callable[[Lifecycle, NodeState], None] | None

    def _init_lifecycle(self) -> None:
        self.state = NodeState.HEALTHY
        self.weight_scale = 1.0
        self.on_state_change = None

    def move(self, to: NodeState, actor: Actor) -> bool:
        """Move the node to ``to`` as ``actor`` may (False: it is there already)."""
        was = self.state
        if to is was:
            return False
        if to not in TRANSITIONS[actor].get(was, ()):
            raise IllegalTransition(f"{actor.value} may not move node {self.id} "
                                    f"from {was.value} to {to.value}")
        self.state = to
        if to is NodeState.HEALTHY:
            self.weight_scale = 1.0
        if self.on_state_change is not None:
            self.on_state_change(self, was)
        return True

    def watch_moves(self, hook: Callable[[Lifecycle, NodeState], None]) -> None:
        """Call ``hook(node, state before)`` after each move (the balancer's)."""
        self.on_state_change = hook

    def reweigh(self, weight_scale: float) -> None:
        """The detector's weight for the node (its state stays). A weight only ever
        lowers a node's share: at most 1, which the router's bounds rely on."""
        self.weight_scale = weight_scale if weight_scale < 1.0 else 1.0
