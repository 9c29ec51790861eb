"""The gateway's driver of the exchange: upstream attempts, the hedge race, the stream.

The decisions (admission, retries, the hedge, whose failure it was, every
permit) are the core's :class:`~tailguard.core.exchange.Exchange`; this
module maps its actions onto asyncio and HTTP:

* :class:`~tailguard.core.exchange.Dispatch`: POST the client's bytes to the
  node and read the first chunk of a stream, or the whole of any other answer
  (:meth:`Forwarder._try`); a connect error, a timeout, a 5xx, a 429 or a
  stream that ends before any data is reported as ``failed`` with its origin.
  Without hedging the attempt is awaited in the handler itself; with it, each
  copy is a task of a :class:`Race`.
* :class:`~tailguard.core.exchange.ArmTimer`: a loop timer that calls
  ``exchange.timer``; :class:`~tailguard.core.exchange.Cancel`: cancel the
  copy's task and close its connection.
* :class:`~tailguard.core.exchange.Queue`: wait on a future that the pump of
  :mod:`~tailguard.adapters.admission_gate` resolves with the exchange's next
  actions.
* :class:`~tailguard.core.exchange.Refuse` and
  :class:`~tailguard.core.exchange.Fail`: the error answer.

A committed stream is relayed by :class:`~tailguard.gateway.stream.StreamRelay`
(events counted, never parsed), which also carries out
:class:`~tailguard.core.exchange.Migrate`: a continuation of the answer on
another node, spliced into the same response, with its copy's attempt made by
:meth:`Forwarder._try` as any other. A client that goes away (the handler is
cancelled) becomes ``client_gone``, which releases every copy's permit.
"""

from __future__ import annotations

import asyncio
import json
import time

from aiohttp import web

from tailguard.adapters.admission_gate import AdmissionGate, shed_response, ttft_header
from tailguard.adapters.api_errors import NO_NODE, error_response
from tailguard.adapters.live_fleet import LiveFleet
from tailguard.adapters.logs import note
from tailguard.adapters.metrics import GatewayMetrics
from tailguard.adapters.openai_request import PATHS, SESSION_HEADER, session_key
from tailguard.adapters.sse import usage_completion_tokens
from tailguard.adapters.upstream import (
    UpstreamClient,
    UpstreamConnectError,
    UpstreamError,
    UpstreamResponse,
)
from tailguard.config.fleet import NodeConfig
from tailguard.core.exchange import (
    NO_CAPACITY,
    RETRY_AFTER_S,
    Action,
    ArmTimer,
    Cancel,
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
from tailguard.gateway.call import Call, count_answer, response_headers
from tailguard.gateway.race import Answer, Race, cancel_losers
from tailguard.gateway.stream import Source, StreamRelay

# vLLM's prefill leg asks for the KV to be kept for a remote decode (facts.md).
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False,
                 "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
                 "remote_port": None}


class _ClientGone(Exception):
    """Writing to the client failed: it disconnected."""


