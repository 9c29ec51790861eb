"""The response side of one request seen through ext_proc (:mod:`tailguard.epp.picker`).

The served endpoint says whether the data plane fell back down the list (each
endpoint passed over is :meth:`Exchange.redirected` to the next); a 5xx or 429
is the exchange's final ``failed``; the body's first chunk is the first token
and its end the finish, counted by :class:`~tailguard.adapters.sse.SseCounter`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from tailguard.adapters.api_errors import NODE_HEADER
from tailguard.adapters.sse import SseCounter, usage_completion_tokens
from tailguard.core.exchange import Copy, Dispatch, Exchange, Failure
from tailguard.core.fleet import STALL_S, Outcome
from tailguard.epp.protocol import (
    CONTINUE_BODY,
    LB_NAMESPACE,
    SERVED,
    header,
    immediate,
    metadata,
    read_headers,
    streamed_body,
)

if TYPE_CHECKING:
    from tailguard.epp.picker import EndpointPicker

log = logging.getLogger("tailguard.epp")

_TAIL = 4096  # of a non-streamed answer kept for its usage (it ends the body)


class ResponseSide:
    """What a request's answer teaches the exchange, and the refusal and request
    count both sides use; :class:`~tailguard.epp.request.PickedRequest` adds the
    request side and sets these fields."""

    picker: EndpointPicker
    t0: float
    answered: bool  # response headers came
    ex: Exchange | None
    copy: Copy | None  # the copy the data plane is running
    endpoints: list[str]  # the list handed to the data plane
    pos: int  # where in it the data plane is
    status: int
    counter: SseCounter | None
    tail: bytes
    t_first: float
    t_chunk: float  # the last chunk of the answer
    tell_at: float  # when the detector next wants the stream's progress
    counted: bool
    response_duplex: bool  # FULL_DUPLEX_STREAMED response body: each chunk is sent back
    observed_elsewhere: bool | None  # the picker's filter takes no response body
    observed: bool  # an observer stream joined

    @property
    def response_body_unseen(self) -> bool:
        """The picker's filter takes the response headers but no body, and no observer
        stream brings it: the first byte and the stream's end are all there is."""
        return bool(self.observed_elsewhere) and not self.observed

    def _unseen_body_ended(self) -> None:
        """The answer ended, its body unseen: served, its tokens unknown, its pace not
        learned (nothing but its first byte was timed)."""
        ex, copy = self.ex, self.copy
        if ex is None or copy is None or ex.ended is not None or self.status >= 400:
            return
        now = time.monotonic()
        model = ex.request.model
        if self.counter is not None:
            ex.stream_ended(copy, now, tokens=0, timed=False)
        else:
            ex.finished(copy, now, Outcome.OK, 0, timed=False)
        self._count(model, self.status)

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
        h = read_headers(msg.response_headers)
        now = time.monotonic()
        self.status = status = int(h.get(":status", "0") or 0)
        upstream = "x-envoy-upstream-service-time" in h  # else Envoy made the answer itself
        served = metadata(msg, LB_NAMESPACE, SERVED)
        where = served[0] if served else h.get(SERVED, "")
        if not where and h.get(NODE_HEADER) in self.picker.fleet.nodes:
            # Envoy named the node itself (from the endpoint's metadata, deploy/envoy/)
            where = self.picker.fleet.addresses()[h[NODE_HEADER]]
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
        set_headers = [header(NODE_HEADER, copy.node_id)]
        two_legs = copy.prefill_node is not None and copy.ticket.prefill is not None
        if two_legs and status < 400:
            # The decode endpoint's sidecar answers once its prefill leg is done and the
            # decode has begun: the hand-off (whatever it says is the data plane's to do).
            ex.prefilled(copy, now)
        if status >= 500 or status == 429:
            failure = self._failure(status, upstream, copy.node_id, h)
            if two_legs:  # which leg failed is the sidecar's to know: neither node is charged
                failure = dataclasses.replace(failure, judged=False)
            self.picker.metrics.upstream_error(copy.node_id, failure.origin.value)
            ex.failed(copy, now, failure, final=True)
            if not upstream:  # Envoy's own text: an OpenAI-style error instead
                return self._refuse(model, failure.status, failure.message, failure.code,
                                    {"retry-after": failure.retry_after}
                                    if failure.retry_after else None)
            self._count(model, status)
        elif status < 400 and ex.request.stream and node is not None:
            self.counter = SseCounter()
            if self.response_body_unseen:  # mode NONE: the headers come with the first byte
                self.t_first = self.t_chunk = now
                ex.first_chunk(copy, now, defer_prefill=True)
        reply = pb.ProcessingResponse(response_headers=pb.HeadersResponse(
            response=pb.CommonResponse(header_mutation=pb.HeaderMutation(
                set_headers=set_headers, remove_headers=[SERVED]))))
        if msg.response_headers.end_of_stream:
            self._response_body(b"", True, reply=False)  # no body: the answer ends here
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

    def _response_body(self, chunk: bytes, end: bool,
                       reply: bool = True) -> list[pb.ProcessingResponse]:
        """Account for one chunk of the answer; the reply Envoy waits for (``reply``):
        in full-duplex mode the chunk itself, streamed back (Envoy forwards only that),
        else the chunk let through unchanged."""
        out = ([streamed_body(chunk, end)] if self.response_duplex else [CONTINUE_BODY]) \
            if reply else []
        ex = self.ex
        copy = self.copy
        if ex is None or copy is None or ex.ended is not None:
            return out
        counter = self.counter
        if counter is not None:
            if chunk:
                now = time.monotonic()
                if self.t_first == 0.0:
                    self.t_first = now
                    ex.first_chunk(copy, now, defer_prefill=True)
                elif now - self.t_chunk >= STALL_S:  # its node may have stalled
                    ex.silent(copy, self.t_chunk, now)
                self.t_chunk = now
                counter.feed(chunk)
                if now >= self.tell_at:  # long answers are judged piece by piece
                    self.tell_at = ex.streaming(copy, counter.output_tokens(), now)
        elif chunk:
            tail = self.tail + chunk
            self.tail = tail[-_TAIL:] if len(tail) > _TAIL else tail
        if end:
            self._finish(ex, copy)
        return out

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
        data = self.t_first != 0.0
        # With no data, the data plane has no fallback left: final.
        end = ex.stream_ended(copy, now, tokens=tokens, data=data,
                              engine_error=counter.engine_error(), cached_tokens=cached,
                              final=not data)
        if end.failure is not None:
            metrics.upstream_error(copy.node_id, end.error)
            self._count(model, end.failure.status)
            return
        metrics.answered(model, copy.node_id, gpu, now - self.t0, tokens,
                         ttft=self.t_first - self.t0, tpot=end.tpot)
        self._count(model, status)

    def _refuse(self, pool: str, status: int, message: str, code: str,
                headers: dict[str, str] | None = None,
                param: str | None = None) -> list[pb.ProcessingResponse]:
        self._count(pool, status)
        return [immediate(status, message, code, headers, param)]

    def _count(self, pool: str, status: int) -> None:
        if not self.counted:
            self.counted = True
            self.picker.metrics.request_done(pool, status)
