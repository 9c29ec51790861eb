"""Client connection hygiene: a cap, a header-read timeout, slow readers, bad requests.

aiohttp's server alone closes idle keep-alive connections (its
``keepalive_timeout``, which the gateway sets to ``client.idle_timeout_s``)
but has no cap on connections and no bound on how long a request's headers
may take once they started to arrive: 500 slowloris connections and 20,000
idle ones once held a gateway until its file descriptors ran out, and every
new client got a reset with nothing logged. :class:`ClientConnections`
wraps the protocol factory of the gateway's runner (:class:`GuardedRunner`)
so that every connection is a :class:`GuardedHandler`, which

* at ``client.max_connections`` open connections, makes room for a new one
  by closing the oldest connection that has no request in progress (an idle
  keep-alive or one still sending its headers: what an attacker holds), as
  nginx reuses keep-alive connections when it runs out; only when every
  connection is serving a request is the new one refused with a plain
  ``503`` and ``Connection: close`` (and a log line at most every 10 s).
  Either way the kernel's accept queue never fills with connections nobody
  serves, and 10,000 idle connections cannot lock a real client out. The
  cap defaults to half the process's file-descriptor limit (the other half
  is for the engines' connections);
* closes a connection whose request headers are not complete
  ``client.header_timeout_s`` after their first byte;
* counts its own write pauses (:attr:`GuardedHandler.write_pauses`): the
  proxy reads them to tell a client that reads slowly from a node that
  streams slowly, and learns no speed from such a stream;
* answers malformed HTTP with an OpenAI-shaped 400 and one log line at
  info level, instead of aiohttp's text body and an ERROR traceback.

Every close is counted in ``tailguard_client_connections_closed_total{reason}``.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from tailguard.adapters.api_errors import error_body
from tailguard.config.fleet import ClientSettings

log = logging.getLogger("tailguard.gateway.connections")

_REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s")
_LOG_EVERY_S = 10.0


class ClientConnections:
    """The gateway's client connections: counted, capped and timed out."""

    def __init__(self, settings: Callable[[], ClientSettings],
                 on_close: Callable[[str], None] | None = None) -> None:
        self.settings = settings  # read per connection: a reload applies to new ones
        self.on_close = on_close or (lambda reason: None)
        self.open = 0
        self.refused = 0
        self.evicted = 0
        self._handlers: dict[GuardedHandler, None] = {}  # open ones, oldest first
        self._last_log = -_LOG_EVERY_S

    def cap(self) -> int:
        configured = self.settings().max_connections
        if configured is not None:
            return configured
        return default_max_connections()

    def factory(self, server: web.Server) -> Callable[[], asyncio.Protocol]:
        kwargs: dict[str, Any] = dict(getattr(server, "_kwargs", {}))

        def make() -> asyncio.Protocol:
            # Per connection, so that a reloaded idle timeout applies to new ones.
            kwargs["keepalive_timeout"] = self.settings().idle_timeout_s
            return GuardedHandler(server, self, loop=asyncio.get_running_loop(), **kwargs)

        return make

    def admit(self, handler: GuardedHandler) -> bool:
        """Whether ``handler``'s new connection may open (making room if it can)."""
        cap = self.cap()
        if self.open >= cap:
            victim = next((h for h in self._handlers if not h.busy), None)
            if victim is not None:  # the oldest connection doing nothing
                self.evicted += 1
                self.on_close("evicted")
                victim.force_close()
                self.forget(victim)
                self._warn(f"client connections at the cap ({cap}): closing the oldest idle "
                           f"ones to make room ({self.evicted} so far; client.max_connections)")
            else:
                self.refused += 1
                self.on_close("over_capacity")
                self._warn(f"client connections at the cap ({cap}), all serving requests: new "
                           f"ones answered 503 ({self.refused} so far; client.max_connections)")
                return False
        self.open += 1
        self._handlers[handler] = None
        return True

    def forget(self, handler: GuardedHandler) -> None:
        if self._handlers.pop(handler, 0) is None:
            self.open -= 1

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last_log >= _LOG_EVERY_S:
            self._last_log = now
            log.warning("%s", message)


