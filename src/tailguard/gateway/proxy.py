"""The request path: route an OpenAI request to a node, forward it, account for it.

For ``POST /v1/chat/completions``, ``/v1/completions`` and ``/v1/embeddings``:

1. **Admit**: API key (when configured), body size (413 over
   ``max_body_bytes``), JSON and the fields routing needs (400, see
   :mod:`~tailguard.gateway.openai_request`), a served model (404).
2. **Pick**: ``balancer.pick`` returns a :class:`~tailguard.core.balancer.Ticket`
   (a permit on one node) or None (503 with ``Retry-After``).
3. **Forward** the client's bytes unchanged, with its headers minus the
   hop-by-hop ones, on a keep-alive connection to the node
   (:mod:`~tailguard.gateway.upstream`).
4. **Fail over** while nothing has reached the client yet: a connect error,
   a timeout, a 5xx or a 429 releases the ticket with its origin and picks
   another node not tried yet, within ``retries.attempts`` and the pool's
   :class:`~tailguard.gateway.retry_budget.RetryBudget`. A streamed answer is
   committed only when its first chunk arrived, so an engine that accepts the
   connection and then dies before the first token is failed over too. Once a
   byte went out, never: a later failure ends the stream with
   ``data: {"error": ...}``.
5. **Stream** SSE through as it arrives, byte for byte: per chunk the proxy
   counts ``data:`` events (:class:`~tailguard.gateway.sse.SseCounter`),
   notes the gap since the previous chunk and pushes the idle deadline; it
   never parses a chunk's JSON.
6. **Account**: ``on_first_token`` at the first streamed chunk,
   ``on_finish`` exactly once per ticket with the outcome's origin and the
   output tokens (the usage chunk or body when present, else counted events),
   in a ``finally`` so that a client disconnect (the handler is cancelled),
   a timeout or an upstream error all release it.

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
import contextlib
import functools
import hmac
import time
import zlib
from dataclasses import dataclass

from aiohttp import web
from aiohttp.http_exceptions import PayloadEncodingError
from multidict import CIMultiDict

from tailguard.core.admission import Shed
from tailguard.core.balancer import Ticket
from tailguard.core.fleet import Outcome
from tailguard.gateway.admission_gate import AdmissionGate, shed_response
from tailguard.gateway.api_errors import NODE_HEADER, error_response, sse_error_event
from tailguard.gateway.config import NodeConfig, PoolSettings, Timeouts
from tailguard.gateway.hedge import GatewayHedging, Send
from tailguard.gateway.idle import IdleTimeout
from tailguard.gateway.live_fleet import LiveFleet
from tailguard.gateway.logs import REQUEST_ID_HEADER, note, request_id
from tailguard.gateway.metrics import INVALID_POOL, UNKNOWN_POOL, GatewayMetrics
from tailguard.gateway.openai_request import (
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    PATHS,
    InvalidRequest,
    RoutedRequest,
    parse_request,
)
from tailguard.gateway.sse import SseCounter, usage_completion_tokens
from tailguard.gateway.upstream import (
    UpstreamClient,
    UpstreamConnectError,
    UpstreamError,
    UpstreamResponse,
)

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
_RESPONSE_SKIP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "content-length", "date",
})
CLIENT_CLOSED = 499  # nginx's code for "the client went away", used in metrics only
PRIORITY_HEADER = "x-tailguard-priority"
RETRY_AFTER_S = "1"


@dataclass(frozen=True, slots=True)
class Failure:
    """A failed attempt that nothing was sent to the client for: it may be retried."""

    origin: Outcome
    status: int  # what the client gets if no retry succeeds
    message: str
    code: str
    retry_after: str | None = None
    # A 5xx may be the request's doing rather than the node's: it is charged
    # only once another node answered the same request (see _forward).
    judged: bool = True


class _ClientGone(Exception):
    """Writing to the client failed: it disconnected."""


# Set once the request's status is in the metrics (a late disconnect must not count it again).
_COUNTED = web.RequestKey("tailguard_counted", int)


class _Verdicts:
    """The request's 5xx answers not charged yet, and whether another node then served it."""

    __slots__ = ("pending", "served")

    def __init__(self) -> None:
        self.pending: list[str] = []  # nodes whose 5xx waits for a second opinion
        self.served = False  # a node answered it with 2xx


