"""The endpoint picker: the exchange's third driver, behind Envoy's ext_proc.

An Envoy-based gateway (Envoy Gateway, kgateway, Istio, GKE, or a plain
Envoy, ``deploy/envoy/``) opens one ext_proc stream per HTTP request
(``envoy.service.ext_proc.v3.ExternalProcessor/Process``). This module
answers it as the Gateway API Inference Extension's endpoint picker
(protocol v1, GIE ``docs/proposals/004-endpoint-picker-protocol``), with the
same :class:`~tailguard.core.exchange.Exchange` as ``tailguard serve``:

* **request headers**: kept; the reply waits for the body's end (Envoy's
  ``FULL_DUPLEX_STREAMED`` request body mode), or goes at once in
  ``BUFFERED`` mode, where the routing rides on the body's reply instead;
* **request body**: gathered to its end, checked like the proxy checks it
  (size 413, JSON and fields 400, model 404); then the exchange arrives:
  :class:`~tailguard.core.exchange.Dispatch` answers with
  ``x-gateway-destination-endpoint: ip:port[,ip:port...]`` (the primary,
  then :meth:`Exchange.fallbacks`: tailguard's own retry order is the list),
  the same value in ``dynamic_metadata["envoy.lb"]``, and the body streamed
  back unchanged; :class:`~tailguard.core.exchange.Queue` holds the reply
  (the request waits in Envoy) until the pool's queue places it;
  :class:`~tailguard.core.exchange.Refuse` is an ``ImmediateResponse`` 429
  with ``Retry-After``; no node, or none in the data plane's subset hint
  (``metadata_context["envoy.lb.subset_hint"]``), a 503;
* **response headers**: the served endpoint
  (``metadata_context["envoy.lb"]["x-gateway-destination-endpoint-served"]``,
  else the header of that name, else the node id in ``x-tailguard-node``
  that ``deploy/envoy/`` adds from the endpoint's metadata) says whether
  Envoy fell back: each endpoint
  passed over is :meth:`Exchange.redirected` to the next, so the permit and
  the blame follow the request. Envoy's ``x-envoy-attempt-count`` does the
  same where no endpoint answered. A 5xx or 429 is the exchange's ``failed``
  (final: Envoy has no fallback left); a 5xx Envoy made itself (no upstream
  answered) is replaced by an OpenAI-style error;
* **response body** (``STREAMED``: each chunk answered at once, unchanged):
  the first chunk is the first token, the end of the stream the finish,
  counted as the proxy counts it (:class:`~tailguard.gateway.sse.SseCounter`:
  events and the usage chunk, never a chunk's JSON parsed).

Two shapes of Envoy configuration work (``tailguard envoy-config``):

* **one filter** (GIE's reference shape): the response goes through the
  picker's stream too, and Envoy waits for a reply to each response message
  (one gRPC round trip before the first token reaches the client, and one per
  chunk);
* **picker and observer** (the default of ``deploy/envoy/``): the picker's
  filter handles the request only; a second ext_proc filter in
  ``observability_mode`` sends the request headers and the whole response
  without waiting for anything. The two streams of one request are joined on
  ``x-request-id`` (:attr:`EndpointPicker.live`); nothing is sent back on the
  observer's. Replacing Envoy's own error answers is then Envoy's
  ``local_reply_config``.

The request's end releases every permit exactly once: the stream that sees
the response ends with the HTTP request (the observer's, or the one filter's).
One that ends before the response did (the client left, the upstream reset
mid-stream, Envoy gave up) is the exchange's ``client_gone``. Envoy does not
say which of these it was, so the node is not charged; a crashed node is
caught by its health checks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import (
    external_processor_pb2 as pb,
    external_processor_pb2_grpc as pb_grpc,
)
from google.protobuf import struct_pb2

from tailguard.core.exchange import (
    NO_CAPACITY,
    Action,
    Copy,
    Dispatch,
    Exchange,
    Fail,
    Failure,
    Queue,
    Refuse,
    Request,
)
from tailguard.core.fleet import Outcome
from tailguard.gateway.admission_gate import TTFT_HEADER, AdmissionGate, shed_error, ttft_budget
from tailguard.gateway.api_errors import NO_NODE, NODE_HEADER, error_body
from tailguard.gateway.live_fleet import LiveFleet
from tailguard.gateway.logs import CLIENT_CLOSED
from tailguard.gateway.metrics import INVALID_POOL, UNKNOWN_POOL, GatewayMetrics
from tailguard.gateway.openai_request import (
    PATHS,
    SESSION_HEADER,
    InvalidRequest,
    parse_request,
    session_key,
)
from tailguard.gateway.proxy import PRIORITY_HEADER, bearer_ok, priority_of
from tailguard.gateway.sse import SseCounter, usage_completion_tokens

log = logging.getLogger("tailguard.epp")

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
OBJECTIVE = "x-gateway-inference-objective"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
# Objective names understood without configuration (GIE's former criticality levels).
OBJECTIVES = {"critical": 0, "high": 0, "standard": 1, "normal": 1, "sheddable": 2, "low": 2}

_ENDPOINTS = {path: name for name, path in PATHS.items()}
_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
_TAIL = 4096  # of a non-streamed answer kept for its usage (it ends the body)
ORPHAN_S = 2.0  # how long a routed request waits for its observer stream to join
_CONTINUE_BODY = pb.ProcessingResponse(response_body=pb.BodyResponse())
_CONTINUE_HEADERS = pb.ProcessingResponse(request_headers=pb.HeadersResponse())


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key,
                                                                  raw_value=value.encode()))


def _headers(msg: pb.HttpHeaders) -> dict[str, str]:
    out = {}
    for h in msg.headers.headers:
        out[h.key.lower()] = h.raw_value.decode("latin-1") if h.raw_value else h.value
    return out


def _metadata(req: pb.ProcessingRequest, namespace: str, key: str) -> list[str] | None:
    """A string or list of strings under ``metadata_context.filter_metadata[namespace][key]``."""
    if not req.HasField("metadata_context"):
        return None
    ns = req.metadata_context.filter_metadata.get(namespace)
    if ns is None or key not in ns.fields:
        return None
    v = ns.fields[key]
    kind = v.WhichOneof("kind")
    if kind == "string_value":  # a header_to_metadata filter writes one comma-joined string
        return [e.strip() for e in v.string_value.split(",") if e.strip()]
    if kind == "list_value":
        return [e.string_value for e in v.list_value.values if e.string_value]
    return []


def immediate(status: int, message: str, code: str, headers: dict[str, str] | None = None,
              param: str | None = None) -> pb.ProcessingResponse:
    """An ``ImmediateResponse``: Envoy answers the client with an OpenAI-style error."""
    hdrs = {"content-type": "application/json", NODE_HEADER: NO_NODE, **(headers or {})}
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status={"code": status},
        headers=pb.HeaderMutation(set_headers=[_header(k, v) for k, v in hdrs.items()]),
        body=error_body(status, message, code, param), details=code))


class EndpointPicker(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """``ExternalProcessor/Process``: one :class:`_Exchange` per ext_proc stream."""

    def __init__(self, fleet: LiveFleet, metrics: GatewayMetrics,
                 objectives: dict[str, int] | None = None,
                 gate: AdmissionGate | None = None) -> None:
        self.fleet = fleet
        self.metrics = metrics
        # The pump of the pools' queues: the proxy's own where both run on one fleet.
        self.gate = gate or AdmissionGate(fleet, metrics)
        self.objectives = {**OBJECTIVES, **{k.lower(): v for k, v in (objectives or {}).items()}}
        self.exchange_type: type[Exchange] = Exchange  # tests put a tracing one here
        self.streams = 0  # open ext_proc streams (a gauge for tests and the admin view)
        self.live: dict[str, _Exchange] = {}  # by x-request-id, while a stream may join

    async def Process(self, requests: AsyncIterator[pb.ProcessingRequest],
                      context: Any) -> AsyncIterator[pb.ProcessingResponse]:
        self.gate.install()
        run: _Exchange | None = None
        observer = False
        ended = False  # Envoy half-closed the stream (else it was cancelled: a reset)
        self.streams += 1
        try:
            async for msg in requests:
                if run is None:
                    observer = msg.observability_mode
                    run = self._attach(msg, observer)
                if observer:  # observability mode: Envoy waits for no reply, reads none
                    run.observe(msg)
                    continue
                out = run.on_message(msg)
                if out is None:  # the request waits in the pool's queue
                    out = await run.queued()
                for resp in out:
                    yield resp
            ended = True
        finally:
            self.streams -= 1
            if run is not None:
                run.stream_closed(observer, ended)

    def _attach(self, msg: pb.ProcessingRequest, observer: bool) -> _Exchange:
        """The request's state, shared by its picker stream and its observer stream
        (joined on ``x-request-id``; whichever comes first makes it)."""
        rid = None
        if msg.WhichOneof("request") == "request_headers":
            for h in msg.request_headers.headers.headers:
                if h.key == "x-request-id":
                    rid = h.raw_value.decode("latin-1") if h.raw_value else h.value
                    break
        run = self.live.get(rid) if rid else None
        if run is None or (run.observed if observer else run.picked):
            run = _Exchange(self, rid)  # alone, or a second request with the same id
            if rid and rid not in self.live:
                self.live[rid] = run
        if observer:
            run.observed = True
        else:
            run.picked = True
        return run


class _Exchange:
    """One HTTP request seen through ext_proc: its messages, its exchange, its answer."""

    def __init__(self, picker: EndpointPicker, rid: str | None = None) -> None:
        self.picker = picker
        self.rid = rid
        self.picked = False  # a stream that routes it (not in observability mode) joined
        self.observed = False  # an observer stream (observability mode) joined
        self.observer_done = False
        self.answered = False  # response headers came
        self.closed = False
        self.t0 = time.monotonic()
        self.headers: dict[str, str] = {}
        self.duplex = False  # body streamed both ways: the headers reply waits for its end
        self.body = bytearray()
        self.ex: Exchange | None = None
        self.copy: Copy | None = None  # the copy the data plane is running
        self.endpoints: list[str] = []  # the list handed to the data plane
        self.pos = 0  # where in it the data plane is
        self.status = 0
        self.counter: SseCounter | None = None
        self.tail = b""
        self.t_first = 0.0
        self.tell_at = 0.0  # when the detector next wants the stream's progress
        self.counted = False
        self.subset: list[str] | None = None  # the data plane's subset hint (endpoints)

    # -- messages ------------------------------------------------------------------

    def on_message(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse] | None:
        kind = msg.WhichOneof("request")
        if kind == "response_body":
            return self._response_body(msg.response_body.body, msg.response_body.end_of_stream)
        if kind == "request_headers":
            return self._request_headers(msg)
        if kind == "request_body":
            return self._request_body(msg)
        if kind == "response_headers":
            return self._response_headers(msg)
        if kind == "response_trailers":
            out = self._response_body(b"", True)
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse()), *out[1:]]
        if kind == "request_trailers":
            return [pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
        return []

    def _request_headers(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        self.headers = _headers(msg.request_headers)
        self.subset = _metadata(msg, SUBSET_NAMESPACE, SUBSET)  # it comes with the headers
        self.duplex = (msg.HasField("protocol_config")
                       and msg.protocol_config.request_body_mode == _DUPLEX)
        if msg.request_headers.end_of_stream:
            return [self._bodyless()]
        return [] if self.duplex else [_CONTINUE_HEADERS]

    def _request_body(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse] | None:
        part = msg.request_body
        self.body += part.body
        limit = self.picker.fleet.config.max_body_bytes
        if len(self.body) > limit:
            return self._refuse(INVALID_POOL, 413, f"the request body exceeds {limit} bytes",
                                "body_too_large")
        if not part.end_of_stream:
            # Full duplex: nothing goes back until the end. Else each chunk is let through.
            return [] if self.duplex else [pb.ProcessingResponse(request_body=pb.BodyResponse())]
        return self._route()

    # -- routing ---------------------------------------------------------------------

    def _route(self) -> list[pb.ProcessingResponse] | None:
        picker = self.picker
        fleet = picker.fleet
        cfg = fleet.config
        h = self.headers
        if cfg.api_keys and not bearer_ok(h.get("authorization", ""), cfg.api_keys):
            return self._refuse(INVALID_POOL, 401, "invalid or missing API key "
                                "(Authorization: Bearer ...)", "invalid_api_key")
        path = h.get(":path", "").split("?", 1)[0]
        endpoint = _ENDPOINTS.get(path)
        if endpoint is None:
            return self._refuse(INVALID_POOL, 404, f"no route {h.get(':method', 'POST')} {path}",
                                "not_found")
        body = bytes(self.body)
        try:
            req = parse_request(endpoint, body)
        except InvalidRequest as exc:
            return self._refuse(INVALID_POOL, 400, str(exc), exc.code, param=exc.param)
        if not fleet.serves(req.model):
            served = ", ".join(fleet.served_models()[:20])
            return self._refuse(UNKNOWN_POOL, 404, f"the model {req.model!r} does not exist "
                                f"(served: {served})", "model_not_found", param="model")
        exclude: tuple[str, ...] = ()
        subset = self.subset
        if subset is not None:
            allowed = {fleet.endpoints().get(e) for e in subset}
            pool = fleet.balancer.pools[req.model]
            exclude = tuple(n.id for n in pool.nodes if n.id not in allowed)
            if len(exclude) == len(pool.nodes):
                return self._refuse(req.model, 503, "no endpoint of the data plane's subset "
                                    f"serves {req.model!r}", NO_CAPACITY, {"retry-after": "1"})
        settings = fleet.pool_settings(req.model)
        self.ex = picker.exchange_type(
            fleet.balancer,
            Request(req.model, req.prompt_tokens, req.max_tokens, self._priority(), req.stream,
                    ttft_budget(h.get(TTFT_HEADER)), len(body), exclude, req.prefix,
                    session_key(h.get(SESSION_HEADER), req)),
            settings.retries, fleet.budget(req.model), None)
        return self._carry_out(self.ex.arrive(time.monotonic()))

    def _carry_out(self, actions: tuple[Action, ...]) -> list[pb.ProcessingResponse] | None:
        """The exchange's first actions: route, wait in the queue, or refuse."""
        ex = self.ex
        assert ex is not None
        model = ex.request.model
        for a in actions:
            if type(a) is Dispatch:
                return self._dispatch(a.copy)
            if type(a) is Queue:
                return None
            if type(a) is Refuse:
                self.picker.metrics.shed_request(model, a.shed.reason)
                message, code, retry_after = shed_error(a.shed, model)
                return self._refuse(model, 429, message, code, {"retry-after": retry_after})
            if type(a) is Fail:
                f = a.failure
                extra = {"retry-after": f.retry_after} if f.retry_after else None
                return self._refuse(model, f.status, f.message, f.code, extra)
        raise AssertionError(f"the exchange left nothing to do: {actions!r}")

    async def queued(self) -> list[pb.ProcessingResponse]:
        """Wait in the pool's queue, then carry out what its decision says."""
        assert self.ex is not None
        actions = await self.picker.gate.wait(self.ex)
        out = self._carry_out(actions)
        assert out is not None, "a queue decision queued again"
        return out

    def _dispatch(self, copy: Copy) -> list[pb.ProcessingResponse]:
        ex = self.ex
        assert ex is not None
        fleet = self.picker.fleet
        self.copy = copy
        nodes = fleet.nodes
        primary = nodes[copy.node_id]
        self.endpoints = [primary.endpoint] + [nodes[n].endpoint
                                              for n in ex.fallbacks(time.monotonic())]
        value = ",".join(self.endpoints)
        set_headers = [_header(DESTINATION, value)]
        key = primary.upstream_api_key()
        if key:
            set_headers.append(_header("authorization", f"Bearer {key}"))
        routing = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=set_headers))
        meta = struct_pb2.Struct()
        meta.update({LB_NAMESPACE: {DESTINATION: value}})
        if not self.duplex:  # buffered: the routing rides on the body's reply
            return [pb.ProcessingResponse(request_body=pb.BodyResponse(response=routing),
                                          dynamic_metadata=meta)]
        body = pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
            body=bytes(self.body), end_of_stream=True))
        self.body = bytearray()
        return [pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=routing),
                                      dynamic_metadata=meta),
                pb.ProcessingResponse(request_body=pb.BodyResponse(
                    response=pb.CommonResponse(body_mutation=body)))]

    def _refuse(self, pool: str, status: int, message: str, code: str,
                headers: dict[str, str] | None = None,
                param: str | None = None) -> list[pb.ProcessingResponse]:
        self._count(pool, status)
        return [immediate(status, message, code, headers, param)]

    def _bodyless(self) -> pb.ProcessingResponse:
        """A request without a body: the model list, or a 404 naming what is routed."""
        h = self.headers
        path = h.get(":path", "").split("?", 1)[0]
        if h.get(":method") == "GET" and path == "/v1/models":  # not counted, as under serve
            data = [{"id": m, "object": "model", "owned_by": "tailguard"}
                    for m in self.picker.fleet.served_models()]
            return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
                status={"code": 200},
                headers=pb.HeaderMutation(set_headers=[_header("content-type",
                                                               "application/json")]),
                body=json.dumps({"object": "list", "data": data}).encode()))
        if h.get(":method") != "POST":
            self._count(INVALID_POOL, 404)
            return immediate(404, f"no route {h.get(':method')} {path}", "not_found")
        self._count(INVALID_POOL, 400)
        return immediate(400, "the request has no body", "invalid_request")

    def _priority(self) -> int:
        h = self.headers
        objective = h.get(OBJECTIVE)
        if objective is not None:
            p = self.picker.objectives.get(objective.strip().lower())
            if p is not None:
                return p
        return priority_of(h.get(PRIORITY_HEADER))

    # -- the response ----------------------------------------------------------------

    def observe(self, msg: pb.ProcessingRequest) -> None:
        """A message of the observer stream: the response side only (the picker
        stream routes; Envoy does not wait for the observer, so nothing is sent)."""
        kind = msg.WhichOneof("request")
        if kind == "response_body":
            self._response_body(msg.response_body.body, msg.response_body.end_of_stream)
        elif kind == "response_headers" and not self.answered:
            self._response_headers(msg)
        elif kind == "response_trailers":
            self._response_body(b"", True)

    def _response_headers(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        self.answered = True
        ex = self.ex
        copy = self.copy
        if ex is None or copy is None or ex.ended is not None:
            return [pb.ProcessingResponse(response_headers=pb.HeadersResponse())]
        h = _headers(msg.response_headers)
        now = time.monotonic()
        self.status = status = int(h.get(":status", "0") or 0)
        upstream = "x-envoy-upstream-service-time" in h  # else Envoy made the answer itself
        served = _metadata(msg, LB_NAMESPACE, SERVED)
        where = served[0] if served else h.get(SERVED, "")
        if not where and h.get(NODE_HEADER) in self.picker.fleet.nodes:
            # Envoy named the node itself (from the endpoint's metadata, deploy/envoy/)
            where = self.picker.fleet.nodes[h[NODE_HEADER]].endpoint
        if where in self.endpoints:
            target = self.endpoints.index(where)
        else:
            tries = h.get("x-envoy-attempt-count", "1")
            target = min(int(tries) - 1 if tries.isdigit() else 0, len(self.endpoints) - 1)
            if where and where not in self.endpoints:
                # Envoy went outside the list (its fallback policy): follow it if the fleet knows it.
                self._walk(target, now)
                node_id = self.picker.fleet.endpoints().get(where)
                if node_id is None:
                    log.warning("%s served a request, and is no node of the fleet", where)
                    ex.client_gone(now)
                    return [pb.ProcessingResponse(response_headers=pb.HeadersResponse())]
                self._redirect(node_id, now)
                target = self.pos
        self._walk(target, now)
        copy = self.copy
        assert copy is not None
        node = self.picker.fleet.nodes.get(copy.node_id)
        model = ex.request.model
        set_headers = [_header(NODE_HEADER, copy.node_id)]
        if status >= 500 or status == 429:
            failure = self._failure(status, upstream, copy.node_id, h)
            self.picker.metrics.upstream_error(copy.node_id, failure.origin.value)
            ex.failed(copy, now, failure, final=True)
            if not upstream:  # Envoy's own text: an OpenAI-style error instead
                return self._refuse(model, failure.status, failure.message, failure.code,
                                    {"retry-after": failure.retry_after}
                                    if failure.retry_after else None)
            self._count(model, status)
        elif status < 400 and ex.request.stream and node is not None:
            self.counter = SseCounter()
        reply = pb.ProcessingResponse(response_headers=pb.HeadersResponse(
            response=pb.CommonResponse(header_mutation=pb.HeaderMutation(
                set_headers=set_headers, remove_headers=[SERVED]))))
        if msg.response_headers.end_of_stream:
            return [reply, *self._response_body(b"", True)[1:]]
        return [reply]

    def _walk(self, target: int, now: float) -> None:
        """The data plane moved down the list to ``endpoints[target]``: follow it."""
        endpoints = self.picker.fleet.endpoints()
        while self.pos < target:
            node_id = endpoints.get(self.endpoints[self.pos + 1])
            if node_id is None:  # left the fleet meanwhile
                break
            self._redirect(node_id, now)

    def _redirect(self, node_id: str, now: float) -> None:
        ex = self.ex
        copy = self.copy
        assert ex is not None and copy is not None
        failure = Failure(Outcome.UPSTREAM_5XX, 502, f"the data plane fell back from node "
                          f"{copy.node_id}", "upstream_error", judged=False)
        self.picker.metrics.upstream_error(copy.node_id, "fallback")
        self.picker.metrics.retry(ex.request.model, "fallback")
        for a in ex.redirected(copy, node_id, now, failure):
            if type(a) is Dispatch:
                self.copy = a.copy
        self.pos += 1

    def _failure(self, status: int, upstream: bool, node_id: str,
                 h: dict[str, str]) -> Failure:
        if status == 429:
            return Failure(Outcome.UPSTREAM_429, 503, f"node {node_id} is overloaded (429) and "
                           "no other node could take the request", "upstream_busy",
                           h.get("retry-after") or "1")
        if upstream:
            return Failure(Outcome.UPSTREAM_5XX, 502, f"node {node_id} answered {status}",
                           "upstream_error", judged=False)
        if status == 504:
            return Failure(Outcome.TIMEOUT, 504, f"node {node_id} sent no answer in time",
                           "upstream_timeout")
        return Failure(Outcome.CONNECT_FAILURE, 502, f"node {node_id} could not be reached "
                       f"({status} from the data plane)", "upstream_connect_failed")

    def _response_body(self, chunk: bytes, end: bool) -> list[pb.ProcessingResponse]:
        ex = self.ex
        copy = self.copy
        if ex is None or copy is None or ex.ended is not None:
            return [_CONTINUE_BODY]
        counter = self.counter
        if counter is not None:
            if chunk:
                now = time.monotonic()
                if self.t_first == 0.0:
                    self.t_first = now
                    ex.first_chunk(copy, now, defer_prefill=True)
                counter.feed(chunk)
                if now >= self.tell_at:  # long answers are judged piece by piece
                    self.tell_at = ex.streaming(copy, counter.output_tokens(), now)
        elif chunk:
            tail = self.tail + chunk
            self.tail = tail[-_TAIL:] if len(tail) > _TAIL else tail
        if end:
            self._finish(ex, copy)
        return [_CONTINUE_BODY]

    def _finish(self, ex: Exchange, copy: Copy) -> None:
        now = time.monotonic()
        metrics = self.picker.metrics
        model = ex.request.model
        node = self.picker.fleet.nodes.get(copy.node_id)
        gpu = node.gpu_class if node is not None else "unknown"
        counter = self.counter
        status = self.status
        if counter is None:  # not streamed, or an error answer: complete now
            ok = status < 400
            tokens = (usage_completion_tokens(self.tail) or 0) if ok else 0
            ex.finished(copy, now, Outcome.OK if ok else Outcome.CLIENT_ERROR, tokens)
            if ok:
                metrics.answered(model, copy.node_id, gpu, now - self.t0, tokens)
            self._count(model, status)
            return
        tokens = counter.output_tokens()
        cached = counter.cached_tokens(ex.request.prompt_tokens)
        if self.t_first == 0.0:  # a stream with no data
            ex.failed(copy, now, Failure(Outcome.UPSTREAM_5XX, 502, "empty stream",
                                         "upstream_error", judged=False), final=True)
            metrics.upstream_error(copy.node_id, Outcome.UPSTREAM_5XX.value)
            self._count(model, 502)
            return
        if counter.engine_error():
            ex.failed(copy, now, Failure(Outcome.UPSTREAM_5XX, 502, "engine error event",
                                         "upstream_error", judged=False), tokens, cached)
            metrics.upstream_error(copy.node_id, "engine_error")
            self._count(model, 502)
            return
        ex.finished(copy, now, Outcome.OK, tokens, cached_tokens=cached)
        t_first = self.t_first
        tpot = (now - t_first) / (tokens - 1) if tokens >= 2 else None
        metrics.answered(model, copy.node_id, gpu, now - self.t0, tokens,
                         ttft=t_first - self.t0, tpot=tpot)
        self._count(model, status)

    def _count(self, pool: str, status: int) -> None:
        if not self.counted:
            self.counted = True
            self.picker.metrics.request_done(pool, status)

    def stream_closed(self, observer: bool, ended: bool) -> None:
        """One of its streams ended.

        The observer's stream ends with the HTTP request: it settles everything.
        While an observer is joined, the picker stream's end means nothing
        (Envoy closes it, or resets it, once the request is routed). Without
        one, a picker stream's end is the request's when it was reset, or when
        it saw the response; a clean close after routing waits a moment for an
        observer to join (one configured joins at the request's start)."""
        if observer:
            self.observer_done = True
            self.close()
        elif self.observed and not self.observer_done:
            return
        elif not ended or self.answered or self.ex is None or self.rid is None \
                or self.observer_done:
            self.close()
        else:
            asyncio.get_running_loop().call_later(ORPHAN_S, self._orphan)

    def _orphan(self) -> None:
        if not self.observed:
            log.debug("request %s: no observer stream joined; released", self.rid)
            self.close()

    def close(self) -> None:
        """The request ended: whatever is still open is released (once)."""
        if self.rid is not None and self.picker.live.get(self.rid) is self:
            del self.picker.live[self.rid]
        ex = self.ex
        if ex is None or self.closed:
            return
        self.closed = True
        if ex.ended is None:
            tokens = self.counter.output_tokens() if self.counter is not None else 0
            ex.client_gone(time.monotonic(), tokens)
            self._count(ex.request.model, CLIENT_CLOSED)
        if ex.verdict is not None:
            verdict, n = ex.verdict
            self.picker.metrics.failure_verdicts.labels(verdict).inc(n)




__all__ = ["DESTINATION", "SERVED", "SERVICE", "EndpointPicker", "immediate"]