def default_max_connections() -> int:
    """Half the soft file-descriptor limit (at least 64): the rest is for engines and files."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 65536
    return max(64, soft // 2)


def raise_fd_limit() -> int:
    """Lift the soft file-descriptor limit to the hard one (as Go's runtime does); the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target
        except (ValueError, OSError):
            pass
    return soft


class GuardedHandler(RequestHandler):
    """aiohttp's request handler with the gateway's connection rules (see the module)."""

    def __init__(self, manager: web.Server, guard: ClientConnections, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.guard = guard
        self.write_pauses = 0
        self._refused = False
        self._in_request = False
        self._header_started = -1.0  # loop time of a pending request's first byte, or -1
        self._header_timer: asyncio.TimerHandle | None = None

    @property
    def busy(self) -> bool:
        """A request is being served (its headers were complete)."""
        return self._in_request

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self.guard.admit(self):
            self._refused = True
            body = error_body(503, "the gateway is at its client connection limit; retry",
                              "too_many_connections")
            assert isinstance(transport, asyncio.Transport)
            transport.write(_REFUSAL % (len(body), body))
            transport.close()
            return
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.guard.forget(self)
        self._disarm()
        if not self._refused:
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if data and not self._in_request and self._header_started < 0.0:
            # The first bytes of a request: its headers must be complete in time.
            # One lazily re-armed timer per connection checks it (no timer per request).
            self._header_started = self._loop.time()
            if self._header_timer is None:
                self._arm(self.guard.settings().header_timeout_s)
        super().data_received(data)

    def pause_writing(self) -> None:
        self.write_pauses += 1
        super().pause_writing()

    async def _handle_request(self, request: BaseRequest, start_time: float | None,
                              request_handler: Any) -> tuple[web.StreamResponse, bool]:
        self._in_request = True
        self._header_started = -1.0
        try:
            return await super()._handle_request(request, start_time, request_handler)
        finally:
            self._in_request = False

    def _process_keepalive(self) -> None:
        was_closing = self._force_close
        super()._process_keepalive()
        if self._force_close and not was_closing:
            self.guard.on_close("idle_timeout")

    def handle_error(self, request: BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status != 400:  # a bug of ours: aiohttp logs it with its traceback
            super().handle_error(request, status, exc, message)
            resp = web.Response(status=status, content_type="application/json",
                                body=error_body(status, "the gateway failed to handle the "
                                                        "request", "internal_error"))
            resp.force_close()
            return resp
        self.guard.on_close("bad_request")
        reason = (getattr(exc, "message", None) or str(exc) or "bad request") if exc else (
            message or "bad request")
        log.info("malformed HTTP request from %s: %s", request.remote, str(reason)[:200])
        resp = web.Response(status=400, body=error_body(400, f"malformed HTTP request: "
                                                             f"{str(reason)[:200]}",
                                                        "bad_http_request"),
                            content_type="application/json")
        resp.force_close()
        return resp

    def log_exception(self, *args: Any, **kw: Any) -> None:
        exc = kw.get("exc_info")
        if isinstance(exc, web.RequestPayloadError):
            # The rest of a body that could not be decoded (bad gzip), drained after
            # the proxy answered 400: the client's mistake, already answered.
            log.info("request body not readable: %s", str(exc).replace("\n", " ")[:200])
            return
        super().log_exception(*args, **kw)

    def _arm(self, delay: float) -> None:
        self._header_timer = self._loop.call_later(delay, self._header_timeout)

    def _header_timeout(self) -> None:
        self._header_timer = None
        started = self._header_started
        if started < 0.0 or self._in_request or self._force_close:
            return  # no request waiting for its headers: the timer rests until one starts
        timeout = self.guard.settings().header_timeout_s
        left = started + timeout - self._loop.time()
        if left > 0.0:
            self._arm(left)  # a later request started since: wait out its time
            return
        self.guard.on_close("header_timeout")
        self.force_close()

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None


class GuardedRunner(web.AppRunner):
    """An :class:`aiohttp.web.AppRunner` whose sites serve :class:`GuardedHandler` s."""

    def __init__(self, app: web.Application, guard: ClientConnections, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.guard = guard

    @property
    def server(self) -> Any:
        inner = super().server
        return None if inner is None else self.guard.factory(inner)


__all__ = ["ClientConnections", "GuardedHandler", "GuardedRunner"]
