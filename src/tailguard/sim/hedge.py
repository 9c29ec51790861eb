"""Hedged requests in the simulator: the duplicate and cancel mechanics.

The decision (when, and whether the budget allows) is the core's
:class:`~tailguard.core.hedging.Hedger`, the same object the gateway uses.
Here a hedge is a second copy of request ``rid`` with its own id ``hrid >=
n_req`` in the engines (so the two copies' events never mix), its own ticket
from ``balancer.pick`` (excluding the primary's node), and its own network
delays. The race ends at the first token (or a one-token finish) of either
copy: the loser is cancelled in its engine and its ticket released as
``CLIENT_CANCELLED``; if the hedge won, it *becomes* the request (its ticket
and node replace the primary's, its later events are the request's). A copy
that fails while the other is alive just drops out.

:meth:`SimHedges.route` is called by the event loop for every submit, first
token, finish and failure: it returns the request id the loop should handle
the event as, or -1 when the event belongs to a copy that lost.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from random import Random
from typing import TYPE_CHECKING

from tailguard.core.balancer import Balancer, Ticket
from tailguard.core.fleet import Outcome
from tailguard.core.hedging import HedgeConfig, Hedger

if TYPE_CHECKING:
    from tailguard.sim.cluster import RunRecord, _NodeSim

Post = Callable[[float, int, int, int], None]  # (time, event kind, a, b) onto the heap


class SimHedges:
    def __init__(self, config: HedgeConfig, *, n_req: int, balancer: Balancer, model: str,
                 rec: RunRecord, tickets: list[Ticket | None], nodes: Sequence[_NodeSim],
                 by_id: dict[str, int], half_rtt: float, fault_rng: Random, post: Post,
                 reschedule: Callable[[_NodeSim], None], kinds: tuple[int, int, int, int, int],
                 status_unfinished: int) -> None:
        self.hedger = Hedger(config)
        self.n_req = n_req
        self.balancer = balancer
        self.model = model
        self.rec = rec
        self.tickets = tickets
        self.nodes = nodes
        self.by_id = by_id
        self.half_rtt = half_rtt
        self.fault_rng = fault_rng
        self.post = post
        self.reschedule = reschedule
        self.HEDGE, self.SUBMIT, self.FIRST, self.FINISH, self.FAIL = kinds
        self.unfinished = status_unfinished
        self.next_id = n_req
        self.copy_of: dict[int, int] = {}  # hrid -> rid
        self.racing: dict[int, int] = {}  # rid -> hrid while both copies run
        self.ticket: dict[int, Ticket] = {}  # hrid -> the hedge's ticket
        self.node: dict[int, int] = {}  # hrid -> node index
        self.promoted: set[int] = set()  # hrids that won: their events are the request's
        self.dead_primary: set[int] = set()  # rids whose own copy lost

    # -- scheduling ------------------------------------------------------------------

    def on_send(self, rid: int, ticket: Ticket, t: float) -> None:
        """A first attempt was dispatched: earn budget, arm the hedge timer."""
        self.hedger.on_request()
        after = self.hedger.hedge_after(ticket.node.spec.gpu_class, self._expected(ticket))
        if after is not None:
            self.post(t + after, self.HEDGE, rid, 0)

    def fire(self, rid: int, now: float) -> None:
        rec = self.rec
        primary = self.tickets[rid]
        if (rec.first[rid] >= 0.0 or rec.status[rid] != self.unfinished or primary is None
                or primary.released or rid in self.racing or rid in self.dead_primary):
            return
        node_id = primary.node.id
        after = self.hedger.hedge_after(primary.node.spec.gpu_class,
                                        self._expected(primary)) or 0.0
        if not self.hedger.silent(node_id, now, after, primary.node.spec.gpu_class):
            # Busy with others: look again later (a stall may begin meanwhile).
            self.post(now + max(after, self.hedger.config.min_after_s), self.HEDGE, rid, 0)
            return
        if not self.hedger.try_hedge():
            return
        ticket = self.balancer.pick(self.model, rec.prompt[rid], now,
                                    exclude=(primary.node.id,))
        if ticket is None:  # nowhere to send it: the credit is not spent
            self.hedger.credit += 1.0
            self.hedger.hedges -= 1
            return
        hrid = self.next_id
        self.next_id += 1
        ni = self.by_id[ticket.node.id]
        self.copy_of[hrid] = rid
        self.racing[rid] = hrid
        self.ticket[hrid] = ticket
        self.node[hrid] = ni
        ns = self.nodes[ni]
        back = now + 2 * (self.half_rtt + ns.delay)
        if ns.crashed:
            self.post(back, self.FAIL, hrid, 0)
        elif ns.error_rate > 0.0 and self.fault_rng.random() < ns.error_rate:
            self.post(back, self.FAIL, hrid, 1)
        else:
            self.post(now + self.half_rtt + ns.delay, self.SUBMIT, hrid, ni)

    # -- the race --------------------------------------------------------------------

    def route(self, kind: int, a: int, b: int, now: float) -> int:
        """The request id to handle this event as; -1 to drop it."""
        if a < self.n_req:
            if a in self.dead_primary:
                return -1
            hrid = self.racing.get(a)
            if hrid is not None:
                if kind == self.FIRST or kind == self.FINISH:
                    self._cancel(hrid, self.ticket[hrid], self.node[hrid], now)
                elif kind == self.FAIL:
                    self._promote(a, hrid, now, Outcome.CONNECT_FAILURE if b == 0
                                  else Outcome.UPSTREAM_5XX)
                    return -1
            if kind == self.FIRST or kind == self.FINISH:
                self._sample(a, now)
            return a
        rid = self.copy_of[a]
        live = a in self.promoted or self.racing.get(rid) == a
        if not live:
            return -1  # a hedge that lost
        if kind == self.SUBMIT:  # the copy runs under its own id in the engine
            ns = self.nodes[b]
            if ns.crashed:
                self.post(now + self.half_rtt + ns.delay, self.FAIL, a, 0)
            else:
                ns.engine.submit(a, self.rec.prompt[rid], self.rec.output[rid], now)
                self.reschedule(ns)
            return -1
        if a in self.promoted:
            if kind == self.FIRST or kind == self.FINISH:
                self._sample(rid, now)
            return rid
        if kind == self.FAIL:
            del self.racing[rid]
            self.balancer.on_finish(self.ticket.pop(a), now,
                                    Outcome.CONNECT_FAILURE if b == 0 else Outcome.UPSTREAM_5XX,
                                    0)
            return -1
        # The hedge produced the first token first: it becomes the request.
        primary = self.tickets[rid]
        assert primary is not None
        self._cancel(rid, primary, self.rec.node[rid], now)
        self.dead_primary.add(rid)
        self._adopt(rid, a)
        self.hedger.wins += 1
        self._sample(rid, now)
        return rid

    def _cancel(self, engine_id: int, ticket: Ticket, ni: int, now: float) -> None:
        """Cancel the losing copy ``engine_id`` on node ``ni``; the race is over."""
        ns = self.nodes[ni]
        if ns.engine.cancel(engine_id, now):
            self.reschedule(ns)
        if not ticket.released:
            self.balancer.on_finish(ticket, now, Outcome.CLIENT_CANCELLED, 0)
        rid = engine_id if engine_id < self.n_req else self.copy_of[engine_id]
        self.racing.pop(rid, None)

    def _promote(self, rid: int, hrid: int, now: float, outcome: Outcome) -> None:
        """The primary failed while its hedge runs: the hedge carries on as the request."""
        primary = self.tickets[rid]
        if primary is not None and not primary.released:
            self.balancer.on_finish(primary, now, outcome, 0)
        self.dead_primary.add(rid)
        self._adopt(rid, hrid)
        del self.racing[rid]

    def _adopt(self, rid: int, hrid: int) -> None:
        self.promoted.add(hrid)
        self.tickets[rid] = self.ticket.pop(hrid)
        self.rec.node[rid] = self.node[hrid]

    def _sample(self, rid: int, now: float) -> None:
        ticket = self.tickets[rid]
        if ticket is not None and not ticket.released:
            self.hedger.on_progress(ticket.node.id, now)
            if self.rec.first[rid] < 0.0:
                self.hedger.on_ttft(ticket.node.spec.gpu_class, now - ticket.t_dispatch,
                                    self._expected(ticket))

    def _expected(self, ticket: Ticket) -> float | None:
        """The ticket's expected TTFT when the delay is per request (else not needed)."""
        cfg = self.hedger.config
        return ticket.expected_ttft() if cfg.per_request and cfg.after_s <= 0.0 else None

    # -- faults ----------------------------------------------------------------------

    def wrap_fail(self, fail: Callable[[int, float, Outcome], None]
                  ) -> Callable[[int, float, Outcome], None]:
        """A crash reports failures directly (not through the heap): route them too."""

        def routed(rid: int, t: float, outcome: Outcome) -> None:
            r = self.route(self.FAIL, rid, 0 if outcome is Outcome.CONNECT_FAILURE else 1, t)
            if r >= 0:
                fail(r, t, outcome)

        return routed

    def delivery_node(self, hrid: int) -> int:
        return self.node[hrid]
