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
  counted as the proxy counts it (:class:`~tailguard.adapters.sse.SseCounter`:
  events and the usage chunk, never a chunk's JSON parsed).

With ``single_endpoint`` (``tailguard epp --single-endpoint``) the header and
the metadata name the chosen endpoint alone: the setting for data planes that
route on the header by itself (an ``ORIGINAL_DST`` cluster with
``use_http_header``, older llm-d and GIE guides), which take one
``ip:port`` and whose retries go back to it. The picker then learns of a
failure from the response and charges the node; the next requests go
elsewhere.

Two shapes of Envoy configuration work (``tailguard envoy-config``):

* **one filter** (GIE's reference shape): the response goes through the
  picker's stream too, and Envoy waits for a reply to each response message
  (one gRPC round trip before the first token reaches the client, and one per
  chunk);
* **picker and observer** (the default of ``deploy/envoy/``): the picker's
  filter handles the request only; a second ext_proc filter after it, in
  ``observability_mode``, sends the routed request's headers and the whole
  response without waiting for anything. The two streams of one request are
  joined on ``x-request-id`` (:attr:`EndpointPicker.live`); nothing is sent
  back on the observer's. Its stream opens once the picker has answered, so
  the picker's routing never waits behind it (0.2-0.5 ms at concurrency 1 on
  two cores, ``benchmarks/README.md``). Replacing Envoy's own error answers is
  then Envoy's ``local_reply_config``.

The request's end releases every permit exactly once: the stream that sees
the response ends with the HTTP request (the observer's, or the one filter's).
One that ends before the response did (the client left, the upstream reset
mid-stream, Envoy gave up) is the exchange's ``client_gone``. Envoy does not
say which of these it was, so the node is not charged; a crashed node is
caught by its health checks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from envoy.service.ext_proc.v3 import (
    external_processor_pb2 as pb,
    external_processor_pb2_grpc as pb_grpc,
)

from tailguard.adapters.admission_gate import AdmissionGate
from tailguard.adapters.live_fleet import LiveFleet
from tailguard.adapters.metrics import GatewayMetrics
from tailguard.core.exchange import Exchange
from tailguard.epp.protocol import (
    DESTINATION,
    OBJECTIVES,
    SERVED,
    SERVICE,
    immediate,
    routing,
)
from tailguard.epp.request import PickedRequest

ROUTING_CACHE = 4096  # distinct endpoint lists kept (a fleet's churn empties it)


class EndpointPicker(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """``ExternalProcessor/Process``: one :class:`PickedRequest` per ext_proc stream."""

    def __init__(self, fleet: LiveFleet, metrics: GatewayMetrics,
                 objectives: dict[str, int] | None = None,
                 gate: AdmissionGate | None = None, single_endpoint: bool = False) -> None:
        self.fleet = fleet
        # Name one endpoint, no fallback list: for data planes that route on the header
        # alone (an ORIGINAL_DST cluster takes one ip:port, and retries go back to it).
        self.single_endpoint = single_endpoint
        self.metrics = metrics
        # The pump of the pools' queues: the proxy's own where both run on one fleet.
        self.gate = gate or AdmissionGate(fleet, metrics)
        self.objectives = {**OBJECTIVES, **{k.lower(): v for k, v in (objectives or {}).items()}}
        self.exchange_type: type[Exchange] = Exchange  # tests put a tracing one here
        self.streams = 0  # open ext_proc streams (a gauge for tests and the admin view)
        self.live: dict[str, PickedRequest] = {}  # by x-request-id, while a stream may join
        # Routing replies by (endpoint list, upstream key, duplex): built once, sent
        # as often as the list recurs (a few lists carry most requests).
        self._routings: dict[tuple[str, str | None, bool, str | None],
                             pb.ProcessingResponse] = {}

    def routing_reply(self, endpoints: str, key: str | None, duplex: bool,
                      prefiller: str | None = None) -> pb.ProcessingResponse:
        """:func:`~tailguard.epp.protocol.routing`, built once per endpoint list."""
        k = (endpoints, key, duplex, prefiller)
        cached = self._routings.get(k)
        if cached is not None:
            return cached
        reply = routing(endpoints, key, duplex, prefiller)
        if len(self._routings) >= ROUTING_CACHE:
            self._routings.clear()
        self._routings[k] = reply
        return reply

    async def Process(self, requests: AsyncIterator[pb.ProcessingRequest],
                      context: Any) -> AsyncIterator[pb.ProcessingResponse]:
        self.gate.install()
        run: PickedRequest | None = None
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

    def _attach(self, msg: pb.ProcessingRequest, observer: bool) -> PickedRequest:
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
            run = PickedRequest(self, rid)  # alone, or a second request with the same id
            if rid and rid not in self.live:
                self.live[rid] = run
        if observer:
            run.observed = True
        else:
            run.picked = True
        return run


__all__ = ["DESTINATION", "SERVED", "SERVICE", "EndpointPicker", "immediate"]