class Forwarder:
    """Runs one exchange per request against the upstream client."""

    def __init__(self, fleet: LiveFleet, metrics: GatewayMetrics) -> None:
        self.fleet = fleet
        self.metrics = metrics
        self.upstream: UpstreamClient | None = None  # opened at the app's startup
        self.gate = AdmissionGate(fleet, metrics)  # the pump of the pools' queues
        self.exchange_type: type[Exchange] = Exchange  # tests put a tracing one here

    async def forward(self, call: Call) -> web.StreamResponse:
        fleet = self.fleet
        req = call.req
        model = req.model
        self.gate.install()
        # The request's deadline on the core's clock (the loop's may be another's).
        now = time.monotonic()
        deadline = now + (call.deadline - asyncio.get_running_loop().time())
        ex = self.exchange_type(
            fleet.balancer,
            Request(model, req.prompt_tokens, req.max_tokens, call.priority, req.stream,
                    ttft_header(call.request), len(call.body), prefix=req.prefix,
                    session=session_key(call.request.headers.get(SESSION_HEADER), req),
                    deadline=deadline))
        try:
            return await self._drive(ex, call, ex.arrive(now))
        except BaseException:
            ex.client_gone(time.monotonic())  # the copies' tasks stop with their race
            raise
        finally:
            if ex.verdict is not None:
                verdict, n = ex.verdict
                self.metrics.failure_verdicts.labels(verdict).inc(n)
            if ex.hedge_result is not None:
                self.metrics.hedge(model, ex.hedge_result)

    async def _drive(self, ex: Exchange, call: Call,
                     actions: tuple[Action, ...]) -> web.StreamResponse:
        """Carry out the exchange's actions until it commits a copy or ends."""
        race: Race | None = None
        try:
            while True:
                run: Dispatch | None = None
                queued = False
                todo = list(actions)
                for a in todo:  # grows while we go: a copy sent may arm the hedge timer
                    if type(a) is Dispatch:
                        if a.retry_of is not None:
                            self.metrics.retry(call.req.model, a.retry_of.value)
                        if ex.hedger is None:
                            run = a  # one copy at a time: awaited right here
                        else:
                            race = race or Race()
                            race.start(a.copy, self._try(call, a.copy, a.within_s, ex))
                        todo.extend(ex.sent(a.copy, time.monotonic()))
                    elif type(a) is ArmTimer:
                        race = race or Race()
                        race.arm(a.at)
                    elif type(a) is Cancel:
                        if race is not None:
                            race.cancel(a.copy)
                    elif type(a) is Queue:
                        queued = True
                    elif type(a) is Refuse:
                        return self._refused(call, a)
                    else:
                        assert type(a) is Fail
                        return self._failed(ex, call, a)
                if queued:
                    actions = await self.gate.wait(ex)
                    continue
                if run is not None:
                    copy, result = run.copy, await self._try(call, run.copy, run.within_s, ex)
                else:
                    assert race is not None, "the exchange left nothing to wait for"
                    got = await race.next()
                    if got is None:  # the hedge timer
                        actions = ex.timer(race.fired_at)
                        continue
                    copy, result = got
                if isinstance(result, Failure):
                    self.metrics.upstream_error(copy.node_id, result.origin.value)
                    actions = ex.failed(copy, time.monotonic(), result)
                    continue
                if race is not None:
                    race.keep(copy)
                return await self._answer(ex, call, copy, result, race)
        finally:
            if race is not None:
                race.close()

    def _refused(self, call: Call, a: Refuse) -> web.Response:
        model = call.req.model
        note(origin=f"shed_{a.shed.reason}")
        self.metrics.shed_request(model, a.shed.reason)
        count_answer(self.metrics, call.request, model, 429)
        return shed_response(a.shed, model)

    def _failed(self, ex: Exchange, call: Call, a: Fail) -> web.Response:
        f = a.failure
        model = call.req.model
        count_answer(self.metrics, call.request, model, f.status)
        extra = {"Retry-After": f.retry_after} if f.retry_after else None
        if f.code == NO_CAPACITY:
            note(origin=NO_CAPACITY)
        else:
            note(origin=f.origin.value, attempts=len(ex.tried))
        return error_response(f.status, f.message, f.code, a.node_id or NO_NODE, extra)

    # -- one copy on one node, to its first chunk --------------------------------

    async def _try(self, call: Call, copy: Copy, within_s: float | None = None,
                   ex: Exchange | None = None, body: bytes | None = None) -> Failure | Answer:
        """POST to the copy's node: its answer with the first chunk read, or its failure.
        ``within_s``: the attempt's own bound (the exchange's, for a non-streamed one);
        ``body``: another than the client's (a continuation's). A copy with a prefill
        node runs its prefill leg there first (:meth:`_prefill`)."""
        if body is None:
            body = call.body
            call.prefill = None  # (an earlier attempt's leg is not this one's)
        if copy.prefill_node is not None and ex is not None:
            leg = await self._prefill(ex, call, copy, body)
            if not isinstance(leg, bytes):  # its failure, or the engine's own 4xx answer
                return leg
            body = leg
        return await self._send(call, copy.node_id, body, call.req.stream, within_s)

    async def _prefill(self, ex: Exchange, call: Call, copy: Copy,
                       body: bytes) -> Failure | Answer | bytes:
        """vLLM's P/D prefill leg, as vllm-router sends it: the client's body, not
        streamed, one token, asking the engine to keep the KV for a remote decode.
        Its answer's ``kv_transfer_params`` go to the decode node with the client's
        body (without them the decode node computes the prompt itself)."""
        doc = json.loads(body)  # the client's body, parsed once more for this leg
        leg = {k: v for k, v in doc.items() if k != "stream_options"}
        leg.update(stream=False, max_tokens=1, min_tokens=1, kv_transfer_params=REMOTE_DECODE)
        if "max_completion_tokens" in leg:
            leg["max_completion_tokens"] = 1
        assert copy.prefill_node is not None
        t0 = time.monotonic()
        got = await self._send(call, copy.prefill_node, json.dumps(leg).encode(), False,
                               call.settings.timeouts.first_byte_s)
        if isinstance(got, Failure):
            return got
        call.prefill_done = time.monotonic()
        call.prefill = (copy.prefill_node, call.prefill_done - t0)
        resp, payload = got
        if resp.status >= 400:  # the engine refused the request itself: the client's answer
            return got
        resp.release()
        if not ex.prefilled(copy, time.monotonic()):
            return Failure(Outcome.CLIENT_CANCELLED, 499, "the request ended during its "
                           "prefill leg", "client_closed", cut=True)
        try:
            params = json.loads(payload).get("kv_transfer_params")
        except (ValueError, AttributeError):
            params = None
        if isinstance(params, dict):
            doc["kv_transfer_params"] = params
        return json.dumps(doc).encode()

    async def _send(self, call: Call, node_id: str, body: bytes, stream: bool,
                    within_s: float | None) -> Failure | Answer:
        """POST ``body`` to ``node_id``: its answer with the first chunk read, or its
        failure, classified by origin."""
        node = self.fleet.nodes.get(node_id)
        if node is None:  # cannot happen: the fleet adds and removes nodes in both at once
            return Failure(Outcome.CONNECT_FAILURE, 502, f"node {node_id} left the fleet",
                           "upstream_error")
        headers = call.headers
        key = node.upstream_api_key()
        if key:
            headers = headers.copy()
            headers["Authorization"] = f"Bearer {key}"
        to = call.settings.timeouts
        first_deadline = call.deadline
        own = to.first_byte_s if stream else within_s
        if own is not None:
            first_deadline = min(first_deadline, asyncio.get_running_loop().time() + own)
        upstream = self.upstream
        assert upstream is not None
        nid = node.id
        try:
            async with asyncio.timeout_at(first_deadline):
                resp = await upstream.post(node.url + PATHS[call.endpoint], headers, body,
                                           to.connect_s)
                try:
                    payload = await (resp.readany() if resp.streamed else resp.read())
                except BaseException:
                    resp.close()
                    raise
        except UpstreamConnectError as exc:
            return Failure(Outcome.CONNECT_FAILURE, 502, f"cannot connect to node {nid}: {exc}",
                           "upstream_connect_failed")
        except TimeoutError:
            if first_deadline >= call.deadline:  # the request's time, not the attempt's
                return Failure(Outcome.TIMEOUT, 504, f"node {nid} was still working when the "
                               f"request's {to.total_s:g} s ran out", "upstream_timeout",
                               cut=True)
            what = "first byte" if stream else "answer"
            return Failure(Outcome.TIMEOUT, 504, f"node {nid} sent no {what} in time",
                           "upstream_timeout")
        except (UpstreamError, OSError) as exc:
            return Failure(Outcome.CONNECT_FAILURE, 502,
                           f"node {nid} failed: {type(exc).__name__}: {exc}", "upstream_error")
        status = resp.status
        if status >= 500:
            resp.close()
            return Failure(Outcome.UPSTREAM_5XX, 502, f"node {nid} answered {status}: "
                                                      f"{_snippet(payload)}", "upstream_error",
                           judged=False)
        if status == 429:
            resp.close()
            return Failure(Outcome.UPSTREAM_429, 503, f"node {nid} is overloaded (429) and no "
                                                      "other node could take the request",
                           "upstream_busy", resp.headers.get("Retry-After") or RETRY_AFTER_S)
        if resp.streamed and not payload:
            resp.close()
            return Failure(Outcome.UPSTREAM_5XX, 502,
                           f"node {nid} ended its stream before any data", "upstream_error")
        return resp, payload

    # -- the committed copy ------------------------------------------------------------

    async def _answer(self, ex: Exchange, call: Call, copy: Copy, answer: Answer,
                      race: Race | None) -> web.StreamResponse:
        resp, payload = answer
        node = self.fleet.nodes[copy.node_id]
        model = call.req.model
        status = resp.status
        if len(ex.tried) > 1:
            note(attempts=len(ex.tried))
        try:
            if not resp.streamed:
                now = time.monotonic()
                ok = status < 400  # else the engine refused the request itself: passed on
                tokens = (usage_completion_tokens(payload) or 0) if ok else 0
                cancel_losers(race, ex.finished(copy, now, Outcome.OK if ok else Outcome.CLIENT_ERROR,
                                          tokens))
                if ok:
                    self.metrics.answered(model, node.id, node.gpu_class, now - call.t0, tokens)
                    if call.prefill is not None:
                        self._legs(model, call, None)
                    note(tokens=tokens)
                count_answer(self.metrics, call.request, model, status)
                return web.Response(status=status, body=payload,
                                    headers=response_headers(resp, node.id, call.prefill))
            # Committed: the client gets the answer's first bytes. Its prefill is
            # learnt at the end, once the usage says what was cached.
            t_first = time.monotonic()
            if call.prefill is not None and status < 400:
                self._legs(model, call, (node.id, node.gpu_class, t_first - call.prefill_done))
            cancel_losers(race, ex.first_chunk(copy, t_first, served=status < 400,
                                         defer_prefill=True))
            return await self._stream(ex, call, copy, node, resp, payload, t_first)
        finally:
            if ex.ended == "ok" or ex.ended == "client_error":
                resp.release()  # read to the end: the connection is reusable
            else:
                resp.close()

    def _legs(self, model: str, call: Call, decode: tuple[str, str, float] | None) -> None:
        """A disaggregated answer's legs, in the metrics (a streamed one's decode side
        up to its first token too)."""
        assert call.prefill is not None
        pre_id, seconds = call.prefill
        pre = self.fleet.nodes.get(pre_id)
        self.metrics.leg(model, (pre_id, pre.gpu_class if pre is not None else "", seconds),
                         decode)

    async def _stream(self, ex: Exchange, call: Call, copy: Copy, node: NodeConfig,
                      resp: UpstreamResponse, first: bytes,
                      t_first: float) -> web.StreamResponse:
        """Pass a stream through (and move it where the exchange says), and tell the
        exchange how it ended (:class:`~tailguard.gateway.stream.StreamRelay`)."""
        fleet = self.fleet

        def engine_of(node_id: str) -> str | None:
            mon = fleet.monitors.get(node_id)
            return mon.engine if mon is not None else None

        async def send(c: Copy, body: bytes) -> Failure | Answer:
            return await self._try(call, c, None, ex, body)

        relay = StreamRelay(ex, call, self.metrics, send, engine_of, fleet.nodes.__getitem__,
                            fleet.config.client.write_timeout_s)
        return await relay.run(Source(copy, resp, node), first, t_first)


def _snippet(payload: bytes, limit: int = 200) -> str:
    text = payload[:limit].decode("utf-8", "replace").strip()
    return text + ("..." if len(payload) > limit else "") if text else "(empty body)"


__all__ = ["Call", "Forwarder", "count_answer"]
