"""The exchange's vocabulary: the request, a failure, a copy, and the actions.

Kept apart from the state machine (:mod:`tailguard.core.exchange`, which
re-exports all of it) so that a driver's reader finds on one page everything
it may receive and must carry out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from tailguard.core.admission import Shed, Waiter
from tailguard.core.balancer import Ticket
from tailguard.core.fleet import Outcome

RETRY_AFTER_S = "1"  # Retry-After of a 503 when no node can take the request


class Request(NamedTuple):
    """What the exchange needs to know of a client request."""

    model: str
    prompt_tokens: int
    max_tokens: int | None = None
    priority: int = 1  # 0 high, 1 normal, 2 low
    stream: bool = True  # only streamed requests are hedged (nothing reaches the client early)
    ttft_s: float | None = None  # the client's own TTFT budget, for the queue's deadline
    size_bytes: int = 0  # the body's size, for the queue's byte cap
    exclude: tuple[str, ...] = ()  # nodes it must not go to (outside a data plane's subset)
    prefix: tuple[int, ...] = ()  # the prompt's hashed blocks (prefix-cache affinity)
    session: str | None = None  # the client's session key (session affinity)
    # When the whole request must be over, on the clock of ``now`` (None: no deadline):
    # no attempt starts that could not plausibly finish its part by then.
    deadline: float | None = None


@dataclass(frozen=True, slots=True)
class Failure:
    """A failed attempt, and what the client gets if nothing else serves the request."""

    origin: Outcome
    status: int
    message: str
    code: str
    retry_after: str | None = None
    # A 5xx may be the request's doing rather than the node's: charged only
    # once another node served the same request.
    judged: bool = True
    # Cut short by the request's own deadline, not by a timeout of the attempt
    # (first byte, idle, its own bound): no evidence against the node.
    cut: bool = False


NO_CAPACITY = "no_capacity"

# A stream that ended with no data, or with the engine's own error event: the
# request may have caused either, so the node is charged only once another
# node serves the same request (judged=False).
EMPTY_STREAM = Failure(Outcome.UPSTREAM_5XX, 502, "empty stream", "upstream_error", judged=False)
ENGINE_ERROR = Failure(Outcome.UPSTREAM_5XX, 502, "engine error event", "upstream_error",
                       judged=False)


# Copy states.
SENT, COMMITTED, ENDED = 0, 1, 2


class Copy:
    """One attempt of the exchange on one node: the first, a retry or the hedge."""

    # No reference back to its exchange: the driver knows which exchange it
    # reports to, and without the cycle an ended exchange is freed at once
    # (the simulator makes hundreds of thousands).
    __slots__ = ("after", "at_prefill", "hedge", "io", "pio", "prefill_node", "state", "ticket",
                 "was")

    def __init__(self, ticket: Ticket, hedge: bool) -> None:
        self.ticket = ticket
        self.hedge = hedge
        self.state = SENT
        self.io: Any = None  # the driver's handle on it (a task, an engine request id)
        # Disaggregated: the node that computes its prompt first (None: its own node
        # does), the driver's handle on that leg, and whether that leg failed it.
        self.prefill_node: str | None = (ticket.prefill.node.id if ticket.prefill is not None
                                         else None)
        self.pio: Any = None
        self.at_prefill = False
        # A continuation (mid-stream migration): the answer tokens the client had
        # when it was sent, which it continues after (None: it answers from the start).
        self.after: int | None = None
        self.was: Any = None  # its node's state when it committed (a NodeState)

    @property
    def node_id(self) -> str:
        return self.ticket.node.id

    def __repr__(self) -> str:
        kind = "hedge" if self.hedge else "copy"
        return f"<{kind} on {self.node_id}: {('sent', 'committed', 'ended')[self.state]}>"


# -- actions (named tuples: cheap to make, and immutable) ----------------------------


class Dispatch(NamedTuple):
    """Send the request to ``copy.node_id``; report its events with ``copy``. With
    ``copy.prefill_node`` set, first its prefill leg there (the prompt alone, its
    KV kept for the decode node): :meth:`Exchange.prefilled` or
    :meth:`Exchange.prefill_failed` follows, and :class:`Decode` sends the rest."""

    copy: Copy
    retry_of: Outcome | None = None  # the failure this retry follows, for metrics
    # A non-streamed attempt's own bound, in seconds from now: past it the node is
    # taken for hung (a timeout charged to it) while the request still has time
    # for a retry. None: the request's deadline alone bounds it.
    within_s: float | None = None


class Decode(NamedTuple):
    """The prompt is computed on ``copy.prefill_node``: send the decode leg to
    ``copy.node_id`` (it takes the KV from there), as :class:`Dispatch` would."""

    copy: Copy


class Migrate(NamedTuple):
    """Send a continuation to ``copy.node_id``: the request's prompt followed by
    the first ``after`` answer tokens the client has received, asking for the
    rest; its answer continues the same response. Its events are reported with
    ``copy`` as a :class:`Dispatch`'s are. ``cause``: failure, stall, or the state
    of the node left (quarantined, down, degraded)."""

    copy: Copy
    after: int
    cause: str


class Queue(NamedTuple):
    """Wait: the balancer's queue holds it; :meth:`Exchange.queue_decision` follows."""

    waiter: Waiter


class Cancel(NamedTuple):
    """Stop ``copy`` (close its connection, cancel it in the engine); its permit is released."""

    copy: Copy


class ArmTimer(NamedTuple):
    """Call :meth:`Exchange.timer` at ``at`` (the exchange ignores a stale call)."""

    at: float


class Refuse(NamedTuple):
    """The end: answer 429 with ``Retry-After`` (shed at admission)."""

    shed: Shed
    status: int = 429


class Fail(NamedTuple):
    """The end: the request failed. ``committed``: after its first byte (an SSE
    error event ends the stream); else an error answer with ``failure.status``."""

    failure: Failure
    node_id: str | None
    committed: bool


Action = Dispatch | Decode | Migrate | Queue | Cancel | ArmTimer | Refuse | Fail
NONE: tuple[Action, ...] = ()


def client_tpot(t_first: float, now: float, tokens: int) -> float | None:
    """The time per output token a client got: the answer after its first token,
    over the tokens after it (None for fewer than two tokens)."""
    return (now - t_first) / (tokens - 1) if tokens >= 2 and t_first >= 0.0 else None


class StreamEnd(NamedTuple):
    """How a stream ended, as :meth:`Exchange.stream_ended` classified what the
    driver saw: ``failure`` None when it was served, ``tpot`` the client's time per
    output token then, ``error`` the metrics label of a failure ("" when served)."""

    actions: tuple[Action, ...]
    failure: Failure | None
    tpot: float | None
    error: str = ""
