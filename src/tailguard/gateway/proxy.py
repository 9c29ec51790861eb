"""The request path: route an OpenAI request to a node, forward it, account for it.

For ``POST /v1/chat/completions``, ``/v1/completions`` and ``/v1/embeddings``:

1. **Admit**: API key (when configured), body size (413 over
   ``max_body_bytes``), JSON and the fields routing needs (400, see
   :mod:`~tailguard.adapters.openai_request`), a served model (404).
2. **Exchange**: the core's :class:`~tailguard.core.exchange.Exchange` runs
   the request's lifecycle (admission and the queue, the node, retries, the
   hedge, every permit released once); :mod:`~tailguard.gateway.forward`
   carries out its actions: the client's bytes go unchanged, with its
   headers minus the hop-by-hop ones, on a keep-alive connection to the node
   (:mod:`~tailguard.adapters.upstream`).
3. **Fail over** while nothing has reached the client yet: a connect error,
   a timeout, a 5xx or a 429 is retried on a node not tried yet, within
   ``retries.attempts`` and the pool's retry budget. A streamed answer is
   committed only when its first chunk arrived, so an engine that accepts the
   connection and then dies before the first token is failed over too. Once a
   byte went out, never: a later failure ends the stream with
   ``data: {"error": ...}``.
4. **Stream** SSE through as it arrives, byte for byte, without parsing a
   chunk's JSON; the output tokens are the usage chunk's or body's when
   present, else the counted events.

Timeouts (per pool): ``connect_s`` for the TCP connect; ``first_byte_s``
until a stream's first chunk; ``idle_s`` between chunks; ``total_s`` for the
request, retries included. A non-streamed answer only arrives once it is
complete, so only ``total_s`` bounds it.

Non-streamed answers give the core no first-token time: the proxy tells the
core so (``expect_no_first_token``), which then counts the prompt as
prefilled after its predicted TTFT; it learns only the end-to-end latency
from them.
"""

from __future__ import annotations

import asyncio
import time
import zlib

from aiohttp import web
from aiohttp.http_exceptions import PayloadEncodingError
from multidict import CIMultiDict

from tailguard.adapters.admission_gate import AdmissionGate
from tailguard.adapters.api_errors import error_response
from tailguard.adapters.live_fleet import LiveFleet
from tailguard.adapters.logs import CLIENT_CLOSED, REQUEST_ID_HEADER, note, request_id
from tailguard.adapters.metrics import INVALID_POOL, UNKNOWN_POOL, GatewayMetrics
from tailguard.adapters.openai_request import (
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    PRIORITY_HEADER,
    InvalidRequest,
    RoutedRequest,
    bearer_ok,
    parse_request,
    priority_of,
)
from tailguard.adapters.upstream import UpstreamClient
from tailguard.gateway.forward import Call, Forwarder, count_answer

