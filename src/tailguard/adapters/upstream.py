"""A lean HTTP/1.1 client for the request path: keep-alive connections per node.

The proxy sends one POST per request to an engine and reads the answer back,
whole or chunk by chunk. :class:`aiohttp.ClientSession` does that in about
130 us of CPU per request on the 2-core development machine; this client,
an :class:`asyncio.Protocol` per connection with ``httptools`` (the llhttp
parser, as uvicorn uses) reading the answer, does it in about 30 us
(``benchmarks/gateway_overhead.py`` has the end-to-end effect). It does only
what the proxy needs:

* ``POST`` with a body already in memory, over plain TCP or TLS;
* answers with ``Content-Length``, chunked, or ended by the connection's
  close; the body is handed over as it arrives (:meth:`UpstreamResponse.readany`)
  or whole (:meth:`UpstreamResponse.read`), undecoded (``Content-Encoding``
  is passed through, as the gateway asks for ``identity``);
* a LIFO pool of idle keep-alive connections per origin, each dropped after
  ``keepalive_s`` idle or when the server says ``Connection: close``;
* back-pressure: reading from the engine pauses while more than
  ``HIGH_WATER`` bytes wait for a slow client;
* a request on a reused connection that the server closed before answering
  (it timed out the idle connection as the request was sent) is sent once more
  on a new connection; nothing else is retried here: failover is the proxy's.

Errors are :class:`UpstreamError` subclasses (or :class:`OSError` from the
socket); timeouts other than the connect timeout are the caller's
(``asyncio.timeout``), and cancelling a request closes its connection.
The health checks, metric scrapes and webhooks stay on aiohttp's client.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from typing import cast
from urllib.parse import SplitResult, urlsplit

import httptools
from multidict import CIMultiDict

HIGH_WATER = 256 * 1024  # bytes of answer buffered for the caller before reading pauses
DEFAULT_KEEPALIVE_S = 30.0


class UpstreamError(Exception):
    """The engine's answer could not be obtained."""


class UpstreamConnectError(UpstreamError):
    """No connection to the engine (refused, unreachable, or the connect timed out)."""


class UpstreamDisconnected(UpstreamError):
    """The connection closed before the answer was complete."""


class UpstreamProtocolError(UpstreamError):
    """The engine sent something that is not HTTP/1.1."""