class Proxy:
    """The ``/v1`` POST handlers of one gateway."""

    def __init__(self, fleet: LiveFleet, metrics: GatewayMetrics) -> None:
        self.fleet = fleet
        self.metrics = metrics
        self.upstream: UpstreamClient | None = None  # opened at the app's startup
        self.gate = AdmissionGate(fleet, metrics)  # limits and the queue (issue 4)
        self.hedging = GatewayHedging(fleet, metrics.hedge)  # pools with hedging on

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
        """Count the request's answer, once whatever happens after (a late disconnect)."""
        if _COUNTED not in request:
            request[_COUNTED] = status
            self.metrics.request_done(pool, status)

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
        fleet = self.fleet
        balancer = fleet.balancer
        model = req.model
        settings = fleet.pool_settings(model)
        budget = fleet.budget(model)
        budget.deposit()
        deadline = asyncio.get_running_loop().time() + settings.timeouts.total_s
        headers = self._upstream_headers(request)
        priority = _priority(request)
        tried: list[str] = []
        failure: Failure | None = None
        verdicts = _Verdicts()
        try:
            for attempt in range(settings.retries.attempts):
                now = time.monotonic()
                if attempt and not budget.try_spend(now):
                    break
                if attempt == 0:  # may wait in the pool's queue; retries never do
                    got = await self.gate.admit(request, model, req.prompt_tokens,
                                                req.max_tokens, priority, len(body))
                    if isinstance(got, Shed):
                        note(origin=f"shed_{got.reason}")
                        self._done(request, model, 429)
                        return shed_response(got, model)
                    ticket = got
                else:
                    ticket = balancer.pick(model, req.prompt_tokens, now, req.max_tokens,
                                           priority, tried)
                if ticket is None:
                    break
                node = fleet.nodes.get(ticket.node_id)
                if node is None:  # cannot happen: the fleet adds nodes to both at once
                    balancer.on_finish(ticket, now, Outcome.CLIENT_ERROR, 0)
                    break
                if failure is not None:
                    self.metrics.retry(model, failure.origin.value)
                if not req.stream:  # no first token to see: the core presumes one
                    balancer.expect_no_first_token(ticket, time.monotonic())
                tried.append(node.id)
                result = await self._attempt(request, endpoint, node, ticket, body, headers,
                                             req, settings, deadline, t0, verdicts)
                if not isinstance(result, Failure):
                    if attempt:
                        note(attempts=attempt + 1)
                    return result
                failure = result
                if not result.judged:
                    verdicts.pending.append(node.id)
                self.metrics.upstream_error(node.id, failure.origin.value)
        finally:
            self._judge(verdicts, model)
        if failure is None:
            note(origin="no_capacity")
            self._done(request, model, 503)
            return error_response(503, f"no node can take a request for {model!r} now",
                                  "no_capacity", headers={"Retry-After": RETRY_AFTER_S})
        note(origin=failure.origin.value, attempts=len(tried))
        self._done(request, model, failure.status)
        extra = {"Retry-After": failure.retry_after} if failure.retry_after else None
        message = failure.message
        if len(set(verdicts.pending)) >= 2:
            message = (f"nodes {', '.join(dict.fromkeys(verdicts.pending))} all failed this "
                       f"request (last: {failure.message}); the request itself is the likely "
                       "cause")
        return error_response(failure.status, message, failure.code, tried[-1], extra)

    def _judge(self, verdicts: _Verdicts, model: str) -> None:
        """Charge the 5xx answers of the request's earlier attempts, now that it is known whose.

        Another node served the request: the earlier failures were their
        nodes' own. Two nodes or more failed it and none served it: the
        request caused them (a body every engine refuses), nobody is charged.
        A single 5xx with no second opinion stays uncharged too: the retry
        budget gives enough second opinions to catch a node that fails
        every request, and none to condemn a healthy one.
        """
        pending = verdicts.pending
        if not pending:
            return
        if verdicts.served:
            now = time.monotonic()
            for node_id in pending:
                self.fleet.balancer.blame(node_id, Outcome.UPSTREAM_5XX, now)
            self.metrics.failure_verdicts.labels("node").inc(len(pending))
        elif len(set(pending)) >= 2:
            self.metrics.failure_verdicts.labels("request").inc(len(pending))
        else:
            self.metrics.failure_verdicts.labels("unknown").inc(len(pending))

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

    async def _first_chunk(self, endpoint: str, body: bytes, to: Timeouts, node: NodeConfig,
                           headers: CIMultiDict[str]) -> tuple[UpstreamResponse, bytes]:
        """POST ``body`` to ``node``; its answer with the first chunk of a stream read,
        or the whole body of anything else."""
        upstream = self.upstream
        assert upstream is not None
        resp = await upstream.post(node.url + PATHS[endpoint], headers, body, to.connect_s)
        try:
            if resp.streamed:
                return resp, await resp.readany()
            return resp, await resp.read()
        except BaseException:
            resp.close()
            raise

    # -- one attempt on one node ---------------------------------------------------

    async def _attempt(self, request: web.Request, endpoint: str, node: NodeConfig,
                       ticket: Ticket, body: bytes, headers: CIMultiDict[str],
                       req: RoutedRequest, settings: PoolSettings, deadline: float,
                       t0: float, verdicts: _Verdicts) -> web.StreamResponse | Failure:
        balancer = self.fleet.balancer
        loop = asyncio.get_running_loop()
        to = settings.timeouts
        # Whatever escapes below without setting it (a cancellation: the client
        # went away) releases the ticket as cancelled by the client.
        outcome = Outcome.CLIENT_CANCELLED
        tokens = 0
        judged = True
        timed = True
        resp: UpstreamResponse | None = None
        key = node.upstream_api_key()
        if key:
            headers = headers.copy()
            headers["Authorization"] = f"Bearer {key}"
        try:
            first_deadline = deadline
            if req.stream:
                first_deadline = min(deadline, loop.time() + to.first_byte_s)
            payload = b""
            try:
                async with asyncio.timeout_at(first_deadline):
                    hedger = self.hedging.hedger(req.model) if req.stream else None
                    if hedger is not None:  # perhaps a duplicate to a second node (hedge.py)
                        send: Send = functools.partial(self._first_chunk, endpoint, body, to)
                        node, ticket, resp, payload = await self.hedging.first_chunk(
                            hedger, req.model, node, ticket, headers, send, req.prompt_tokens,
                            req.max_tokens, _priority(request))
                    else:
                        resp, payload = await self._first_chunk(endpoint, body, to, node,
                                                                headers)
                    streamed = resp.streamed
            except UpstreamConnectError as exc:
                outcome = Outcome.CONNECT_FAILURE
                return Failure(outcome, 502, f"cannot connect to node {node.id}: {exc}",
                               "upstream_connect_failed")
            except TimeoutError:
                outcome = Outcome.TIMEOUT
                what = "first byte" if first_deadline < deadline else "answer"
                return Failure(outcome, 504, f"node {node.id} sent no {what} in time",
                               "upstream_timeout")
            except (UpstreamError, OSError) as exc:
                outcome = Outcome.CONNECT_FAILURE
                return Failure(outcome, 502, f"node {node.id} failed: "
                                             f"{type(exc).__name__}: {exc}", "upstream_error")
            status = resp.status
            if status >= 500:
                outcome = Outcome.UPSTREAM_5XX
                judged = False
                return Failure(outcome, 502, f"node {node.id} answered {status}: "
                                             f"{_snippet(payload)}", "upstream_error",
                               judged=False)
            if status == 429:
                outcome = Outcome.UPSTREAM_429
                return Failure(outcome, 503, f"node {node.id} is overloaded (429) and no other "
                                             "node could take the request", "upstream_busy",
                               resp.headers.get("Retry-After") or RETRY_AFTER_S)
            if not streamed:
                now = time.monotonic()
                if status >= 400:  # the engine refused the request itself: pass it on
                    outcome = Outcome.CLIENT_ERROR
                else:
                    outcome = Outcome.OK
                    verdicts.served = True
                    tokens = usage_completion_tokens(payload) or 0
                    self.metrics.answered(req.model, node.id, node.gpu_class, now - t0, tokens)
                    note(tokens=tokens)
                balancer.on_finish(ticket, now, outcome, tokens)
                self._done(request, req.model, status)
                return web.Response(status=status, body=payload,
                                    headers=_response_headers(resp, node.id))
            if not payload:
                outcome = Outcome.UPSTREAM_5XX
                return Failure(outcome, 502, f"node {node.id} ended its stream before any data",
                               "upstream_error")
            # Committed: from here on, the client has the answer's first bytes.
            verdicts.served = status < 400
            outcome, tokens, timed, out = await self._stream(request, node, ticket, resp,
                                                             payload, req, to, deadline, t0)
            return out
        finally:
            if not ticket.released:
                balancer.on_finish(ticket, time.monotonic(), outcome, tokens, judged=judged,
                                   timed=timed)
            if resp is not None:
                if outcome is Outcome.OK or outcome is Outcome.CLIENT_ERROR:
                    resp.release()  # read to the end: the connection is reusable
                else:
                    resp.close()

    async def _stream(self, request: web.Request, node: NodeConfig, ticket: Ticket,
                      resp: UpstreamResponse, first: bytes, req: RoutedRequest,
                      to: Timeouts, deadline: float,
                      t0: float) -> tuple[Outcome, int, bool, web.StreamResponse]:
        """Pass a stream through.

        Returns the outcome, the output tokens, whether the stream's pace was
        the node's (False when the client read slowly: the gateway's writes to
        it were held back, so its time per token says nothing of the node)
        and the response.
        """
        balancer = self.fleet.balancer
        loop = asyncio.get_running_loop()
        t_first = time.monotonic()
        # Its prefill is learnt at the end, once the usage says what was cached.
        balancer.on_first_token(ticket, t_first, defer_prefill=True)
        out = web.StreamResponse(status=resp.status, headers=_response_headers(resp, node.id))
        counter = SseCounter()
        counter.feed(first)
        protocol = request.protocol
        pauses = getattr(protocol, "write_pauses", 0)
        try:
            await out.prepare(request)
            await out.write(first)
        except ConnectionError:
            self._done(request, req.model, CLIENT_CLOSED)
            return Outcome.CLIENT_CANCELLED, counter.output_tokens(), False, out
        last = t_first
        max_gap = 0.0
        idle = to.idle_s
        write_s = self.fleet.config.client.write_timeout_s
        error: tuple[Outcome, int, str, str] | None = None
        watchdog = IdleTimeout(loop, idle, deadline, write_s)
        try:
            async with watchdog:
                while True:
                    chunk = await resp.readany()
                    if not chunk:
                        break
                    now = time.monotonic()
                    if now - last > max_gap:
                        max_gap = now - last
                    last = now
                    counter.feed(chunk)
                    watchdog.touch()
                    watchdog.writing = True
                    try:
                        await out.write(chunk)
                    except ConnectionError as exc:
                        raise _ClientGone from exc
                    watchdog.writing = False
        except _ClientGone:
            self._done(request, req.model, CLIENT_CLOSED)
            return Outcome.CLIENT_CANCELLED, counter.output_tokens(), False, out
        except TimeoutError:
            if watchdog.cause == "client":
                # It read nothing for write_s: the client's doing, never the node's.
                note(origin="client_slow_read")
                self.metrics.client_closed_reason("slow_reader")
                self._done(request, req.model, CLIENT_CLOSED)
                if request.transport is not None:
                    request.transport.abort()
                return Outcome.CLIENT_CANCELLED, counter.output_tokens(), False, out
            total = watchdog.cause == "total"
            error = (Outcome.TIMEOUT, 504,
                     f"node {node.id} exceeded the request's total time" if total
                     else f"node {node.id} sent nothing for {idle:g} s", "upstream_timeout")
        except (UpstreamError, OSError) as exc:
            error = (Outcome.CONNECT_FAILURE, 502,
                     f"node {node.id} failed in the middle of the stream: "
                     f"{type(exc).__name__}", "upstream_disconnected")
        tokens = counter.output_tokens()
        timed = getattr(protocol, "write_pauses", 0) == pauses
        now = time.monotonic()
        if error is None and counter.engine_error():
            # The engine ended the stream with its own error event: relayed as it
            # is, but no success. The request may have caused it: unjudged.
            note(origin="engine_error_mid_stream", tokens=tokens)
            balancer.on_finish(ticket, now, Outcome.UPSTREAM_5XX, tokens, judged=False,
                               timed=False, cached_tokens=counter.cached_tokens())
            self.metrics.upstream_error(node.id, "engine_error")
            self._done(request, req.model, 502)
            await _end_stream(out, write_s)
            return Outcome.UPSTREAM_5XX, tokens, False, out
        if error is not None:
            origin, status, message, code = error
            if origin is Outcome.TIMEOUT and not timed:
                origin = Outcome.CLIENT_CANCELLED  # the wait overlapped the client's stalls
            note(origin=origin.value, tokens=tokens)
            balancer.on_finish(ticket, now, origin, tokens, timed=False,
                               cached_tokens=counter.cached_tokens())
            self.metrics.upstream_error(node.id, origin.value)
            self._done(request, req.model, status)
            await _end_stream(out, write_s, sse_error_event(status, message, code))
            return origin, tokens, False, out
        balancer.on_finish(ticket, now, Outcome.OK, tokens, timed=timed,
                           cached_tokens=counter.cached_tokens())
        tpot = (now - t_first) / (tokens - 1) if tokens >= 2 else None
        self.metrics.answered(req.model, node.id, node.gpu_class, now - t0, tokens,
                              ttft=t_first - t0, tpot=tpot, max_gap=max_gap)
        note(ttft_s=round(t_first - t0, 4), tokens=tokens)
        self._done(request, req.model, resp.status)
        await _end_stream(out, write_s)
        return Outcome.OK, tokens, timed, out


