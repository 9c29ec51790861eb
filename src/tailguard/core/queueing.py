"""The balancer's admission: a request through the pool's queue (admit), late
binding onto freed permits (poll_queue), non-streamed prompts presumed
prefilled, and a reloaded pool's queued requests. Which nodes a queued request
may not go to is :mod:`tailguard.core.placement`'s.

Functions of the :class:`~tailguard.core.balancer.Balancer` (``b``), which
calls them from its methods of the same names.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tailguard.core.admission import Shed, Waiter
from tailguard.core.limit_plan import node_limiter
from tailguard.core.placement import unsuitable
from tailguard.core.pool import Pool, Ticket, decision_dict

if TYPE_CHECKING:
    from tailguard.core.balancer import Balancer

def admit(b: Balancer, model: str, prompt_tokens: int, now: float, max_tokens: int | None,
          priority: int, exclude: Sequence[str], ttft_s: float | None, size_bytes: int,
          payload: Any, prefix: Sequence[int],
          session: str | None) -> Ticket | Waiter | Shed | None:
    """Admit a request: a Ticket (dispatched now), a Waiter (queued), a Shed
    (answer 429 now) or None (no routable node: as ``pick``).

    Without limits on the pool this is exactly ``pick``. A queued request's
    decision comes later from :func:`poll_queue`, which the driver calls after
    every ``on_finish`` and periodically; ``payload`` is the driver's own
    handle for it. ``ttft_s`` overrides the pool's TTFT SLO for the deadline
    (header ``x-slo-ttft-ms``).
    """
    settle_presumed(b, now)
    pool = b.pools.get(model)
    if pool is None or not pool.limited:
        return b._pick(model, prompt_tokens, now, max_tokens, priority, exclude, prefix,
                          session)
    queue = pool.queue
    if queue is not None:
        queue.on_arrival(min(max(priority, 0), 2), now)
    deadline = now + (ttft_s if ttft_s is not None else pool.config.slo.ttft_s)
    # Try at once unless a request of the same or higher priority waits:
    # lower priorities queued behind their share leave the reserve free.
    if queue is None or sum(queue.by_priority[: min(max(priority, 0), 2) + 1]) == 0:
        avoid = exclude if queue is None else unsuitable(
            pool, prompt_tokens, priority, deadline - now, exclude, now, b._chunk_cache)
        ticket = b._pick(model, prompt_tokens, now, max_tokens, priority, avoid, prefix,
                            session)
        if ticket is not None:
            return ticket
    if not any(n.id not in exclude for n in pool.eligible()):
        return None
    if queue is None:
        return Shed("no_capacity", 1.0)
    b._waiter_seq += 1
    waiter = Waiter(model, prompt_tokens, max_tokens, priority, now, deadline, size_bytes,
                    exclude, payload, b._waiter_seq, prefix, session)
    shed, displaced = queue.offer(waiter, now)
    for w in displaced:
        b._queue_decisions.append((w, Shed("displaced", queue.retry_after(now))))
    if displaced and b.on_queue_decision is not None:
        b.on_queue_decision()
    return shed if shed is not None else waiter

def poll_queue(b: Balancer, now: float) -> list[tuple[Waiter, Ticket | Shed]]:
    """Late binding: dispatch queued requests onto freed permits, shed expired ones.

    Returns every decision taken since the last call (also displacements
    made by :meth:`admit`), in order. Never raises for an empty queue.
    """
    settle_presumed(b, now)
    out = b._queue_decisions
    b._queue_decisions = []
    for pool in b.pools.values():
        if pool.queue is not None and pool.queue.length:
            drain(b, pool, now, out, scan=True)
    if b.recorder is not None:
        b.recorder({"t": now, "op": "poll_queue", "decisions": [
            {"waiter": w.wid, **decision_dict(d)} for w, d in out]})
    return out

def cancel_queued(b: Balancer, waiter: Waiter) -> bool:
    """The client left while queued: drop it now. False if no longer queued."""
    if b.recorder is not None:
        b.recorder({"op": "cancel_queued", "waiter": waiter.wid})
    pool = b.pools.get(waiter.model)
    return pool is not None and pool.queue is not None and pool.queue.cancel(waiter)

def drain(b: Balancer, pool: Pool, now: float, out: list[tuple[Waiter, Ticket | Shed]],
          scan: bool) -> None:
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
                           now, b._chunk_cache)
        ticket = b._pick(w.model, w.prompt_tokens, now, w.max_tokens, w.priority, avoid,
                            w.prefix, w.session)
        if ticket is None:
            return
        queue.pop()
        w.state = "dispatched"
        out.append((w, ticket))

def carry_admission(b: Balancer, old: Pool, pool: Pool) -> None:
    """A reloaded pool keeps its queued requests (or sheds them without a queue)."""
    for node in pool.nodes:
        if pool.limited or node.limiter is not None:
            node.limiter = node_limiter(node, b.pools)
    if old.queue is None:
        return
    for waiter in old.queue.queued():
        old.queue.cancel(waiter)
        shed = Shed("no_capacity", 1.0)
        if pool.queue is not None:
            found, displaced = pool.queue.offer(waiter, waiter.arrival)
            for d in displaced:
                b._queue_decisions.append((d, Shed("displaced", 1.0)))
            if found is None:
                continue
            shed = found
        waiter.state = "shed"
        b._queue_decisions.append((waiter, shed))

def no_first_token(b: Balancer, ticket: Ticket, now: float) -> None:
    """The driver will not see ``ticket``'s first token (a non-streamed answer).

    Its prompt is then counted as prefilled once the node's predicted time
    to first token has passed (:meth:`Ticket.expected_ttft` times the
    node's learned prefill slowdown), instead of when the whole answer is done: the node's prompt
    backlog predicts the next requests' TTFT and admission, and a
    non-streamed answer would otherwise hold its prompt there for the
    whole generation. Nothing is learned from the presumed time.
    """
    if ticket.released or ticket.t_first >= 0.0 or ticket.presumed:
        return
    if b.recorder is not None:
        b.recorder({"t": now, "op": "no_first_token", "ticket": ticket.id})
    # The learner's ratio is observed over expected TTFT: its inverse use.
    ttft = ticket.expected_ttft() * ticket.node.capacity.prefill_slowdown
    heapq.heappush(b._presumed, (ticket.t_dispatch + ttft, ticket.id, ticket))
    settle_presumed(b, now)

def settle_presumed(b: Balancer, now: float) -> None:
    """Count the prompts of non-streamed tickets whose presumed first token is due."""
    heap = b._presumed
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
        node.prefilling -= 1
        node.prefill_backlog -= ticket.backlog
        node.decoding += 1
        node.end_work(ticket.work, ticket.accrual, now)  # computed: counted where it ran
        moved.add(ticket.pool.name)
    for name in sorted(moved):  # a shorter backlog may admit a waiter
        pool = b.pools.get(name)
        if pool is not None and pool.queue is not None and pool.queue.length:
            drain(b, pool, now, b._queue_decisions, scan=False)
    if moved and b._queue_decisions and b.on_queue_decision is not None:
        b.on_queue_decision()
