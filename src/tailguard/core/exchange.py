"""One client request's lifecycle as a sans-IO state machine: the exchange.

Every driver (the gateway, the simulator, the endpoint picker) runs a request
the same way: it tells the exchange what happened (events in), and does what
the exchange answers (actions out). The exchange does no I/O and reads no
clock: ``now`` comes with every event. In the style of h11::

    ex = Exchange(balancer, Request("m", prompt_tokens=812), RetryConfig(), budget)
    actions = ex.arrive(now)                # [Dispatch(copy)] | [Queue(w)] | [Refuse] | [Fail]
    ...                                     # the driver sends copy to copy.node_id
    actions = ex.sent(copy, now)            # perhaps [ArmTimer(at)]: the hedge's moment
    actions = ex.first_chunk(copy, now)     # committed; [Cancel(other)] if a race was on
    actions = ex.finished(copy, now, Outcome.OK, output_tokens=143)

Events: :meth:`arrive`, :meth:`queue_decision` (the balancer's queue placed
or shed it), :meth:`sent`, :meth:`first_chunk`, :meth:`failed` (with the
failure's origin), :meth:`finished`, :meth:`timer` and :meth:`client_gone`;
for a driver whose data plane retries by itself (the endpoint picker),
:meth:`fallbacks` (the retry order, up front) and :meth:`redirected` (the data
plane moved the request down that list); for a committed stream,
:meth:`review` (its progress and silence) and :meth:`resumed` (a stalled
stream sent data again).
Actions: :class:`Dispatch` a copy to a node (its ticket holds the permit),
:class:`Queue` (wait for :meth:`queue_decision`), :class:`Cancel` a copy,
:class:`ArmTimer`, and the two endings that answer the client with an
error: :class:`Refuse` (429, shed) and :class:`Fail` (before or after the
first byte). A successful exchange ends at :meth:`finished` with no action:
the driver already relays the answer.

What the exchange owns, so that no driver can differ:

* the first attempt through admission (:meth:`Balancer.admit` where the pool
  has limits or a queue, :meth:`Balancer.pick` otherwise);
* retries while nothing reached the client: each to a node not tried yet,
  within ``RetryConfig.attempts`` and the pool's :class:`RetryBudget`.
  Retries never queue (a retry has already waited once, and the queue is for
  arrivals; a fleet with no free node for it answers with the failure);
* the hedge (one duplicate at most, streamed requests only, decided by the
  pool's :class:`Hedger`) and its race: the first copy to commit wins, the
  others are cancelled; a copy that fails while another runs drops out;
* the request's priority on every copy;
* every copy's permit released exactly once, whatever the ending;
* whose failure a 5xx was: released unjudged, charged to its node only when
  another node then served the request (:meth:`Balancer.blame`); two nodes
  or more failing it, and none serving it, make it the request's doing;
* the request's deadline (``Request.deadline``): no retry or hedge starts
  with less time left than the node it would go to is expected to need (to
  its first token when streamed, to its whole answer when not); the first
  attempt needs only the time to its first token (the client's request
  deserves one try); a non-streamed attempt gets its own bound
  (:data:`ATTEMPT_MARGIN` times what the node is expected to take for the
  longest answer the request allows, at least :data:`ATTEMPT_FLOOR_S`), past
  which its node is taken for hung while a retry still has time; and a copy
  the deadline cut short (``Failure.cut``) is no evidence against its node.

A copy is *committed* at its first chunk (or its complete answer): from then
on no retry and no hedge. A committed stream that fails, stalls or whose node
leaves healthy service *migrates* (:mod:`tailguard.core.migration`): a
:class:`Migrate` sends a continuation (the prompt plus the answer so far) to
another node, and the exchange is ``MOVING`` until the continuation's first
chunk commits it (the stalled copy, if still held, is cancelled) or the
stalled copy resumes first (:meth:`resumed`: the continuation is cancelled).
Where no continuation can go, the failure ends the exchange with
``Fail(committed=True)`` (the gateway ends the stream with an SSE error event).

The exchange is in one :class:`Phase` at a time, and moves only as
:data:`MOVES` allows (an event that finds it elsewhere is stale and changes
nothing)::

    NEW --arrive--> QUEUED --queue_decision--> TRYING --first chunk--> STREAMING <--> MOVING
     |                |                          |  ^ retry, hedge        |  migrate   |
     +----------------+--------------------------+--+---------------------+------------+--> ENDED

``TRYING`` holds the copies before one commits (the first, retries, the
hedge's race); how an ended exchange ended is :attr:`Exchange.ended`. Each
copy has its own state (sent, committed, ended: ``exchange_types.Copy``).
The actions and events are in ``core/exchange_types.py``.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from typing import Any

from mypy_extensions import mypyc_attr

from tailguard.core.admission import Shed, Waiter
from tailguard.core.balancer import Balancer, Ticket
from tailguard.core.exchange_types import (
    COMMITTED,
    EMPTY_STREAM,
    ENDED,
    ENGINE_ERROR,
    NO_CAPACITY,
    NONE,
    RETRY_AFTER_S,
    SENT,
    Action,
    ArmTimer,
    Cancel,
    Copy,
    Decode,
    Dispatch,
    Fail,
    Failure,
    Migrate,
    Queue,
    Refuse,
    Request,
    StreamEnd,
    client_tpot,
)
from tailguard.core.fleet import OVERDUE_FACTOR, NodeState, Outcome
from tailguard.core.hedging import Hedger
from tailguard.core.migration import LEAVE_NOW, MigrationConfig
from tailguard.core.predict import decode_step_s
from tailguard.core.retry_budget import RetryBudget, RetryConfig

# A non-streamed attempt's own bound: this many times what its node is expected
# to take for the request's longest answer (an unbounded request: this many
# times the pool's mean answer, for the tail), never under ATTEMPT_FLOOR_S.
ATTEMPT_MARGIN = 4.0
ATTEMPT_FLOOR_S = 2.0
UNBOUNDED_ANSWERS = 4.0
DEADLINE_PASSED = Failure(Outcome.TIMEOUT, 504, "the request's deadline passed",
                          "upstream_timeout", cut=True)


class Phase(enum.IntEnum):
    """Where a request is in its lifecycle (see the module docstring). Integers, so a
    move's check costs what an int's hash does (every request makes three)."""

    NEW = 0  # made, not arrived
    QUEUED = 1  # waiting in its pool's admission queue
    TRYING = 2  # copies sent, none committed: retries and the hedge's race
    STREAMING = 3  # one copy committed: its answer is the client's
    ENDED = 4
    MOVING = 5  # streaming, and a continuation is on its way to another node


MOVES: Mapping[Phase, frozenset[Phase]] = {
    Phase.NEW: frozenset({Phase.QUEUED, Phase.TRYING, Phase.ENDED}),
    Phase.QUEUED: frozenset({Phase.TRYING, Phase.ENDED}),
    Phase.TRYING: frozenset({Phase.STREAMING, Phase.ENDED}),
    Phase.STREAMING: frozenset({Phase.MOVING, Phase.ENDED}),
    Phase.MOVING: frozenset({Phase.STREAMING, Phase.ENDED}),
    Phase.ENDED: frozenset(),
}


# Compiled (tailguard/_compiled.py); drivers and tests may still subclass it
# (``exchange_type``: the gateway's and the endpoint picker's tracing tests do).
@mypyc_attr(allow_interpreted_subclasses=True)
class Exchange:
    """The lifecycle of one request; see the module docstring."""

    # No __slots__: the fields below that most requests never change are class
    # defaults, so making an exchange sets six attributes, not nineteen (the
    # simulator makes one per request).
    phase = Phase.NEW
    t_arrival = 0.0
    attempts = 0  # copies sent that were not the hedge
    waiter: Waiter | None = None  # its place in the queue while QUEUED
    committed: Copy | None = None  # the copy whose answer the client gets
    served = False  # a node answered it (2xx)
    hedged = False
    hedge_result: str | None = None  # won | lost | failed, once a hedge went out
    verdict: tuple[str, int] | None = None  # (node | request | unknown, 5xx count)
    ended: str | None = None  # once ENDED: ok | client_error | failed | shed | client_gone
    _pending_5xx: list[str] | None = None  # nodes whose 5xx waits for a second opinion
    _timer_at = 0.0
    moves = 0  # continuations sent (mid-stream migrations)
    move_causes: list[str] | None = None  # why each was sent
    move_result: str | None = None  # moved | resumed | failed | gone, for the last one

    def __init__(self, balancer: Balancer, request: Request, retries: RetryConfig | None = None,
                 budget: RetryBudget | None = None, hedger: Hedger | None = None,
                 tag: Any = None, *, hedge: bool = True, migrate: bool = True) -> None:
        """The retry rule, budget and hedger are the request's pool's unless given
        (a request for a model no pool serves gets the defaults, and no hedge).
        ``hedge`` False: the driver cannot send a duplicate; ``migrate`` False: it
        cannot splice a continuation into a started answer (the endpoint picker)."""
        self.balancer = balancer
        self.request = request
        pool = balancer.pools.get(request.model)
        if retries is None:
            retries = pool.config.retries if pool is not None else RetryConfig()
        if budget is None:
            budget = pool.budget if pool is not None else retries.new_budget()
        if hedger is None and pool is not None and hedge:
            hedger = pool.hedger
        self.retries = retries
        self.budget = budget
        self.hedger = hedger if request.stream else None
        # Only a stream moves (anything else commits with its whole answer).
        self.migration: MigrationConfig | None = None
        if pool is not None and request.stream and migrate and pool.config.migration.enabled:
            self.migration = pool.config.migration
            self.move_budget = pool.moves
        self.tag = tag  # the driver's own (the simulator's request id, the gateway's future)
        self.copies: list[Copy] = []

    # -- events ---------------------------------------------------------------------

    def arrive(self, now: float) -> tuple[Action, ...]:
        """The request arrived: admission, and the first copy or a wait in the queue."""
        self.t_arrival = now
        self.budget.deposit()
        if self.hedger is not None:
            self.hedger.on_request()
        if self.migration is not None:
            self.move_budget.deposit()
        b = self.balancer
        r = self.request
        pool = b.pools.get(r.model)
        got: Ticket | Waiter | Shed | None
        if pool is not None and pool.limited:
            got = b.admit(r.model, r.prompt_tokens, now, r.max_tokens, r.priority, r.exclude,
                          ttft_s=r.ttft_s, size_bytes=r.size_bytes, payload=self,
                          prefix=r.prefix, session=r.session)
            if isinstance(got, Waiter):
                self._to(Phase.QUEUED)
                self.waiter = got
                return (Queue(got),)
            if isinstance(got, Shed):
                return self._refuse(got)
        else:
            got = b.pick(r.model, r.prompt_tokens, now, r.max_tokens, r.priority, r.exclude,
                         r.prefix, r.session)
        if got is None:
            return self._no_capacity()
        return self._first_attempt(got, now)

    def queue_decision(self, decision: Ticket | Shed, now: float) -> tuple[Action, ...]:
        """The balancer's queue placed the request on a node, or shed it."""
        self.waiter = None
        if self.phase is not Phase.QUEUED:  # it left meanwhile: give the permit back
            if isinstance(decision, Ticket):
                self.balancer.on_finish(decision, now, Outcome.CLIENT_CANCELLED, 0)
            return NONE
        if isinstance(decision, Shed):
            return self._refuse(decision)
        return self._first_attempt(decision, now)

    def sent(self, copy: Copy, now: float) -> tuple[Action, ...]:
        """``copy`` left for its node: the hedge's clock starts with the first copy sent."""
        h = self.hedger
        if h is None or self.hedged or copy.hedge or copy.state != SENT \
                or self.phase is not Phase.TRYING or copy.prefill_node is not None:
            return NONE  # (a disaggregated request is not hedged)
        after = h.hedge_after(copy.ticket.node.spec.gpu_class, self._expected(copy.ticket))
        if after is None:
            return NONE
        self._timer_at = now + after
        return (ArmTimer(self._timer_at),)

    def timer(self, now: float) -> tuple[Action, ...]:
        """An armed timer fired: perhaps send the hedge."""
        h = self.hedger
        if h is None or self.hedged or self.phase is not Phase.TRYING or now < self._timer_at:
            return NONE  # stale: the race was decided, or the timer was moved
        primary = self._live()
        if primary is None:
            return NONE
        node = primary.ticket.node
        cls = node.spec.gpu_class
        after = h.hedge_after(cls, self._expected(primary.ticket)) or 0.0
        if not h.silent(node.id, now, after, cls, node.overdue_s(now)):
            # Its node is busy answering others: look again later (a stall may begin).
            self._timer_at = now + max(after, h.config.min_after_s)
            return (ArmTimer(self._timer_at),)
        if not h.try_hedge():
            return NONE
        r = self.request
        ticket = self.balancer.pick(r.model, r.prompt_tokens, now, r.max_tokens, r.priority,
                                    self._avoid(), r.prefix, r.session)  # a node not tried yet
        if ticket is None:
            h.refund()
            return NONE
        if not self._has_time(ticket, now):
            self.balancer.on_finish(ticket, now, Outcome.CLIENT_CANCELLED, 0)
            h.refund()
            return NONE
        self.hedged = True
        return (self._dispatch(ticket, now, None, True),)

    def first_chunk(self, copy: Copy, now: float, *, served: bool = True,
                    defer_prefill: bool = False) -> tuple[Action, ...]:
        """``copy``'s first chunk arrived (its first token): it is committed.

        ``served``: a 2xx answer (False for an error the engine streams).
        ``defer_prefill``: the cached-token count comes with the finish
        (:meth:`Balancer.on_first_token`). A late chunk of a cancelled copy is
        ignored (empty answer; the driver has been told to cancel it).
        """
        if copy.state != SENT or (self.phase is not Phase.TRYING
                                  and self.phase is not Phase.MOVING):
            return NONE
        return self._commit(copy, now, served, True, defer_prefill)

    def prefilled(self, copy: Copy, now: float) -> tuple[Action, ...]:
        """``copy``'s prefill leg answered: its prompt is computed and its KV held
        for the decode node, which the returned :class:`Decode` sends it to."""
        if copy.state != SENT or (self.phase is not Phase.TRYING
                                  and self.phase is not Phase.MOVING) \
                or not self.balancer.hand_off(copy.ticket, now):
            return NONE
        return (Decode(copy),)

    def prefill_failed(self, copy: Copy, now: float, failure: Failure, *,
                       final: bool = False) -> tuple[Action, ...]:
        """``copy``'s prefill leg failed: charged to the prefill node, the decode
        node's permit given back uncharged, and a retry (to a pair without that
        prefill node) or the failure, as :meth:`failed`."""
        pre = copy.ticket.prefill
        if copy.state != SENT or self.phase is Phase.ENDED or pre is None:
            return NONE
        b = self.balancer
        copy.at_prefill = True
        self._drop(copy, now, failure, pre)
        b.on_finish(copy.ticket, now, Outcome.CLIENT_CANCELLED, 0)
        return self._after_drop(copy, now, failure, pre.node.id, final)

    def failed(self, copy: Copy, now: float, failure: Failure, output_tokens: int = 0,
               cached_tokens: int | None = None, *, final: bool = False) -> tuple[Action, ...]:
        """``copy`` failed: before its first chunk, retry or fail; after it, fail.

        ``final``: no retry whatever is left (the endpoint picker learns of a
        failure only once the data plane has run out of fallbacks)."""
        if copy.state == ENDED or self.phase is Phase.ENDED:
            return NONE
        if copy.ticket.prefill is not None:  # still in its prefill leg
            return self.prefill_failed(copy, now, failure, final=final)
        b = self.balancer
        # Cut short by the request's deadline: the node had no time of its own to fail.
        origin = Outcome.CLIENT_CANCELLED if failure.cut else failure.origin
        if copy.state == COMMITTED:
            copy.state = ENDED
            b.on_finish(copy.ticket, now, origin, output_tokens, judged=failure.judged,
                        timed=False, cached_tokens=cached_tokens)
            if self.phase is Phase.MOVING:
                return NONE  # its continuation is on its way
            cfg = self.migration
            if cfg is not None and cfg.on_failure and not failure.cut and not final:
                moved = self._move(now, (copy.after or 0) + output_tokens, "failure")
                if moved:
                    return moved
            return self._fail(failure, copy.node_id, True)
        self._drop(copy, now, failure, copy.ticket)
        return self._after_drop(copy, now, failure, copy.node_id, final)

    def _after_drop(self, copy: Copy, now: float, failure: Failure, node_id: str,
                    final: bool) -> tuple[Action, ...]:
        """An uncommitted copy failed on ``node_id``: the race goes on, a retry, or the end."""
        b = self.balancer
        if self.phase is Phase.MOVING:
            return self._continuation_failed(copy, now, failure)
        if self._live() is not None:
            return NONE  # the other copy races on
        r = self.request
        if not final and not failure.cut and self._time_left(now) > 0.0 \
                and self.attempts < self.retries.attempts and self.budget.try_spend(now):
            ticket = b.pick(r.model, r.prompt_tokens, now, r.max_tokens, r.priority,
                            self._avoid(), r.prefix, r.session)
            if ticket is not None:
                if self._has_time(ticket, now):
                    return (self._dispatch(ticket, now, failure.origin, False),)
                b.on_finish(ticket, now, Outcome.CLIENT_CANCELLED, 0)  # never sent
                failure = Failure(failure.origin, 504, f"{failure.message}; too little of the "
                                  "request's time is left for another attempt",
                                  "upstream_timeout", judged=failure.judged)
        return self._fail(failure, node_id, False)

    def fallbacks(self, now: float) -> list[str]:
        """Where a retry would go now, in order, taking no permit: the nodes not
        tried yet, as many as ``RetryConfig.attempts`` leaves, none when the retry
        budget has nothing to spend. An endpoint picker's fallback list."""
        r = self.request
        n = self.retries.attempts - self.attempts
        if n <= 0 or not self.budget.can_spend(now):
            return []
        return self.balancer.rank(r.model, r.prompt_tokens, now, r.max_tokens, r.priority,
                                  self._avoid(), n, r.prefix, r.session)

    def redirected(self, copy: Copy, node_id: str, now: float,
                   failure: Failure) -> tuple[Action, ...]:
        """The data plane gave up on ``copy`` before its first byte and sent the
        request to ``node_id`` itself (a fallback of :meth:`fallbacks`): ``copy``
        failed with ``failure``, and a retry copy on ``node_id`` holds a permit
        there whatever its load (the request is there already). Its
        :class:`Dispatch` is the driver's to note, not to send. An unknown
        ``node_id`` ends the exchange: no node of the fleet serves it."""
        if copy.state != SENT or self.phase is not Phase.TRYING:
            return NONE
        self._drop(copy, now, failure, copy.ticket)
        self.budget.try_spend(now)  # it happened anyway: the budget learns of it
        r = self.request
        ticket = self.balancer.take(r.model, node_id, r.prompt_tokens, now, r.prefix)
        if ticket is None:
            return self._fail(failure, copy.node_id, False)
        return (self._dispatch(ticket, now, failure.origin, False),)

    def finished(self, copy: Copy, now: float, outcome: Outcome, output_tokens: int, *,
                 timed: bool = True, cached_tokens: int | None = None) -> tuple[Action, ...]:
        """``copy``'s answer is complete: ``Outcome.OK``, or ``CLIENT_ERROR`` for an
        engine's own 4xx passed on. A complete answer with no first chunk before
        (not streamed, or a one-token stream) commits it here."""
        if copy.state == ENDED or self.phase is Phase.ENDED:
            return NONE
        actions = NONE
        if self.phase is Phase.MOVING and copy.state == COMMITTED:
            actions = self.resumed(copy, now)  # the stalled copy came back, to its end
        if copy.state == SENT:
            actions = self._commit(copy, now, outcome is Outcome.OK, self.request.stream, False)
        copy.state = ENDED
        self.balancer.on_finish(copy.ticket, now, outcome, output_tokens, timed=timed,
                                cached_tokens=cached_tokens)
        if self.hedger is not None:
            self.hedger.on_progress(copy.node_id, now)
        self._end("ok" if outcome is Outcome.OK else "client_error")
        return actions

    def stream_ended(self, copy: Copy, now: float, *, tokens: int, data: bool = True,
                     engine_error: bool = False, cached_tokens: int | None = None,
                     timed: bool = True, final: bool = False) -> StreamEnd:
        """``copy``'s stream ended cleanly at the transport (the driver's own failures,
        a reset or a timeout, go to :meth:`failed`), after ``tokens`` output tokens;
        ``data``: any data came at all; ``engine_error``: its last event was the
        engine's own error. The core classifies it: served, an empty stream or an
        engine error (both unjudged 5xx: the request may have caused them).
        ``final`` as for :meth:`failed`."""
        if not data:
            return StreamEnd(self.failed(copy, now, EMPTY_STREAM, final=final), EMPTY_STREAM,
                             None, Outcome.UPSTREAM_5XX.value)
        if engine_error:
            return StreamEnd(self.failed(copy, now, ENGINE_ERROR, tokens, cached_tokens,
                                         final=final), ENGINE_ERROR, None, "engine_error")
        actions = self.finished(copy, now, Outcome.OK, tokens, timed=timed,
                                cached_tokens=cached_tokens)
        return StreamEnd(actions, None, client_tpot(copy.ticket.t_first, now, tokens))

    def streaming(self, copy: Copy, tokens: int, now: float) -> float:
        """``tokens`` of ``copy``'s committed stream have arrived by ``now`` (the
        detector judges long answers piece by piece); returns when to tell again."""
        if copy.state != COMMITTED or self.phase is not Phase.STREAMING:
            return math.inf
        return self.balancer.on_stream_progress(copy.ticket, tokens, now)

    def review(self, copy: Copy, now: float, tokens: int, silent_s: float) -> tuple[Action, ...]:
        """The driver's look at the committed stream of ``copy``: ``tokens`` of its own
        sent so far, none for ``silent_s``. A :class:`Migrate` when it is stalled (silent
        for :meth:`stall_after` or more) or its node left healthy service while it
        streamed with enough of the answer left (see :mod:`tailguard.core.migration`).
        Drivers call it when a stream has been silent for :meth:`stall_after`, and
        when they tell :meth:`streaming`."""
        cfg = self.migration
        if cfg is None or self.phase is not Phase.STREAMING or copy.state != COMMITTED \
                or copy is not self.committed:
            return NONE
        state = copy.ticket.node.state
        after = (copy.after or 0) + tokens
        if cfg.on_stall and silent_s > 0.0 and silent_s >= self.stall_after(copy):
            return self._move(now, after, "stall")
        if not cfg.on_node_state or not (state in LEAVE_NOW or (
                cfg.on_degraded and state is NodeState.DEGRADED
                and copy.was is not NodeState.DEGRADED)):
            return NONE
        left = self._left(copy, tokens)
        if left < cfg.min_remaining_tokens:
            return NONE
        if left == math.inf:  # an answer of unknown length: what an answer has left on average
            left = max(copy.ticket.pool.mean_output - after, float(cfg.min_remaining_tokens))
        # Where it streams still, it stays unless the move is expected to end it sooner:
        # its own pace so far against the pick's first token and pace.
        pace = (now - copy.ticket.t_first) / max(tokens, 1)
        return self._move(now, after, state.value, (left, left * pace))

    def stall_after(self, copy: Copy) -> float:
        """Seconds without a token after which ``copy``'s stream counts as stalled
        (``math.inf`` where streams do not move on stalls): ``stall_factor`` times
        the longest step its node's engine takes when healthy
        (:meth:`~tailguard.core.pool.Ticket.longest_step_s`), never under
        ``stall_floor_s``."""
        cfg = self.migration
        if cfg is None or not cfg.on_stall:
            return math.inf
        return max(cfg.stall_floor_s, cfg.stall_factor * copy.ticket.longest_step_s())

    def silent(self, copy: Copy, since: float, now: float) -> None:
        """``copy``'s committed stream sent nothing from ``since`` to ``now``, a gap of
        at least :data:`~tailguard.core.fleet.STALL_S` (drivers tell no shorter one):
        its node may have stalled with no prompt waiting
        (:meth:`Balancer.on_stream_silence`). A gap that began before the copy's first
        token (a continuation's handover) is not its node's."""
        if copy.state == COMMITTED and copy is self.committed \
                and since >= copy.ticket.t_first >= 0.0:
            self.balancer.on_stream_silence(copy.ticket, since, now)

    def resumed(self, copy: Copy, now: float) -> tuple[Action, ...]:
        """The moved ``copy`` sent data again before its continuation's first token.

        After a stall it wins their race (a token in hand beats a continuation
        that may queue for its first on a fleet short of the stalled node): the
        continuation is cancelled and the stream goes on from ``copy``. A stream
        moved because its node left healthy service still flows, so its next
        chunk is no sign the node recovered: the continuation carries on, ``copy``
        ends (:class:`Cancel`) and the driver drops what it sent, so the client
        never holds more than the continuation was asked to follow."""
        if self.phase is not Phase.MOVING or copy is not self.committed \
                or copy.state != COMMITTED:
            return NONE
        causes = self.move_causes
        cont = self._live()
        if cont is not None and causes is not None and causes[-1] != "stall":
            copy.state = ENDED
            self.balancer.on_finish(copy.ticket, now, Outcome.CLIENT_CANCELLED,
                                    (cont.after or 0) - (copy.after or 0), timed=False)
            return (Cancel(copy),)
        self._to(Phase.STREAMING)
        self.move_result = "resumed"
        out = []
        for c in self.copies:
            if c.state == SENT:
                c.state = ENDED
                self.balancer.on_finish(c.ticket, now, Outcome.CLIENT_CANCELLED, 0)
                out.append(Cancel(c))
        return tuple(out)

    def client_gone(self, now: float, output_tokens: int = 0,
                    cached_tokens: int | None = None) -> tuple[Action, ...]:
        """The client left (disconnected, or read too slowly): stop everything."""
        if self.phase is Phase.ENDED:
            return NONE
        if self.phase is Phase.MOVING:
            self.move_result = "gone"  # its client left before the continuation took over
        b = self.balancer
        if self.waiter is not None:
            b.cancel_queued(self.waiter)
            self.waiter = None
        out: list[Action] = []
        for c in self.copies:
            if c.state == ENDED:
                continue
            if c.state == COMMITTED:
                b.on_finish(c.ticket, now, Outcome.CLIENT_CANCELLED, output_tokens, timed=False,
                            cached_tokens=cached_tokens)
            else:
                b.on_finish(c.ticket, now, Outcome.CLIENT_CANCELLED, 0)
                out.append(Cancel(c))
            c.state = ENDED
        self._end("client_gone")
        return tuple(out)

    # -- what drivers read ----------------------------------------------------------

    @property
    def tried(self) -> list[str]:
        """The nodes tried so far, in order (the hedge's included)."""
        return [c.ticket.node.id for c in self.copies]

    def move_outcomes(self) -> list[tuple[str, str]]:
        """Each move's cause with how the request's last move ended (``failed`` where
        none took over): what the pool's tally and the gateway's metric count."""
        result = self.move_result or "failed"
        return [(cause, result) for cause in self.move_causes or ()]

    @property
    def in_flight(self) -> int:
        """Copies holding a permit now."""
        return sum(1 for c in self.copies if c.state != ENDED)

    # -- inside ---------------------------------------------------------------------

    def _avoid(self) -> list[str]:
        """Where a retry or the hedge must not go: the nodes tried (for a copy whose
        prefill leg failed, its prefill node), and those excluded."""
        tried = [c.prefill_node if c.at_prefill and c.prefill_node else c.ticket.node.id
                 for c in self.copies]
        return [*self.request.exclude, *tried] if self.request.exclude else tried

    def _dispatch(self, ticket: Ticket, now: float, retry_of: Outcome | None,
                  hedge: bool) -> Dispatch:
        self._to(Phase.TRYING)
        c = Copy(ticket, hedge)
        self.copies.append(c)
        if not hedge:
            self.attempts += 1
        within = None
        if not self.request.stream:  # no first token to see: the core presumes one
            self.balancer.expect_no_first_token(ticket, now)
            within = self._attempt_bound(ticket, now)
        return Dispatch(c, retry_of, within)

    def _first_attempt(self, ticket: Ticket, now: float) -> tuple[Action, ...]:
        """The first copy, unless the request's time ran out before it could start (it
        waited in the queue past the time its first token needs)."""
        if self._time_left(now) > self._needs_s(ticket, 0.0):
            return (self._dispatch(ticket, now, None, False),)
        self.balancer.on_finish(ticket, now, Outcome.CLIENT_CANCELLED, 0)  # never sent
        self._end("failed")
        return (Fail(DEADLINE_PASSED, ticket.node.id, False),)

    def _time_left(self, now: float) -> float:
        deadline = self.request.deadline
        return math.inf if deadline is None else deadline - now

    def _needs_s(self, ticket: Ticket, answer_tokens: float) -> float:
        """What the ticket's node is expected to take: to the first token, and then
        ``answer_tokens`` more (the roofline with the class's learned slowdowns)."""
        node = ticket.node
        # The prediction the balancer made at dispatch (its overdue allowance), after
        # the prefill leg's where the prompt is computed elsewhere.
        ttft = ticket.allowance / OVERDUE_FACTOR
        if ticket.prefill is not None:
            ttft += ticket.prefill.allowance / OVERDUE_FACTOR
        if answer_tokens <= 0.0:
            return ttft
        pool = ticket.pool
        step = decode_step_s(node.perf, ticket.running(),
                             pool.mean_prompt + pool.mean_output * 0.5)
        return ttft + answer_tokens * step * node.class_decode_slowdown

    def _has_time(self, ticket: Ticket, now: float) -> bool:
        """Whether an attempt on the ticket's node could plausibly do its part in the
        request's time: its first token (streamed), its whole answer (not)."""
        left = self._time_left(now)
        if left == math.inf:
            return True
        r = self.request
        answer = 0.0
        if not r.stream:
            answer = ticket.pool.mean_output
            if r.max_tokens is not None:
                answer = min(answer, float(r.max_tokens))
        return left > self._needs_s(ticket, answer)

    def _attempt_bound(self, ticket: Ticket, now: float) -> float | None:
        """A non-streamed attempt's own bound in seconds (None: the deadline's)."""
        r = self.request
        longest = (float(r.max_tokens) if r.max_tokens is not None
                   else UNBOUNDED_ANSWERS * max(ticket.pool.mean_output, 1.0))
        bound = max(ATTEMPT_FLOOR_S, ATTEMPT_MARGIN * self._needs_s(ticket, longest))
        return bound if bound < self._time_left(now) else None

    def _drop(self, copy: Copy, now: float, failure: Failure, ticket: Ticket) -> None:
        """An uncommitted copy failed on ``ticket``'s node (its own, or its prefill
        leg's): that permit back, charged unless the deadline cut it, a 5xx kept
        for a verdict."""
        copy.state = ENDED
        if failure.cut:  # the node had no time of its own to fail
            self.balancer.on_finish(ticket, now, Outcome.CLIENT_CANCELLED, 0)
            return
        self.balancer.on_finish(ticket, now, failure.origin, 0, judged=failure.judged)
        if not failure.judged:
            if self._pending_5xx is None:
                self._pending_5xx = []
            self._pending_5xx.append(ticket.node.id)
        if copy.hedge:
            self.hedge_result = "failed"

    def _left(self, copy: Copy, tokens: int) -> float:
        """Answer tokens still to come after ``tokens`` of ``copy``'s (unbounded: inf)."""
        r = self.request
        if r.max_tokens is None:
            return math.inf
        return r.max_tokens - (copy.after or 0) - tokens

    def _move(self, now: float, tokens: int, cause: str,
              stay: tuple[float, float] | None = None) -> tuple[Action, ...]:
        """A continuation after ``tokens`` answer tokens, to the node the policy picks
        for the prompt plus those tokens (not one tried), within the request's
        limit, the pool's budget and the request's time; none: nothing. ``stay``:
        the answer tokens left and the seconds they would take where they are; the
        continuation must be expected to take less."""
        cfg = self.migration
        r = self.request
        if cfg is None or self.moves >= cfg.max_per_request or self._time_left(now) <= 0.0:
            return NONE
        left = None
        if r.max_tokens is not None:
            left = r.max_tokens - tokens
            if left < 1:
                return NONE
        if not self.move_budget.try_spend(now):
            return NONE
        b = self.balancer
        ticket = b.pick(r.model, r.prompt_tokens + tokens, now, left, r.priority, self._avoid(),
                        r.prefix, r.session)
        if ticket is None or not self._has_time(ticket, now) \
                or (stay is not None and self._needs_s(ticket, stay[0]) >= stay[1]):
            if ticket is not None:
                b.on_finish(ticket, now, Outcome.CLIENT_CANCELLED, 0)  # never sent
            self.move_budget.refund()
            return NONE
        self.moves += 1
        self._to(Phase.MOVING)
        c = Copy(ticket, False)
        c.after = tokens
        self.copies.append(c)
        if self.move_causes is None:
            self.move_causes = []
        self.move_causes.append(cause)
        return (Migrate(c, tokens, cause),)

    def _continuation_failed(self, copy: Copy, now: float,
                             failure: Failure) -> tuple[Action, ...]:
        """``copy``, a continuation, failed before its first token: another one, or
        back to the stalled copy while it lives, or the end of the stream."""
        moved = self._move(now, copy.after or 0, "failure")
        if moved:
            return moved
        old = self.committed
        if old is not None and old.state == COMMITTED:
            self._to(Phase.STREAMING)
            self.move_result = "failed"
            return NONE
        self.move_result = "failed"
        return self._fail(failure, copy.node_id, True)

    def _live(self) -> Copy | None:
        for c in self.copies:
            if c.state == SENT:
                return c
        return None

    def _commit(self, copy: Copy, now: float, served: bool, first_token: bool,
                defer_prefill: bool) -> tuple[Action, ...]:
        prev = self.committed if self.phase is Phase.MOVING else None
        self._to(Phase.STREAMING)
        copy.state = COMMITTED
        self.committed = copy
        ticket = copy.ticket
        copy.was = ticket.node.state
        if first_token:
            self.balancer.on_first_token(ticket, now, defer_prefill=defer_prefill)
        out: tuple[Action, ...] = NONE
        if copy.after is not None:  # a continuation: it takes over from the stream it moves
            self.move_result = "moved"
            if prev is not None and prev.state == COMMITTED:  # stalled, still held: cancelled
                prev.state = ENDED
                self.balancer.on_finish(prev.ticket, now, Outcome.CLIENT_CANCELLED,
                                        copy.after - (prev.after or 0), timed=False)
                out = (Cancel(prev),)
            if served:
                self.served = True
            return out
        if len(self.copies) > 1:
            losers = []
            for c in self.copies:
                if c.state == SENT:  # lost the race
                    c.state = ENDED
                    self.balancer.on_finish(c.ticket, now, Outcome.CLIENT_CANCELLED, 0)
                    losers.append(Cancel(c))
                    self.hedge_result = "won" if copy.hedge else "lost"
            out = tuple(losers)
        h = self.hedger
        if h is not None:
            h.on_progress(ticket.node.id, now)
            if first_token:
                h.on_ttft(ticket.node.spec.gpu_class, now - ticket.t_dispatch,
                          self._expected(ticket))
            if copy.hedge:
                h.wins += 1
                self.hedge_result = "won"
        if served:
            self.served = True
            pending = self._pending_5xx
            if pending:  # the earlier 5xx answers were their nodes' own
                for node_id in pending:
                    self.balancer.blame(node_id, Outcome.UPSTREAM_5XX, now)
                self.verdict = ("node", len(pending))
                self._pending_5xx = None
        return out

    def _refuse(self, shed: Shed) -> tuple[Action, ...]:
        self._end("shed")
        return (Refuse(shed),)

    def _no_capacity(self) -> tuple[Action, ...]:
        failure = Failure(Outcome.CONNECT_FAILURE, 503,
                          f"no node can take a request for {self.request.model!r} now",
                          NO_CAPACITY, RETRY_AFTER_S)
        self._end("failed")
        return (Fail(failure, None, False),)

    def _fail(self, failure: Failure, node_id: str, committed: bool) -> tuple[Action, ...]:
        pending = self._pending_5xx
        if pending and not committed:
            nodes = list(dict.fromkeys(pending))
            if len(nodes) >= 2:
                self.verdict = ("request", len(pending))
                failure = Failure(failure.origin, failure.status,
                                  f"nodes {', '.join(nodes)} all failed this request (last: "
                                  f"{failure.message}); the request itself is the likely cause",
                                  failure.code, failure.retry_after, failure.judged)
            else:
                # One 5xx, no second opinion: not charged. The retry budget gives
                # enough second opinions to catch a node failing every request.
                self.verdict = ("unknown", len(pending))
            self._pending_5xx = None
        self._end("failed")
        return (Fail(failure, node_id, committed),)

    def _to(self, phase: Phase) -> None:
        if phase is not self.phase:
            if phase not in MOVES[self.phase]:
                raise RuntimeError(f"exchange moved from {self.phase.name} to {phase.name}")
            self.phase = phase

    def _end(self, how: str) -> None:
        if self.phase is Phase.ENDED:
            raise RuntimeError(f"exchange ended twice ({self.ended}, then {how})")
        self._to(Phase.ENDED)
        self.ended = how
        if self.moves:
            tally = self.copies[0].ticket.pool.moved
            for cause, result in self.move_outcomes():
                key = f"{cause}/{result}"
                tally[key] = tally.get(key, 0) + 1
        if self._pending_5xx:  # ended without another node's answer (gone, or a 4xx)
            self.verdict = ("unknown", len(self._pending_5xx))
            self._pending_5xx = None

    def _expected(self, ticket: Ticket) -> float | None:
        """The ticket's expected TTFT when the hedge delay is per request."""
        h = self.hedger
        if h is None:
            return None
        cfg = h.config
        return ticket.expected_ttft() if cfg.per_request and cfg.after_s <= 0.0 else None


