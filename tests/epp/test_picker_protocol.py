"""The endpoint picker's side of the GIE protocol, driven message by message over real gRPC.

No Envoy here: a grpc.aio client sends what Envoy sends (tests/epp/test_envoy.py
runs the real one), so each rule of the protocol is checked on its own. The
picker runs in front of emulated engines that are never called: the test
plays the data plane and says what it did.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, ClassVar

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from epp_harness import (
    MODEL,
    MSG,
    ExtProcStream,
    body,
    channel,
    emulated,
    header_value,
    in_flight,
    picker,
    request_headers,
    response_body,
    response_headers,
    sse,
    wait_for,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tailguard.core.exchange import Exchange
from tailguard.core.fleet import STALL_S, NodeState

CHAT = json.dumps({"model": MODEL, "messages": MSG, "max_tokens": 4, "stream": True}).encode()
PLAIN = json.dumps({"model": MODEL, "messages": MSG, "max_tokens": 4}).encode()


def run(fn: Any) -> None:
    asyncio.run(asyncio.wait_for(fn(), 60))


def destination(resp: pb.ProcessingResponse) -> tuple[str | None, str | None]:
    """The endpoint list in the header mutation and in the dynamic metadata."""
    common = (resp.request_headers.response if resp.HasField("request_headers")
              else resp.request_body.response)
    header = header_value(common.header_mutation, "x-gateway-destination-endpoint")
    lb = resp.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    meta = lb["x-gateway-destination-endpoint"].string_value if lb else None
    return header, meta


def requests_total(epp: Any, pool: str, code: str) -> float:
    v = epp.gateway.metrics.registry.get_sample_value(
        "tailguard_requests_total", {"pool": pool, "code": code})
    return v or 0.0


def test_full_duplex_routes_with_a_fallback_list_and_streams_back_the_body() -> None:
    async def body_() -> None:
        async with emulated(["H100", "A100", "L4"]) as (_, cfg), picker(cfg) as epp, \
                channel(epp) as ch:
            endpoints = {n.endpoint: n.id for n in cfg.nodes}
            s = ExtProcStream(ch)
            await s.send(request_headers(), body(CHAT[:20], end=False))
            # Full duplex: nothing comes back before the body's end.
            with pytest.raises(asyncio.TimeoutError):
                await s.recv(timeout=0.3)
            await s.send(body(CHAT[20:]))
            routed = await s.recv()
            header, meta = destination(routed)
            assert header == meta and header is not None
            listed = header.split(",")
            assert len(listed) == 3 and len(set(listed)) == 3  # primary, then two fallbacks
            assert set(listed) == set(endpoints)
            primary = endpoints[listed[0]]
            assert in_flight(epp) == {n: int(n == primary) for n in endpoints.values()}
            echoed = await s.recv()
            streamed = echoed.request_body.response.body_mutation.streamed_response
            assert streamed.body == CHAT and streamed.end_of_stream
            # The data plane served it from the primary: first token, stream, end.
            await s.send(response_headers(200, listed[0]))
            reply = await s.recv()
            mutation = reply.response_headers.response.header_mutation
            assert header_value(mutation, "x-tailguard-node") == primary
            assert "x-gateway-destination-endpoint-served" in mutation.remove_headers
            chunks = sse(4)
            for c in chunks[:-1]:
                await s.send(response_body(c))
                assert (await s.recv()).HasField("response_body")
            assert in_flight(epp)[primary] == 1
            await s.send(response_body(chunks[-1], end=True))
            await s.recv()
            await s.close()
            assert in_flight(epp) == {n: 0 for n in endpoints.values()}
            assert requests_total(epp, MODEL, "200") == 1
            tokens = epp.gateway.metrics.registry.get_sample_value(
                "tailguard_output_tokens_total", {"pool": MODEL, "node": primary})
            assert tokens == 4

    run(body_)


def test_buffered_mode_routes_on_the_body_reply() -> None:
    async def body_() -> None:
        async with emulated(["A100", "A100"]) as (_, cfg), picker(cfg) as epp, \
                channel(epp) as ch:
            s = ExtProcStream(ch)
            await s.send(request_headers(duplex=False))
            first = await s.recv()  # buffered: the headers go on at once, unchanged
            assert first.HasField("request_headers")
            assert not first.request_headers.response.header_mutation.set_headers
            await s.send(body(PLAIN))
            routed = await s.recv()
            assert routed.HasField("request_body")
            header, meta = destination(routed)
            assert header == meta and header is not None and len(header.split(",")) == 2
            await s.send(response_headers(200, header.split(",")[0], served_in_metadata=False))
            await s.recv()
            await s.send(response_body(b'{"usage":{"completion_tokens":4}}', end=True))
            await s.recv()
            await s.close()
            assert sum(in_flight(epp).values()) == 0

    run(body_)


def test_a_fallback_moves_the_permit_and_the_blame() -> None:
    async def body_() -> None:
        async with emulated(["A100", "A100", "A100"]) as (_, cfg), picker(cfg) as epp, \
                channel(epp) as ch:
            endpoints = {n.endpoint: n.id for n in cfg.nodes}
            s = ExtProcStream(ch)
            await s.send(request_headers(), body(CHAT))
            header, _ = destination(await s.recv())
            await s.recv()
            listed = header.split(",") if header else []
            first, second = endpoints[listed[0]], endpoints[listed[1]]
            # Envoy could not use the primary, and served it from the second entry.
            await s.send(response_headers(200, listed[1]))
            reply = await s.recv()
            assert header_value(reply.response_headers.response.header_mutation,
                                "x-tailguard-node") == second
            assert in_flight(epp)[first] == 0 and in_flight(epp)[second] == 1
            for i, c in enumerate(sse(3)):
                await s.send(response_body(c, end=i == 4))
                await s.recv()
            await s.close()
            assert sum(in_flight(epp).values()) == 0
            reg = epp.gateway.metrics.registry
            assert reg.get_sample_value("tailguard_upstream_errors_total",
                                        {"node": first, "origin": "fallback"}) == 1
            assert reg.get_sample_value("tailguard_retries_total",
                                        {"pool": MODEL, "origin": "fallback"}) == 1
            # The second node served it: the first's failure is its own.
            assert reg.get_sample_value("tailguard_failure_verdicts_total",
                                        {"verdict": "node"}) == 1

    run(body_)


def test_envoy_made_error_is_replaced_and_every_attempt_released() -> None:
    async def body_() -> None:
        async with emulated(["A100", "A100", "A100"]) as (_, cfg), picker(cfg) as epp, \
                channel(epp) as ch:
            s = ExtProcStream(ch)
            await s.send(request_headers(), body(CHAT))
            await s.recv()
            await s.recv()
            # No endpoint answered: Envoy's own 503 after three attempts.
            await s.send(response_headers(503, None, upstream=False,
                                          extra={"x-envoy-attempt-count": "3"}))
            reply = await s.recv()
            assert reply.HasField("immediate_response")
            err = json.loads(reply.immediate_response.body)["error"]
            assert reply.immediate_response.status.code == 502
            assert err["code"] == "upstream_connect_failed"
            assert sum(in_flight(epp).values()) == 0
            assert requests_total(epp, MODEL, "502") == 1
            reg = epp.gateway.metrics.registry
            assert reg.get_sample_value("tailguard_retries_total",
                                        {"pool": MODEL, "origin": "fallback"}) == 2

    run(body_)


def test_subset_hint_confines_the_pick() -> None:
    async def body_() -> None:
        async with emulated(["H100", "A100", "L4"]) as (_, cfg), picker(cfg) as epp, \
                channel(epp) as ch:
            by_id = {n.id: n.endpoint for n in cfg.nodes}
            for _ in range(3):
                s = ExtProcStream(ch)
                await s.send(request_headers(subset=[by_id["n2"], "10.9.9.9:80"]), body(CHAT))
                header, _ = destination(await s.recv())
                assert header == by_id["n2"]  # the L4 alone, though the H100 is idle
                s.cancel()
            s = ExtProcStream(ch)
            await s.send(request_headers(subset=["10.9.9.9:80"]), body(CHAT))
            reply = await s.recv()
            assert reply.immediate_response.status.code == 503
            assert json.loads(reply.immediate_response.body)["error"]["code"] == "no_capacity"
            await wait_for(lambda: sum(in_flight(epp).values()) == 0, what="cancelled released")

    run(body_)


def test_bad_requests_get_openai_errors() -> None:
    async def body_() -> None:
        async with emulated(["A100"]) as (_, cfg), picker(cfg) as epp, channel(epp) as ch:
            cases = [
                (request_headers(), body(b"{not json"), 400),
                (request_headers(), body(json.dumps({"model": "nope", "messages": MSG}).encode()),
                 404),
                (request_headers(path="/v1/nothing"), body(CHAT), 404),
                (request_headers(), body(b"x" * (cfg.max_body_bytes + 1)), 413),
                (request_headers(end=True), None, 400),
            ]
            for hdrs, b, status in cases:
                s = ExtProcStream(ch)
                await s.send(hdrs, *([b] if b is not None else []))
                reply = await s.recv()
                assert reply.immediate_response.status.code == status, (status, reply)
                err = json.loads(reply.immediate_response.body)["error"]
                assert err["message"] and err["code"]
                s.cancel()
            s = ExtProcStream(ch)
            await s.send(request_headers(path="/v1/models", method="GET", end=True))
            reply = await s.recv()
            assert reply.immediate_response.status.code == 200
            assert [m["id"] for m in json.loads(reply.immediate_response.body)["data"]] == [MODEL]
            assert sum(in_flight(epp).values()) == 0

    run(body_)


POOL_ONE_SLOT = {"limits": {"kind": "fixed", "initial": 1}, "admission": {"queue_max": 1},
                 "slo": {"ttft_s": 5.0, "tpot_s": 1.0}}


def test_queue_holds_the_reply_and_a_full_queue_sheds_with_retry_after() -> None:
    async def body_() -> None:
        async with emulated(["A100"], pool=POOL_ONE_SLOT) as (_, cfg), picker(cfg) as epp, \
                channel(epp) as ch:
            a = ExtProcStream(ch)
            await a.send(request_headers(), body(CHAT))
            header, _ = destination(await a.recv())
            await a.recv()
            b = ExtProcStream(ch)  # the slot is taken: b waits in the queue
            await b.send(request_headers(), body(CHAT))
            queue = epp.gateway.fleet.balancer.pools[MODEL].queue
            assert queue is not None
            await wait_for(lambda: queue.length == 1, what="b queued")
            c = ExtProcStream(ch)  # queue full
            await c.send(request_headers(), body(CHAT))
            shed = await c.recv()
            assert shed.immediate_response.status.code == 429
            sent = {h.header.key: h.header.raw_value.decode()
                    for h in shed.immediate_response.headers.set_headers}
            assert int(sent["retry-after"]) >= 1
            assert json.loads(shed.immediate_response.body)["error"]["code"].startswith("shed_")
            with pytest.raises(asyncio.TimeoutError):
                await b.recv(timeout=0.3)  # still waiting
            # a ends: b is placed on the freed slot and routed.
            await a.send(response_headers(200, header))
            await a.recv()
            for i, chunk in enumerate(sse(2)):
                await a.send(response_body(chunk, end=i == 3))
                await a.recv()
            routed_b, _ = destination(await b.recv())
            assert routed_b == header
            b.cancel()  # the client of b leaves before any answer
            await wait_for(lambda: sum(in_flight(epp).values()) == 0, what="b released")
            await wait_for(lambda: requests_total(epp, MODEL, "499") == 1, what="b counted")

    run(body_)


async def answering(ch: grpc.aio.Channel) -> ExtProcStream:
    """A streamed chat request routed, and its answer's headers let through: the
    stream is where Envoy sends the answer's body."""
    s = ExtProcStream(ch)
    await s.send(request_headers(), body(CHAT))
    header, _ = destination(await s.recv())
    await s.recv()
    await s.send(response_headers(200, (header or "").split(",")[0]))
    await s.recv()
    return s


