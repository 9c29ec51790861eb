"""The gateway's side of admission: waiting in the pool's queue, and 429s.

The decision core (:meth:`Balancer.admit`, :meth:`Balancer.poll_queue`)
decides; this module turns its decisions into asyncio: a queued request
awaits a future that the pump resolves with a ticket (late binding: the node
is chosen when a permit frees) or a shed. The pump runs when the balancer
signals decisions (a permit released, an entry displaced) and, while
anything is queued, every ``EXPIRY_S`` to shed entries at their deadline.

A shed request is answered at once with 429, ``Retry-After`` and an
OpenAI-style error. A client that goes away while queued leaves the queue at
once; if its ticket was granted in the same instant, the ticket is released
as ``client_cancelled``. Queue time counts in the client's TTFT: the clock
starts when the request arrives, not when it leaves the queue.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from tailguard.core.admission import Shed, Waiter
from tailguard.core.balancer import Ticket
from tailguard.core.fleet import Outcome
from tailguard.gateway.api_errors import error_response
from tailguard.gateway.live_fleet import LiveFleet
from tailguard.gateway.metrics import GatewayMetrics

TTFT_HEADER = "x-slo-ttft-ms"
EXPIRY_S = 0.05  # how often queued entries are checked against their deadline


class AdmissionGate:
    """Admits requests through the balancer; queued ones wait on a future."""

    def __init__(self, fleet: LiveFleet, metrics: GatewayMetrics) -> None:
        self.fleet = fleet
        self.metrics = metrics
        self._scheduled = False
        self._timer: asyncio.TimerHandle | None = None

    async def admit(self, request: web.Request, model: str, prompt_tokens: int,
                    max_tokens: int | None, priority: int, size_bytes: int
                    ) -> Ticket | Shed | None:
        balancer = self.fleet.balancer
        now = time.monotonic()
        pool = balancer.pools.get(model)
        if pool is None or not pool.limited:
            return balancer.pick(model, prompt_tokens, now, max_tokens, priority)
        if balancer.on_queue_decision is None:
            balancer.on_queue_decision = self._schedule_pump
        got = balancer.admit(model, prompt_tokens, now, max_tokens, priority,
                             ttft_s=_ttft_header(request), size_bytes=size_bytes)
        if not isinstance(got, Waiter):
            if isinstance(got, Shed):
                self.metrics.shed_request(model, got.reason)
            return got
        future: asyncio.Future[Ticket | Shed] = asyncio.get_running_loop().create_future()
        got.payload = future
        self._arm_timer()
        try:
            decision = await future
        except asyncio.CancelledError:
            if not balancer.cancel_queued(got) and future.done() and not future.cancelled():
                late = future.result()
                if isinstance(late, Ticket):
                    balancer.on_finish(late, time.monotonic(), Outcome.CLIENT_CANCELLED, 0)
            raise
        if isinstance(decision, Shed):
            self.metrics.shed_request(model, decision.reason)
        return decision

    def _schedule_pump(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.pump)

    def _arm_timer(self) -> None:
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(EXPIRY_S, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self.pump()
        if any(p.queue is not None and p.queue.length for p in self.fleet.balancer.pools.values()):
            self._arm_timer()

    def pump(self) -> None:
        """Hand the core's queue decisions to the waiting requests."""
        self._scheduled = False
        balancer = self.fleet.balancer
        for waiter, decision in balancer.poll_queue(time.monotonic()):
            future = waiter.payload
            if isinstance(future, asyncio.Future) and not future.done():
                future.set_result(decision)
            elif isinstance(decision, Ticket):  # the client left meanwhile
                balancer.on_finish(decision, time.monotonic(), Outcome.CLIENT_CANCELLED, 0)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def shed_response(shed: Shed, model: str) -> web.Response:
    """429 with ``Retry-After`` and the OpenAI error shape."""
    return error_response(429, f"{shed.message} for {model!r}; retry later",
                          f"shed_{shed.reason}",
                          headers={"Retry-After": str(int(shed.retry_after_s))})


def _ttft_header(request: web.Request) -> float | None:
    raw = request.headers.get(TTFT_HEADER)
    if raw is None:
        return None
    try:
        ms = float(raw)
    except ValueError:
        return None
    return ms / 1000.0 if ms > 0 else None