async def _end_stream(out: web.StreamResponse, write_s: float, last: bytes = b"") -> None:
    """Write ``last`` (an SSE error event) and end the stream; a client gone or not
    reading for ``write_s`` is left as it is: the answer is accounted already."""
    with contextlib.suppress(ConnectionError, TimeoutError):
        async with asyncio.timeout(write_s):
            if last:
                await out.write(last)
            await out.write_eof()


def authorized(request: web.Request, keys: tuple[str, ...]) -> bool:
    """``Authorization: Bearer <key>`` with one of ``keys``, compared in constant time."""
    header = request.headers.get("Authorization", "")
    if not header.startswith("Bearer "):
        return False
    given = header[7:].strip().encode()
    ok = False
    for k in keys:  # no early exit: the time taken does not reveal which key matched
        ok |= hmac.compare_digest(given, k.encode())
    return ok


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
    raw = request.headers.get(PRIORITY_HEADER)
    if raw is None:
        return 1
    return {"0": 0, "high": 0, "2": 2, "low": 2}.get(raw.strip().lower(), 1)


def _response_headers(resp: UpstreamResponse, node_id: str) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in resp.headers.items():
        if k.lower() not in _RESPONSE_SKIP:
            out.add(k, v)
    out[NODE_HEADER] = node_id
    return out


def _snippet(payload: bytes, limit: int = 200) -> str:
    text = payload[:limit].decode("utf-8", "replace").strip()
    return text + ("..." if len(payload) > limit else "") if text else "(empty body)"


__all__ = ["Failure", "Proxy", "authorized"]
