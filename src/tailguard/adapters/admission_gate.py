"""The gateway's side of admission: waiting in the pool's queue, and 429s.

The exchange (:mod:`tailguard.core.exchange`) admits a request through the
balancer; when it answers :class:`~tailguard.core.exchange.Queue`, the
request's handler awaits a future from :meth:`AdmissionGate.wait`. The pump
hands the balancer's queue decisions (late binding: the node is chosen when
a permit frees) to their exchanges and resolves each future with the
exchange's next actions. It runs when the balancer signals decisions (a
permit released, an entry displaced) and, while anything is queued, every
``EXPIRY_S`` to shed entries at their deadline.

A shed request is answered at once with 429, ``Retry-After`` and an
OpenAI-style error. A client that goes away while queued leaves the queue at
once (the exchange's ``client_gone``); a ticket granted in the same instant
is released as ``client_cancelled``. Queue time counts in the client's TTFT:
the clock starts when the request arrives, not when it leaves the queue.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from tailguard.adapters.api_errors import error_response
from tailguard.adapters.live_fleet import LiveFleet
from tailguard.adapters.metrics import GatewayMetrics
from tailguard.core.admission import Shed
from tailguard.core.exchange import Action, Exchange, pump

TTFT_HEADER = "x-slo-ttft-ms"
EXPIRY_S = 0.05  # how often queued entries are checked against their deadline


class AdmissionGate:
    """Resolves queued requests' futures with their exchanges' next actions."""

    def __init__(self, fleet: LiveFleet, metrics: GatewayMetrics) -> None:
        self.fleet = fleet
        self.metrics = metrics
        self._scheduled = False
        self._timer: asyncio.TimerHandle | None = None

    def install(self) -> None:
        """Have the balancer wake the pump (before any request can be queued)."""
        balancer = self.fleet.balancer
        if balancer.on_queue_decision is None:
            balancer.on_queue_decision = self._schedule_pump

    def wait(self, ex: Exchange) -> asyncio.Future[tuple[Action, ...]]:
        """A future of the queued exchange's next actions."""
        future: asyncio.Future[tuple[Action, ...]] = asyncio.get_running_loop().create_future()
        ex.tag = future
        self._arm_timer()
        return future

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
        for ex, actions in pump(self.fleet.balancer, time.monotonic()):
            future = ex.tag
            if isinstance(future, asyncio.Future) and not future.done():
                future.set_result(actions)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def shed_response(shed: Shed, model: str) -> web.Response:
    """429 with ``Retry-After`` and the OpenAI error shape."""
    message, code, retry_after = shed_error(shed, model)
    return error_response(429, message, code, headers={"Retry-After": retry_after})


def shed_error(shed: Shed, model: str) -> tuple[str, str, str]:
    """A shed's error message, code and ``Retry-After`` value (the proxy's and the picker's)."""
    return (f"{shed.message} for {model!r}; retry later", f"shed_{shed.reason}",
            str(int(shed.retry_after_s)))


def ttft_header(request: web.Request) -> float | None:
    """The client's TTFT budget (``x-slo-ttft-ms``), in seconds."""
    return ttft_budget(request.headers.get(TTFT_HEADER))


def ttft_budget(raw: str | None) -> float | None:
    """An ``x-slo-ttft-ms`` value in seconds (None: absent, or not a positive number)."""
    if raw is None:
        return None
    try:
        ms = float(raw)
    except ValueError:
        return None
    return ms / 1000.0 if ms > 0 else None
