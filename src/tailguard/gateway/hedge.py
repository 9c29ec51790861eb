"""Hedged requests in the gateway: race two upstream attempts to the first chunk.

The decision is the core's :class:`~tailguard.core.hedging.Hedger` (one per
pool with ``hedging: {enabled: true}``), the same object the simulator uses.
Only streamed requests are hedged: their first chunk is the first token, and
nothing reaches the client before it, so a duplicate is invisible to it.

:meth:`GatewayHedging.first_chunk` replaces the proxy's "POST, then read the
first chunk" for such requests. It starts the primary; if the primary has no
first chunk after ``hedge_after`` (and its node has been silent as long, and
the budget allows) it picks a second node (``balancer.pick`` excluding the
first) and starts the same request there. The first *good* first chunk wins
(a 2xx event stream with data); the loser's task is cancelled, its
connection closed and its ticket released as ``CLIENT_CANCELLED``. A copy
that fails while the other still runs drops out (its ticket released with
its failure's origin); if both fail, the primary's failure is what the
proxy reports and fails over from, as without hedging.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from multidict import CIMultiDict

from tailguard.core.balancer import Ticket
from tailguard.core.fleet import Outcome
from tailguard.core.hedging import Hedger
from tailguard.gateway.config import NodeConfig
from tailguard.gateway.live_fleet import LiveFleet
from tailguard.gateway.upstream import UpstreamResponse

# Sends the request to one node and returns its response with the first chunk
# read (or the whole body when it is not an event stream).
Send = Callable[[NodeConfig, CIMultiDict[str]], Awaitable[tuple[UpstreamResponse, bytes]]]


@dataclass(slots=True)
class Copy:
    """One of the racing attempts."""

    node: NodeConfig
    ticket: Ticket
    task: asyncio.Task[tuple[UpstreamResponse, bytes]]


def _good(c: Copy) -> bool:
    if c.task.cancelled() or c.task.exception() is not None:
        return False
    resp, payload = c.task.result()
    return resp.streamed and bool(payload)


def _failure_origin(c: Copy) -> Outcome:
    exc = c.task.exception() if not c.task.cancelled() else None
    if exc is None:
        resp, _ = c.task.result()
        return Outcome.UPSTREAM_429 if resp.status == 429 else Outcome.UPSTREAM_5XX
    return Outcome.TIMEOUT if isinstance(exc, TimeoutError) else Outcome.CONNECT_FAILURE


def _expected(hedger: Hedger, ticket: Ticket) -> float | None:
    """The ticket's expected TTFT when the delay is per request (else not needed)."""
    cfg = hedger.config
    return ticket.expected_ttft() if cfg.per_request and cfg.after_s <= 0.0 else None