class UpstreamResponse:
    """One answer: status and headers at once, the body as it arrives."""

    __slots__ = ("_chunks", "_conn", "_done", "_exc", "_reusable", "_waiter", "headers",
                 "status")

    def __init__(self, conn: _Connection, status: int, headers: CIMultiDict[str]) -> None:
        self.status = status
        self.headers = headers
        self._conn: _Connection | None = conn
        self._chunks: deque[bytes] = deque()
        self._done = False  # the whole body arrived
        self._reusable = False  # ... and the connection may carry another request
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    @property
    def content_type(self) -> str:
        """The media type of ``Content-Type``, lower case, without parameters."""
        raw = self.headers.get("Content-Type", "application/octet-stream")
        return raw.partition(";")[0].strip().lower()

    @property
    def streamed(self) -> bool:
        """A successful event stream (the gateway passes it on chunk by chunk)."""
        return self.status < 300 and self.content_type == "text/event-stream"

    async def readany(self) -> bytes:
        """All body bytes that arrived since the last call; ``b""`` at the end."""
        while True:
            chunks = self._chunks
            if chunks:
                # Everything that arrived, at once: a proxy that fell behind
                # catches up with one write instead of one per chunk.
                chunk = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                if self._conn is not None:
                    self._conn.resume()
                return chunk
            if self._exc is not None:
                raise self._exc
            if self._done:
                return b""
            self._waiter = self._conn_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def read(self) -> bytes:
        """The whole body."""
        parts: list[bytes] = []
        while chunk := await self.readany():
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def release(self) -> None:
        """Done with the answer: its connection goes back to the pool if it can."""
        conn, self._conn = self._conn, None
        if conn is not None:
            if self._done and self._reusable and self._exc is None:
                conn.make_idle()
            else:
                conn.abort()

    def close(self) -> None:
        """Done with the answer, read or not: its connection is closed."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.abort()

    # -- fed by the connection -----------------------------------------------------

    def _conn_loop(self) -> asyncio.AbstractEventLoop:
        conn = self._conn
        if conn is None:
            raise UpstreamError("the answer was released")
        return conn.loop

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._wake()

    def _finish(self, reusable: bool) -> None:
        self._done = True
        self._reusable = reusable
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        if not self._done:
            self._exc = exc
            self._wake()


class _Connection(asyncio.Protocol):
    """One keep-alive connection; carries one request at a time."""

    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.head: asyncio.Future[UpstreamResponse] | None = None
        self.response: UpstreamResponse | None = None
        self._headers: CIMultiDict[str] = CIMultiDict()
        self.received = False  # a byte of the current answer arrived
        self.paused = False
        self.buffered = 0
        self.idle_since = 0.0
        self.closed = False
        self.unusable = False  # out of step with the server: close instead of reusing

    # -- asyncio.Protocol ----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but quack like one.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.head is None:  # bytes on an idle connection: out of step
            self.abort()
            return
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._lost(UpstreamProtocolError(f"malformed HTTP answer: {exc}"))
            self.abort()

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        resp = self.response
        if resp is not None and not resp._done and resp._exc is None and self._ends_at_close():
            resp._finish(False)  # a body delimited by the connection's end
            return
        self._lost(UpstreamDisconnected("the engine closed the connection" +
                                        (f": {exc}" if exc else "")))

    # -- httptools callbacks ---------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.add(name.decode("latin-1"), value.decode("utf-8", "replace"))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:  # 100 Continue and friends: the real answer follows
            self._headers = CIMultiDict()
            return
        head = self.head
        if head is None or head.done():
            # An answer nobody asked for (a second one, or one on an idle
            # connection): the stream is out of step; never reuse it.
            self.unusable = True
            self._headers = CIMultiDict()
            return
        resp = self.response = UpstreamResponse(self, status, self._headers)
        self._headers = CIMultiDict()
        head.set_result(resp)

    def on_body(self, body: bytes) -> None:
        resp = self.response
        if resp is None or resp._done:
            return
        resp._feed(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        resp = self.response
        if resp is None or resp._done:
            return
        resp._finish(self.parser.should_keep_alive())

    # -- used by the pool and the response -----------------------------------------------

    def _ends_at_close(self) -> bool:
        resp = self.response
        if resp is None:
            return False
        return "Content-Length" not in resp.headers and "chunked" not in resp.headers.get(
            "Transfer-Encoding", "").lower()

    def _lost(self, exc: UpstreamError) -> None:
        head = self.head
        if head is not None and not head.done():
            head.set_exception(exc)
        if self.response is not None:
            self.response._fail(exc)

    def resume(self) -> None:
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    def send(self, head: bytes, body: bytes) -> asyncio.Future[UpstreamResponse]:
        assert self.transport is not None
        self.response = None
        self.received = False
        self.buffered = 0
        fut: asyncio.Future[UpstreamResponse] = self.loop.create_future()
        self.head = fut
        self.transport.writelines((head, body))
        return fut

    def make_idle(self) -> None:
        self.head = None
        self.response = None
        self.resume()
        if self.unusable:
            self.abort()
        if self.closed:
            return
        self.idle_since = time.monotonic()
        self.pool.put_idle(self)

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            self.pool.forget(self)
            if self.transport is not None:
                self.transport.abort()


class UpstreamPool:
    """Keep-alive connections to one origin (scheme, host, port)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, host: str, port: int,
                 tls: ssl.SSLContext | None, keepalive_s: float) -> None:
        self.loop = loop
        self.host = host
        self.port = port
        self.tls = tls
        self.keepalive_s = keepalive_s
        self.idle: list[_Connection] = []  # oldest first: put at the end, taken from the end
        self._reaper: asyncio.TimerHandle | None = None
        # Counters for the metrics (gateway/upstream_metrics.py).
        self.opened = 0  # new connections
        self.reused = 0  # requests sent on a kept-alive connection
        self.stale_retries = 0  # sent again because a reused connection had closed
        self.connect_errors = 0
        default = 443 if tls is not None else 80
        self.host_header = host if port == default else f"{host}:{port}"
        if ":" in host and port != default:  # an IPv6 literal
            self.host_header = f"[{host}]:{port}"

    async def post(self, path: str, headers: CIMultiDict[str], body: bytes,
                   connect_timeout: float | None) -> UpstreamResponse:
        lines = [f"POST {path} HTTP/1.1\r\nHost: {self.host_header}\r\n"
                 f"Content-Length: {len(body)}\r\n"]
        for k, v in headers.items():
            if "\n" in v or "\r" in v or "\n" in k or "\r" in k:
                # Client headers cannot carry one (aiohttp's parser refuses
                # them); a key from the environment could: never split a request.
                raise UpstreamError(f"header {k!r} contains a line break")
            lines.append(f"{k}: {v}\r\n")
        lines.append("\r\n")
        head = "".join(lines).encode("utf-8", "surrogateescape")
        conn = self._take_idle()
        if conn is not None:
            self.reused += 1
            try:
                return await self._exchange(conn, head, body)
            except UpstreamDisconnected:
                if conn.received:
                    raise
                # The server closed the idle connection as the request went out:
                # it never saw the request. Once more, on a new connection.
                self.stale_retries += 1
        conn = await self._connect(connect_timeout)
        return await self._exchange(conn, head, body)

    async def _exchange(self, conn: _Connection, head: bytes, body: bytes) -> UpstreamResponse:
        try:
            return await conn.send(head, body)
        except BaseException:
            conn.abort()  # cancelled or failed mid-request: the connection is unusable
            raise

    def _take_idle(self) -> _Connection | None:
        idle = self.idle
        now = time.monotonic()
        while idle:
            conn = idle.pop()  # the most recently used: warmest, least likely timed out
            if (conn.closed or now - conn.idle_since > self.keepalive_s
                    or conn.transport is None or conn.transport.is_closing()):
                conn.abort()
                continue
            return conn
        return None

    async def _connect(self, timeout: float | None) -> _Connection:
        try:
            async with asyncio.timeout(timeout):
                _, proto = await self.loop.create_connection(
                    lambda: _Connection(self), self.host, self.port, ssl=self.tls,
                    server_hostname=self.host if self.tls is not None else None)
        except TimeoutError as exc:
            self.connect_errors += 1
            raise UpstreamConnectError(f"connect to {self.host}:{self.port} timed out "
                                       f"after {timeout:g} s") from exc
        except OSError as exc:
            self.connect_errors += 1
            raise UpstreamConnectError(f"cannot connect to {self.host}:{self.port}: "
                                       f"{exc.strerror or exc}") from exc
        self.opened += 1
        return proto

    def put_idle(self, conn: _Connection) -> None:
        self.idle.append(conn)
        if self._reaper is None:
            self._reaper = self.loop.call_at(self.loop.time() + self.keepalive_s, self._reap)

    def _reap(self) -> None:
        """Close the idle connections past ``keepalive_s`` (an idle pool must not hold
        sockets to a node for ever); re-arm for the oldest one left."""
        self._reaper = None
        idle = self.idle
        now = time.monotonic()
        expired = 0
        while expired < len(idle) and now - idle[expired].idle_since >= self.keepalive_s:
            expired += 1
        doomed = idle[:expired]
        del idle[:expired]
        for conn in doomed:
            conn.abort()
        if idle:
            wait = idle[0].idle_since + self.keepalive_s - now
            self._reaper = self.loop.call_at(self.loop.time() + max(wait, 0.05), self._reap)

    def forget(self, conn: _Connection) -> None:
        if conn in self.idle:
            self.idle.remove(conn)

    def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        for conn in list(self.idle):
            conn.abort()
        self.idle.clear()