def test_a_stream_reset_mid_answer_releases_the_permit() -> None:
    async def body_() -> None:
        async with emulated(["A100", "A100"]) as (_, cfg), picker(cfg) as epp, \
                channel(epp) as ch:
            s = await answering(ch)
            await s.send(response_body(sse(3)[0]))
            await s.recv()
            assert sum(in_flight(epp).values()) == 1
            s.cancel()  # Envoy reset the request (client gone, or the upstream died)
            await wait_for(lambda: sum(in_flight(epp).values()) == 0, what="release")
            await wait_for(lambda: epp.picker.streams == 0, what="stream closed")
            assert epp.gateway.fleet.balancer.double_release == 0

    run(body_)


def test_a_gap_in_an_answers_body_tells_its_nodes_stall() -> None:
    """The picker times each chunk of a streamed answer against the one before (no
    parsing): a gap of STALL_S or more, with nothing else answered on the node, is
    the node's stall (Node.stream_silent), so the decode timed across it is left out
    of the detector's evidence; a gap under it is nothing."""
    async def body_() -> None:
        async with emulated(["A100", "A100"]) as (_, cfg), picker(cfg) as epp, \
                channel(epp) as ch:
            s = await answering(ch)
            node, = (n for n in epp.gateway.fleet.balancer.nodes.values() if n.in_flight)
            chunks = sse(3)
            await s.send(response_body(chunks[0]))
            await s.recv()
            await asyncio.sleep(0.3)
            await s.send(response_body(chunks[1]))
            await s.recv()
            assert node.stalls == 0
            await asyncio.sleep(STALL_S + 0.3)
            await s.send(response_body(chunks[2]))
            await s.recv()
            assert node.stalls == 1
            assert node.spans_stall(time.monotonic() - STALL_S, time.monotonic())
            for chunk in chunks[3:]:
                await s.send(response_body(chunk, end=chunk is chunks[-1]))
                await s.recv()
            await wait_for(lambda: sum(in_flight(epp).values()) == 0, what="release")

    run(body_)