class GatewayHedging:
    """The hedgers of a gateway's pools and the race mechanics."""

    def __init__(self, fleet: LiveFleet, on_result: Callable[[str, str], None]) -> None:
        self.fleet = fleet
        self.on_result = on_result  # (pool, won | lost | failed)
        self._hedgers: dict[str, Hedger] = {}

    def hedger(self, model: str) -> Hedger | None:
        cfg = self.fleet.pool_settings(model).hedging
        if not cfg.enabled:
            return None
        h = self._hedgers.get(model)
        if h is None or h.config != cfg:  # new pool, or its settings were reloaded
            h = self._hedgers[model] = Hedger(cfg)
        return h

    def on_first_chunk(self, model: str, node: NodeConfig, ticket: Ticket, now: float) -> None:
        h = self._hedgers.get(model)
        if h is not None:
            h.on_progress(node.id, now)
            h.on_ttft(node.gpu_class, now - ticket.t_dispatch, _expected(h, ticket))

    async def first_chunk(self, hedger: Hedger, model: str, node: NodeConfig, ticket: Ticket,
                          headers: CIMultiDict[str], send: Send, prompt_tokens: int,
                          max_tokens: int | None, priority: int
                          ) -> tuple[NodeConfig, Ticket, UpstreamResponse, bytes]:
        """Race the primary against (perhaps) one hedge; the winner's response and first chunk.

        Raises the primary's exception when no copy produced a good first chunk
        and the primary failed with one (the caller classifies it as before).
        """
        hedger.on_request()
        primary = Copy(node, ticket, asyncio.ensure_future(send(node, headers)))
        copies = [primary]
        try:
            after = hedger.hedge_after(node.gpu_class, _expected(hedger, ticket))
            if after is not None:
                done, _ = await asyncio.wait({primary.task}, timeout=after)
                if not done:
                    second = self._start_hedge(hedger, model, primary, headers, send,
                                               prompt_tokens, max_tokens, priority, after)
                    if second is not None:
                        copies.append(second)
            winner = await self._race(copies)
        except BaseException:
            # The client went away or the first-byte deadline hit: stop every copy.
            # The primary's ticket stays the proxy's to release with the right origin.
            for c in copies:
                self._drop(c, Outcome.CLIENT_CANCELLED, release=c is not primary)
            raise
        now = time.monotonic()
        if winner is None:
            for c in copies[1:]:
                self._drop(c, _failure_origin(c))
                self.on_result(model, "failed")
            resp, payload = primary.task.result()  # re-raises the primary's exception
            return node, ticket, resp, payload
        for c in copies:
            if c is not winner:
                # Running (or answered in the same instant): it lost; failed: its failure.
                lost = not c.task.done() or _good(c)
                self._drop(c, Outcome.CLIENT_CANCELLED if lost else _failure_origin(c))
                self.on_result(model, "lost" if c is not primary else "won")
        resp, payload = winner.task.result()
        if len(copies) > 1 and winner is not primary:
            hedger.wins += 1
        self.on_first_chunk(model, winner.node, winner.ticket, now)
        return winner.node, winner.ticket, resp, payload

    def _start_hedge(self, hedger: Hedger, model: str, primary: Copy,
                     headers: CIMultiDict[str], send: Send, prompt_tokens: int,
                     max_tokens: int | None, priority: int, after: float) -> Copy | None:
        now = time.monotonic()
        if (not hedger.silent(primary.node.id, now, after, primary.node.gpu_class)
                or not hedger.try_hedge()):
            return None
        fleet = self.fleet
        ticket = fleet.balancer.pick(model, prompt_tokens, now, max_tokens, priority,
                                     (primary.node.id,))
        if ticket is None:
            hedger.credit += 1.0  # nowhere to send it: not spent
            hedger.hedges -= 1
            return None
        node = fleet.nodes.get(ticket.node_id)
        if node is None:
            fleet.balancer.on_finish(ticket, now, Outcome.CLIENT_ERROR, 0)
            return None
        h = headers.copy()
        key = node.upstream_api_key()
        h.popall("Authorization", None)
        if key:
            h["Authorization"] = f"Bearer {key}"
        elif "Authorization" in headers and primary.node.upstream_api_key() is None:
            h["Authorization"] = headers["Authorization"]  # the client's own, passed through
        return Copy(node, ticket, asyncio.ensure_future(send(node, h)))

    @staticmethod
    async def _race(copies: list[Copy]) -> Copy | None:
        """The first copy with a good first chunk; None when all failed."""
        pending = {c.task for c in copies}
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for c in copies:
                if c.task in done and _good(c):
                    return c
        return None

    def _drop(self, c: Copy, outcome: Outcome, release: bool = True) -> None:
        if not c.task.done():
            c.task.cancel()
        elif not c.task.cancelled() and c.task.exception() is None:
            resp, _ = c.task.result()
            resp.close()
        else:
            with contextlib.suppress(BaseException):
                c.task.exception()  # retrieved: no "never retrieved" warning
        if release and not c.ticket.released:
            self.fleet.balancer.on_finish(c.ticket, time.monotonic(), outcome, 0)