def _origin(parts: SplitResult) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an http(s) URL, the default port filled in; None otherwise."""
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:  # a port out of range
        return None
    return parts.scheme, parts.hostname, port


class UpstreamClient:
    """Pools by origin; ``post(url, ...)`` picks the pool from the URL."""

    def __init__(self, keepalive_s: float = DEFAULT_KEEPALIVE_S) -> None:
        self.keepalive_s = keepalive_s
        self._pools: dict[tuple[str, str, int], UpstreamPool] = {}
        self._routes: dict[str, tuple[UpstreamPool, str]] = {}  # url -> (pool, path)
        self._tls: ssl.SSLContext | None = None

    async def post(self, url: str, headers: CIMultiDict[str], body: bytes,
                   connect_timeout: float | None = None) -> UpstreamResponse:
        route = self._routes.get(url)
        if route is None:
            route = self._route(url)
        pool, path = route
        return await pool.post(path, headers, body, connect_timeout)

    def pool_for(self, url: str) -> UpstreamPool | None:
        """The pool that requests to ``url`` use, if one was opened yet."""
        route = self._routes.get(url)
        if route is not None:
            return route[0]
        key = _origin(urlsplit(url))
        return self._pools.get(key) if key is not None else None

    def _route(self, url: str) -> tuple[UpstreamPool, str]:
        parts = urlsplit(url)
        key = _origin(parts)
        if key is None:
            raise UpstreamConnectError(f"not an http(s) URL: {url!r}")
        scheme, host, port = key
        pool = self._pools.get(key)
        if pool is None:
            ctx = None
            if scheme == "https":
                if self._tls is None:
                    self._tls = ssl.create_default_context()
                ctx = self._tls
            pool = self._pools[key] = UpstreamPool(asyncio.get_running_loop(), host, port, ctx,
                                                   self.keepalive_s)
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        if len(self._routes) < 10_000:  # URLs come from the fleet file: a handful
            self._routes[url] = (pool, path)
        return pool, path

    def close(self) -> None:
        """Close every idle connection (those in use close when their answer is done)."""
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        self._routes.clear()


__all__ = [
    "UpstreamClient",
    "UpstreamConnectError",
    "UpstreamDisconnected",
    "UpstreamError",
    "UpstreamProtocolError",
    "UpstreamResponse",
]