# Headers that describe one hop, not the message (RFC 9110 7.6.1), plus those
# the client library sets itself. Accept-Encoding is replaced by "identity":
# compressing on a LAN costs more than it saves, and usage must stay readable.
_REQUEST_SKIP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailer", "transfer-encoding", "upgrade", "host", "content-length", "accept-encoding",
    "expect",
    # aiohttp inflates a gzip or deflate body as it reads it: what goes on is
    # the plain body, so its encoding must not (engines answered 500 to it).
    "content-encoding",
})
# What aiohttp's server inflates; anything else is refused with 415.
_BODY_ENCODINGS = frozenset({"identity", "gzip", "x-gzip", "deflate"})
class Proxy:
    """The ``/v1`` POST handlers of one gateway."""

    def __init__(self, fleet: LiveFleet, metrics: GatewayMetrics) -> None:
        self.fleet = fleet
        self.metrics = metrics
        self.forwarder = Forwarder(fleet, metrics)

    @property
    def upstream(self) -> UpstreamClient | None:
        """The client to the engines, opened at the app's startup."""
        return self.forwarder.upstream

    @upstream.setter
    def upstream(self, client: UpstreamClient | None) -> None:
        self.forwarder.upstream = client

    @property
    def gate(self) -> AdmissionGate:
        return self.forwarder.gate

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self.handle(request, CHAT)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.handle(request, COMPLETIONS)

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        return await self.handle(request, EMBEDDINGS)

    # -- admission -------------------------------------------------------------

    async def handle(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        t0 = time.monotonic()
        cfg = self.fleet.config
        if cfg.api_keys and not authorized(request, cfg.api_keys):
            self._done(request, INVALID_POOL, 401)
            return error_response(401, "invalid or missing API key (Authorization: Bearer ...)",
                                  "invalid_api_key")
        got = await self._read_body(request, cfg.max_body_bytes, cfg.client.body_timeout_s)
        if isinstance(got, web.Response):
            self._done(request, INVALID_POOL, got.status)
            return got
        body = got
        try:
            req = parse_request(endpoint, body)
        except InvalidRequest as exc:
            self._done(request, INVALID_POOL, 400)
            return error_response(400, str(exc), exc.code, param=exc.param)
        if not self.fleet.serves(req.model):
            self._done(request, UNKNOWN_POOL, 404)
            served = ", ".join(self.fleet.served_models()[:20])
            return error_response(404, f"the model {req.model!r} does not exist "
                                       f"(served: {served})", "model_not_found", param="model")
        note(pool=req.model)
        try:
            return await self._forward(request, endpoint, body, req, t0)
        except asyncio.CancelledError:
            # The client went away (aiohttp cancels the handler); tickets are
            # released by the attempt's finally.
            self._done(request, req.model, CLIENT_CLOSED)
            raise

    def _done(self, request: web.Request, pool: str, status: int) -> None:
        count_answer(self.metrics, request, pool, status)

    async def _read_body(self, request: web.Request, limit: int,
                         timeout_s: float) -> bytes | web.Response:
        """The request body (inflated), or the error response that refuses it."""
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in _BODY_ENCODINGS:
            resp = error_response(415, f"Content-Encoding {encoding!r} is not supported "
                                       "(gzip, deflate or none)", "unsupported_encoding")
            resp.force_close()
            return resp
        length = request.content_length
        body: bytes | None
        try:
            if (length is not None and encoding == "identity" and length <= limit
                    and request.content.is_eof()):
                body = await request.read()  # arrived with the headers: nothing to wait for
            else:
                async with asyncio.timeout(timeout_s):
                    if length is not None and encoding == "identity":
                        body = None if length > limit else await request.read()
                    else:  # chunked, or encoded: the limit applies to what it inflates to
                        body = await _read_limited(request, limit)
        except TimeoutError:
            resp = error_response(408, f"the request body did not arrive within {timeout_s:g} s",
                                  "body_timeout")
            resp.force_close()
            return resp
        except (web.RequestPayloadError, PayloadEncodingError, zlib.error) as exc:
            resp = error_response(400, f"the request body is not valid {encoding}: {exc}",
                                  "invalid_encoding")
            resp.force_close()
            return resp
        if body is None:
            resp = error_response(413, f"the request body exceeds {limit} bytes",
                                  "body_too_large")
            resp.force_close()  # do not read the rest of a huge body to keep the connection
            return resp
        return body

    # -- routing and failover ----------------------------------------------------

    async def _forward(self, request: web.Request, endpoint: str, body: bytes,
                       req: RoutedRequest, t0: float) -> web.StreamResponse:
        settings = self.fleet.pool_settings(req.model)
        deadline = asyncio.get_running_loop().time() + settings.timeouts.total_s
        call = Call(request, endpoint, body, req, settings, self._upstream_headers(request),
                    _priority(request), deadline, t0)
        return await self.forwarder.forward(call)

    def _upstream_headers(self, request: web.Request) -> CIMultiDict[str]:
        drop_auth = bool(self.fleet.config.api_keys)  # the client's key is the gateway's
        out: CIMultiDict[str] = CIMultiDict()
        for k, v in request.headers.items():
            low = k.lower()
            if low in _REQUEST_SKIP or (drop_auth and low == "authorization"):
                continue
            out.add(k, v)
        out["Accept-Encoding"] = "identity"
        out[REQUEST_ID_HEADER] = request_id()  # the engine's logs can be joined on it
        return out


def authorized(request: web.Request, keys: tuple[str, ...]) -> bool:
    """``Authorization: Bearer <key>`` with one of ``keys``, compared in constant time."""
    return bearer_ok(request.headers.get("Authorization", ""), keys)


async def _read_limited(request: web.Request, limit: int) -> bytes | None:
    """A body without Content-Length (chunked), or None once it exceeds ``limit``."""
    parts: list[bytes] = []
    size = 0
    async for data in request.content.iter_any():
        size += len(data)
        if size > limit:
            return None
        parts.append(data)
    return b"".join(parts)


def _priority(request: web.Request) -> int:
    return priority_of(request.headers.get(PRIORITY_HEADER))


__all__ = ["Proxy", "authorized"]