def pump(balancer: Balancer, now: float) -> list[tuple[Exchange, tuple[Action, ...]]]:
    """The queue's decisions since the last call, each handed to its exchange.

    Drivers call it when the balancer signals queue decisions, after a permit
    or a prompt backlog freed, and periodically while anything is queued. A
    ticket given back while handing them out (its client left, or its time ran
    out) frees room at once: the queue is polled again, so that what it decides
    then is handed out now, not after the fleet has changed again.
    """
    out = []
    while True:
        freed = False
        for waiter, decision in balancer.poll_queue(now):
            ex = waiter.payload
            if isinstance(ex, Exchange):
                actions = ex.queue_decision(decision, now)
                out.append((ex, actions))
                freed |= isinstance(decision, Ticket) and not any(
                    type(a) is Dispatch for a in actions)
            elif isinstance(decision, Ticket):  # queued by no exchange: nobody to give it to
                balancer.on_finish(decision, now, Outcome.CLIENT_CANCELLED, 0)
                freed = True
        if not freed:
            return out


__all__ = [
    "COMMITTED",
    "ENDED",
    "MOVES",
    "NO_CAPACITY",
    "RETRY_AFTER_S",
    "SENT",
    "Action",
    "ArmTimer",
    "Cancel",
    "Copy",
    "Decode",
    "Dispatch",
    "Exchange",
    "Fail",
    "Failure",
    "Migrate",
    "Phase",
    "Queue",
    "Refuse",
    "Request",
    "RetryConfig",
    "StreamEnd",
    "pump",
]