def observer_msg(msg: pb.ProcessingRequest) -> pb.ProcessingRequest:
    msg.observability_mode = True
    return msg


def test_an_observer_after_the_picker_settles_what_the_picker_routed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """deploy/envoy/'s shape: the observer filter comes after the picker's, so its
    stream opens once the request is routed, and Envoy may reset the picker's
    stream first. The request stays open for the observer; without one it is
    released after ORPHAN_S, as a client that left."""
    import tailguard.epp.request as request_mod

    monkeypatch.setattr(request_mod, "ORPHAN_S", 0.5)

    def picker_headers(rid: str) -> pb.ProcessingRequest:
        msg = request_headers(extra={"x-request-id": rid})
        msg.protocol_config.response_body_mode = 0  # NONE: the response goes elsewhere
        return msg

    async def body_() -> None:
        async with emulated(["A100", "A100"]) as (_, cfg), picker(cfg) as epp, \
                channel(epp) as ch:
            s = ExtProcStream(ch)
            await s.send(picker_headers("r1"), body(CHAT))
            header, _ = destination(await s.recv())
            await s.recv()
            # Envoy is done with the picker's stream. (gRPC may hand the picker this
            # cancel as the end of its messages; Envoy's own resets, which reach it as a
            # cancellation, are in test_envoy.py's counts.)
            s.cancel()
            await wait_for(lambda: epp.picker.streams == 0, what="picker stream closed")
            assert sum(in_flight(epp).values()) == 1
            obs = ExtProcStream(ch)
            await obs.send(observer_msg(request_headers(extra={"x-request-id": "r1"})),
                           observer_msg(response_headers(200, (header or "").split(",")[0])),
                           *(observer_msg(response_body(c)) for c in sse(3)),
                           observer_msg(response_body(b"", end=True)))
            await obs.close()
            await wait_for(lambda: sum(in_flight(epp).values()) == 0, what="settled")
            assert requests_total(epp, MODEL, "200") == 1
            # Routed, and no observer ever comes: released, as a client that left.
            s2 = ExtProcStream(ch)
            await s2.send(picker_headers("r2"), body(CHAT))
            await s2.recv()
            await s2.recv()
            s2.cancel()
            await wait_for(lambda: epp.picker.streams == 0, what="picker stream closed")
            assert sum(in_flight(epp).values()) == 1
            await wait_for(lambda: sum(in_flight(epp).values()) == 0, timeout=3,
                           what="orphan released")
            assert requests_total(epp, MODEL, "499") == 1
            assert epp.gateway.fleet.balancer.double_release == 0

    run(body_)


