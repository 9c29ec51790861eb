"""Admission: a request through its pool's queue, late binding onto freed permits,
non-streamed prompts presumed prefilled, and a reloaded pool's queued requests.

:class:`Admission` owns what spans the pools: the outbox of queue decisions the
driver collects (:meth:`Admission.poll`), the heap of non-streamed prompts
waiting to be presumed prefilled, the waiters' sequence numbers and the chunk
budgets placement caches. Each pool owns its own queue
(:class:`~tailguard.core.admission.AdmissionQueue`). The routing decision is
passed in (``pick``: the balancer's unrecorded pick), so admission never
reaches into the balancer; recording is the balancer's, around its public
calls. Which nodes a queued request may not go to is
:mod:`tailguard.core.placement`'s.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from tailguard.core.admission import Shed, Waiter
from tailguard.core.limit_plan import node_limiter
from tailguard.core.placement import ChunkCache, unsuitable
from tailguard.core.pool import Pool, Ticket

Decision = tuple[Waiter, Ticket | Shed]


class PickFn(Protocol):
    """The balancer's routing decision, unrecorded (its arguments as ``Balancer.pick``'s)."""

    def __call__(self, model: str, prompt_tokens: int, now: float, max_tokens: int | None,
                 priority: int, exclude: Sequence[str], prefix: Sequence[int],
                 session: str | None) -> Ticket | None: ...


class Admission:
    """The admission of every pool of one balancer (see the module docstring)."""

    __slots__ = ("_chunks", "_decisions", "_draining", "_pick", "_pools", "_presumed",
                 "_waiter_seq", "on_decision")

    def __init__(self, pools: Mapping[str, Pool], pick: PickFn) -> None:
        self._pools = pools
        self._pick = pick
        self._waiter_seq = 0
        # Non-streamed tickets by the time their prompt is presumed prefilled.
        self._presumed: list[tuple[float, int, Ticket]] = []
        self._decisions: list[Decision] = []
        self._chunks: ChunkCache = {}
        # A drain under way: the pick it makes settles presumed prompts too, and the
        # backlog they free is the drain's to use, not a second drain's inside it.
        self._draining = False
        # Called (no arguments) when decisions await poll: lets an event-loop
        # driver wake its queued requests without polling.
        self.on_decision: Callable[[], None] | None = None

    def admit(self, model: str, prompt_tokens: int, now: float, max_tokens: int | None,
              priority: int, exclude: Sequence[str], ttft_s: float | None, size_bytes: int,
              payload: Any, prefix: Sequence[int],
              session: str | None) -> Ticket | Waiter | Shed | None:
        """A Ticket (dispatched now), a Waiter (queued), a Shed (answer 429 now) or
        None (no routable node: as ``pick``).

        Without limits on the pool this is exactly ``pick``. A queued request's
        decision comes later from :meth:`poll`, which the driver calls after
        every finish and periodically; ``payload`` is the driver's own handle for
        it. ``ttft_s`` overrides the pool's TTFT SLO for the deadline (header
        ``x-slo-ttft-ms``).
        """
        self.settle(now)
        pool = self._pools.get(model)
        if pool is None or not pool.limited:
            return self._pick(model, prompt_tokens, now, max_tokens, priority, exclude, prefix,
                              session)
        queue = pool.queue
        if queue is not None:
            queue.on_arrival(min(max(priority, 0), 2), now)
        deadline = now + (ttft_s if ttft_s is not None else pool.config.slo.ttft_s)
        # Try at once unless a request of the same or higher priority waits:
        # lower priorities queued behind their share leave the reserve free.
        if queue is None or sum(queue.by_priority[: min(max(priority, 0), 2) + 1]) == 0:
            avoid = exclude if queue is None else unsuitable(
                pool, prompt_tokens, priority, deadline - now, exclude, now, self._chunks)
            ticket = self._pick(model, prompt_tokens, now, max_tokens, priority, avoid, prefix,
                                session)
            if ticket is not None:
                return ticket
        if not any(n.id not in exclude for n in pool.eligible()):
            return None
        if queue is None:
            return Shed("no_capacity", 1.0)
        self._waiter_seq += 1
        waiter = Waiter(model, prompt_tokens, max_tokens, priority, now, deadline, size_bytes,
                        exclude, payload, self._waiter_seq, prefix, session)
        shed, displaced = queue.offer(waiter, now)
        for w in displaced:
            self._decisions.append((w, Shed("displaced", queue.retry_after(now))))
        if displaced:
            self._notify()
        return shed if shed is not None else waiter

    def poll(self, now: float) -> list[Decision]:
        """Late binding: dispatch queued requests onto freed permits, shed expired ones.

        Returns every decision taken since the last call (also displacements
        made by :meth:`admit`), in order. Never raises for an empty queue.
        """
        self.settle(now)
        out = self._decisions
        self._decisions = []
        for pool in self._pools.values():
            if pool.queue is not None and pool.queue.length:
                self._drain(pool, now, out, scan=True)
        return out

    def cancel(self, waiter: Waiter) -> bool:
        """The client left while queued: drop it now. False if no longer queued."""
        pool = self._pools.get(waiter.model)
        return pool is not None and pool.queue is not None and pool.queue.cancel(waiter)

    def room_made(self, pool: Pool, now: float) -> None:
        """Something on ``pool`` freed room (a permit, a prompt's backlog): its waiters
        may go now."""
        queue = pool.queue
        if queue is not None and queue.length:
            self._drain(pool, now, self._decisions, scan=False)
            if self._decisions:
                self._notify()

    def carry(self, old: Pool, pool: Pool) -> None:
        """A reloaded pool keeps its queued requests (or sheds them without a queue)."""
        for node in pool.nodes:
            if pool.limited or node.limiter is not None:
                node.use_limiter(node_limiter(node, self._pools))
        if old.queue is None:
            return
        for waiter in old.queue.queued():
            old.queue.cancel(waiter)
            shed = Shed("no_capacity", 1.0)
            if pool.queue is not None:
                found, displaced = pool.queue.offer(waiter, waiter.arrival)
                for d in displaced:
                    self._decisions.append((d, Shed("displaced", 1.0)))
                if found is None:
                    continue
                shed = found
            waiter.state = "shed"
            self._decisions.append((waiter, shed))

    def expect_no_first_token(self, ticket: Ticket, now: float) -> bool:
        """The driver will not see ``ticket``'s first token (a non-streamed answer);
        False if that changes nothing (the ticket ended, or has one).

        Its prompt is then counted as prefilled once the node's predicted time
        to first token has passed (:meth:`Ticket.expected_ttft` times the node's
        learned prefill slowdown), instead of when the whole answer is done: the
        node's prompt backlog predicts the next requests' TTFT and admission, and
        a non-streamed answer would otherwise hold its prompt there for the
        whole generation. Nothing is learned from the presumed time.
        """
        if ticket.released or ticket.t_first >= 0.0 or ticket.presumed:
            return False
        # The learner's ratio is observed over expected TTFT: its inverse use.
        ttft = ticket.expected_ttft() * ticket.node.capacity.prefill_slowdown
        heapq.heappush(self._presumed, (ticket.t_dispatch + ttft, ticket.id, ticket))
        self.settle(now)
        return True

    def settle(self, now: float) -> None:
        """Count the prompts of non-streamed tickets whose presumed first token is due."""
        heap = self._presumed
        if not heap or heap[0][0] > now:  # the common case: nothing due
            return
        moved: set[str] = set()
        while heap and heap[0][0] <= now:
            ticket = heapq.heappop(heap)[2]
            if ticket.released or ticket.t_first >= 0.0:
                continue
            ticket.presumed = True
            node = ticket.node
            node.left_unanswered(math.inf, now)  # no longer awaited
            node.prompt_done(ticket.backlog, ticket.prompt_tokens, now)
            node.end_work(ticket.work, ticket.accrual, now)  # computed: counted where it ran
            moved.add(ticket.pool.name)
        for name in sorted(moved):  # a shorter backlog may admit a waiter
            pool = self._pools.get(name)
            if pool is not None and pool.queue is not None and pool.queue.length:
                self._drain(pool, now, self._decisions, scan=False)
        if moved and self._decisions:
            self._notify()

    def _drain(self, pool: Pool, now: float, out: list[Decision], scan: bool) -> None:
        if self._draining:  # its own pick settled presumed prompts: this drain goes on
            return
        self._draining = True
        try:
            self._drain_queue(pool, now, out, scan)
        finally:
            self._draining = False

    def _drain_queue(self, pool: Pool, now: float, out: list[Decision], scan: bool) -> None:
        queue = pool.queue
        assert queue is not None
        if scan:
            for late in queue.expire(now):
                out.append((late, Shed("expired", queue.retry_after(now))))
        while (w := queue.peek()) is not None:
            if queue.config.expire and queue.latest_start(w) <= now:
                queue.pop()
                w.state = "shed"
                queue.shed_total["expired"] = queue.shed_total.get("expired", 0) + 1
                out.append((w, Shed("expired", queue.retry_after(now))))
                continue
            avoid = unsuitable(pool, w.prompt_tokens, w.priority, w.deadline - now, w.exclude,
                               now, self._chunks)
            ticket = self._pick(w.model, w.prompt_tokens, now, w.max_tokens, w.priority, avoid,
                                w.prefix, w.session)
            if ticket is None:
                return
            queue.pop()
            w.state = "dispatched"
            out.append((w, ticket))

    def _notify(self) -> None:
        if self.on_decision is not None:
            self.on_decision()


__all__ = ["Admission", "Decision", "PickFn"]
