"""What other gateway replicas write to the shared store, read as untrusted input.

A replica's report (``Peers.report`` in ``core/shared.py``, plus its epoch,
sequence, clock and budgets) and an operator action are JSON written by
anyone who can write to the store. Each is parsed here, from the raw bytes,
before the core sees it: types, finite numbers, ranges and sizes. A message
that breaks any rule is refused whole (:class:`WireError` says which rule),
never half-applied; keys this version does not know are ignored, so replicas
of two versions can run side by side during a rolling upgrade.

The bounds are far above any real fleet's values and far below what would
turn arithmetic into overflow: a node holds at most ``MAX_IN_FLIGHT``
requests, a log-slowdown is within ``MAX_LOG_RATIO`` (a factor of about
1,100 either way), a reason or an id is at most ``MAX_TEXT`` characters.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_IN_FLIGHT = 1_000_000
MAX_TOKENS = 10**10
MAX_SAMPLES = 10**12
MAX_LOG_RATIO = 7.0
MAX_LIMIT = 1_000_000.0
MAX_NODES = 100_000
MAX_TEXT = 512
MAX_BUDGET = 1e9

Count = Annotated[int, Field(ge=0, le=MAX_IN_FLIGHT)]
Samples = Annotated[int, Field(ge=0, le=MAX_SAMPLES)]
LogRatio = Annotated[float, Field(ge=-MAX_LOG_RATIO, le=MAX_LOG_RATIO)]
Total = Annotated[float, Field(ge=-1e12, le=1e12)]
Text = Annotated[str, Field(max_length=MAX_TEXT)]
Id = Annotated[str, Field(min_length=1, max_length=MAX_TEXT)]
Budget = Annotated[float, Field(ge=-MAX_BUDGET, le=MAX_BUDGET)]
# The states a leader decides (core/fleet: LIFECYCLE).
DecidedState = Literal["healthy", "degraded", "quarantined", "probation"]


class WireError(ValueError):
    """A message refused; ``reason`` is the metric label (``malformed``, ...)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True, allow_inf_nan=False)


class NodeEntry(_Wire):
    """One node in a replica's report (``core/shared.py``: ``Peers.report``)."""

    f: Count = 0  # requests in flight
    b: Annotated[int, Field(ge=0, le=MAX_TOKENS)] = 0  # prompt tokens waiting
    d: tuple[LogRatio, Samples] = (0.0, 0)  # decode log-slowdown, samples
    p: tuple[LogRatio, Samples] = (0.0, 0)  # prefill log-slowdown, samples
    l: Annotated[float, Field(ge=1.0, le=MAX_LIMIT)] | None = None  # noqa: E741 (the limit)
    # detection counters: prefill n, total; decode n, total; requests, failures, run
    o: tuple[Samples, Total, Samples, Total, Samples, Samples, Samples] | None = None
    # a leader's decision: state, weight, ejections, seconds left, reason
    s: tuple[DecidedState, Annotated[float, Field(ge=0.0, le=1.0)],
             Annotated[int, Field(ge=0, le=10_000)], Annotated[float, Field(ge=0.0, le=1e7)],
             Text] | None = None


class Report(_Wire):
    """One replica's report, as published."""

    epoch: Id
    seq: Annotated[int, Field(ge=0)] = 0
    ts: float = 0.0  # the sender's wall clock (seconds since the epoch)
    demand: Annotated[int, Field(ge=0, le=MAX_IN_FLIGHT)] = 0
    nodes: Annotated[dict[Id, NodeEntry], Field(max_length=MAX_NODES)] = Field(
        default_factory=dict)
    budgets: Annotated[dict[Id, tuple[Budget | None, Budget | None]],
                       Field(max_length=MAX_NODES)] = Field(default_factory=dict)

    def core(self, leader: bool) -> dict[str, Any]:
        """What the core merges (``Peers.merge``): the report's own shape, checked."""
        nodes = {nid: e.model_dump(exclude_none=True) for nid, e in self.nodes.items()}
        return {"leader": leader, "demand": self.demand, "epoch": self.epoch, "nodes": nodes}


class OperatorAction(_Wire):
    """An operator's state for one node, set on one replica for all."""

    state: Literal["cordoned", "draining", "healthy"]
    by: Id
    id: Id
    ts: float = 0.0


def parse_report(raw: bytes | str) -> Report:
    """A replica's report from its raw JSON, or :class:`WireError`."""
    try:
        return Report.model_validate_json(raw)
    except ValidationError as exc:
        raise WireError("malformed", _first(exc)) from None


def parse_operator_action(raw: bytes | str) -> OperatorAction:
    """An operator action from its raw JSON, or :class:`WireError`."""
    try:
        return OperatorAction.model_validate_json(raw)
    except ValidationError as exc:
        raise WireError("malformed", _first(exc)) from None


def _first(exc: ValidationError) -> str:
    err = exc.errors(include_url=False)[0]
    where = ".".join(str(p) for p in err["loc"])
    return f"{where}: {err['msg']}" if where else str(err["msg"])


__all__ = ["NodeEntry", "OperatorAction", "Report", "WireError", "parse_operator_action",
           "parse_report"]
