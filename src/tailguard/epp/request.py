"""The request side of one request seen through ext_proc (:mod:`tailguard.epp.picker`).

Headers are kept and the reply waits for the body's end (full duplex); the
body is checked as the proxy checks it (size 413, JSON and fields 400, model
404); then the exchange arrives and its first actions become the routing
headers, a wait in the pool's queue, or an ``ImmediateResponse``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from tailguard.adapters.admission_gate import TTFT_HEADER, shed_error, ttft_budget
from tailguard.adapters.logs import CLIENT_CLOSED
from tailguard.adapters.metrics import INVALID_POOL, UNKNOWN_POOL
from tailguard.adapters.openai_request import (
    PATHS,
    PRIORITY_HEADER,
    SESSION_HEADER,
    InvalidRequest,
    bearer_ok,
    parse_request,
    priority_of,
    session_key,
)
from tailguard.adapters.sse import SseCounter
from tailguard.core.exchange import (
    NO_CAPACITY,
    Action,
    Copy,
    Dispatch,
    Exchange,
    Fail,
    Queue,
    Refuse,
    Request,
)
from tailguard.epp.protocol import (
    CONTINUE_HEADERS,
    DUPLEX,
    NO_BODY,
    OBJECTIVE,
    SUBSET,
    SUBSET_NAMESPACE,
    body_echo,
    header,
    immediate,
    metadata,
    read_headers,
)
from tailguard.epp.response import ResponseSide

if TYPE_CHECKING:
    from tailguard.epp.picker import EndpointPicker

log = logging.getLogger("tailguard.epp")

_ENDPOINTS = {path: name for name, path in PATHS.items()}
ORPHAN_S = 2.0  # how long a routed request waits for its observer stream to join


class PickedRequest(ResponseSide):
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
        # The response body in full duplex too: Envoy forwards only what comes back.
        self.response_duplex = False
        # The picker's stream does not carry the response: an observer's will (or, where
        # Envoy did not say, a clean close of the picker's stream says so).
        self.observed_elsewhere: bool | None = None
        self.body = bytearray()
        self.ex: Exchange | None = None
        self.copy: Copy | None = None  # the copy the data plane is running
        self.endpoints: list[str] = []  # the list handed to the data plane
        self.pos = 0  # where in it the data plane is
        self.status = 0
        self.counter: SseCounter | None = None
        self.tail = b""
        self.t_first = self.t_chunk = 0.0
        self.tell_at = 0.0  # when the detector next wants the stream's progress
        self.counted = False
        self.subset: list[str] | None = None  # the data plane's subset hint (endpoints)

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
            self._response_body(b"", True, reply=False)  # the body's end, answered already
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        if kind == "request_trailers":
            return [pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
        return []

    def _request_headers(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        self.headers = read_headers(msg.request_headers)
        self.subset = metadata(msg, SUBSET_NAMESPACE, SUBSET)  # it comes with the headers
        if msg.HasField("protocol_config"):
            self.duplex = msg.protocol_config.request_body_mode == DUPLEX
            self.response_duplex = msg.protocol_config.response_body_mode == DUPLEX
            self.observed_elsewhere = msg.protocol_config.response_body_mode == NO_BODY
        if msg.request_headers.end_of_stream:
            return [self._bodyless()]
        return [] if self.duplex else [CONTINUE_HEADERS]

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
        self.ex = picker.exchange_type(
            fleet.balancer,
            Request(req.model, req.prompt_tokens, req.max_tokens, self._priority(), req.stream,
                    ttft_budget(h.get(TTFT_HEADER)), len(body), exclude, req.prefix,
                    session_key(h.get(SESSION_HEADER), req)),
            # The data plane sends no duplicate, and cannot splice a continuation
            # into an answer it has started relaying (docs/epp.md, "Migration").
            hedge=False, migrate=False)
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
        addresses = fleet.addresses()
        self.endpoints = [addresses[copy.node_id]]
        prefiller = None
        if copy.prefill_node is not None:
            # Two legs: the decode endpoint's sidecar runs the prefill leg on this one.
            # No fallback list: another decode endpoint would need its own pair.
            prefiller = addresses[copy.prefill_node]
        elif not self.picker.single_endpoint:
            self.endpoints += [addresses[n] for n in ex.fallbacks(time.monotonic())]
        value = ",".join(self.endpoints)
        reply = self.picker.routing_reply(value, fleet.nodes[copy.node_id].upstream_api_key(),
                                          self.duplex, prefiller)
        if not self.duplex:  # buffered: the routing rides on the body's reply
            return [reply]
        echo = body_echo(bytes(self.body))
        self.body = bytearray()
        return [reply, echo]

    def _bodyless(self) -> pb.ProcessingResponse:
        """A request without a body: the model list, or a 404 naming what is routed."""
        h = self.headers
        path = h.get(":path", "").split("?", 1)[0]
        if h.get(":method") == "GET" and path == "/v1/models":  # not counted, as under serve
            data = [{"id": m, "object": "model", "owned_by": "tailguard"}
                    for m in self.picker.fleet.served_models()]
            return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
                status={"code": 200},
                headers=pb.HeaderMutation(set_headers=[header("content-type",
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

    def stream_closed(self, observer: bool, ended: bool) -> None:
        """One of its streams ended.

        The observer's stream ends with the HTTP request: it settles everything.
        While an observer is joined, the picker stream's end means nothing
        (Envoy closes it, or resets it, once the request is routed). Without
        one, a picker stream's end is the request's when it came before the
        routing, or when it saw the response. Once routed, with the response
        going to an observer (the picker's filter takes no response body, or,
        where Envoy did not say, the stream closed cleanly), it waits a moment
        for the observer to join: Envoy opens that stream as the routing reply
        reaches it, so the two may arrive in either order, reset or not."""
        if observer:
            self.observer_done = True
            self.close()
        elif self.observed and not self.observer_done:
            return
        elif self.answered and self.observed_elsewhere and not self.observed:
            # One filter that takes the response headers but no body (mode NONE): Envoy
            # closes the stream once it has them, and the answer's end is never seen, so
            # the request is released as served then (see deploy/envoy/README.md).
            self._unseen_body_ended()
            self.close()
        elif self.copy is None or self.answered or self.rid is None or self.observer_done \
                or not (ended if self.observed_elsewhere is None else self.observed_elsewhere):
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