class Traced(Exchange):
    seen: ClassVar[list[Any]] = []

    def arrive(self, now: float) -> Any:
        Traced.seen.append(self.request)
        return super().arrive(now)


def test_priority_from_the_objective_header_or_tailguards_own() -> None:
    async def body_() -> None:
        async with emulated(["A100"]) as (_, cfg), \
                picker(cfg, objectives={"batch-jobs": 2}) as epp, channel(epp) as ch:
            epp.picker.exchange_type = Traced
            Traced.seen = []
            for extra in ({"x-gateway-inference-objective": "batch-jobs"},
                          {"x-gateway-inference-objective": "critical"},
                          {"x-tailguard-priority": "high"}, {}):
                s = ExtProcStream(ch)
                await s.send(request_headers(extra=extra), body(CHAT))
                await s.recv()
                s.cancel()
            assert [r.priority for r in Traced.seen] == [2, 0, 0, 1]
            await wait_for(lambda: sum(in_flight(epp).values()) == 0, what="release")

    run(body_)


def test_health_service_names() -> None:
    async def status(stub: Any, name: str) -> int:
        got = await stub.Check(health_pb2.HealthCheckRequest(service=name))
        return int(got.status)

    async def body_() -> None:
        async with emulated(["A100"]) as (_, cfg), picker(cfg) as epp, \
                grpc.aio.insecure_channel(f"127.0.0.1:{epp.health_port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            serving = health_pb2.HealthCheckResponse.SERVING
            for name in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
                assert await status(stub, name) == serving, name
            epp.gateway.fleet.set_state("n0", NodeState.DRAINING)  # no routable node left
            for _ in range(50):
                if await status(stub, "readiness") == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("readiness stayed SERVING with no routable node")
            assert await status(stub, "liveness") == serving

    run(body_)
