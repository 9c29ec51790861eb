"""Deadlines against a node that accepts connections and never answers (issue 41):
a hung node is given up on within its own bound, the retry has time, and no
healthy node is ever charged with the request's deadline."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from gateway_fakes import FakeEngine, fleet_doc, free_port

from tailguard.config.fleet import parse_fleet
from tailguard.core.fleet import NodeState
from tailguard.gateway.app import RunningGateway, run_gateway

MSG = [{"role": "user", "content": "hi"}]


@asynccontextmanager
async def blackhole() -> AsyncIterator[str]:
    """A TCP listener that reads what it is sent and never answers."""
    held: list[asyncio.StreamWriter] = []

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        while await reader.read(65536):
            pass

    port = free_port()
    server = await asyncio.start_server(swallow, "127.0.0.1", port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        for w in held:
            w.close()
        await server.wait_closed()


@asynccontextmanager
async def fleet(timeouts: dict[str, float]) -> AsyncIterator[tuple[RunningGateway, list[str]]]:
    engines = [await FakeEngine(n).start() for n in ("ok0", "ok1")]
    try:
        async with blackhole() as hung:
            doc = fleet_doc(engines, pools={"m": {"timeouts": timeouts,
                                                  "retries": {"attempts": 2, "budget": 1.0}}},
                            health={"interval_s": 60.0})  # the timeouts alone must do it
            doc["nodes"].append({"id": "hung", "url": hung, "gpu": "L4", "models": ["m"]})
            async with run_gateway(parse_fleet(doc)) as gw:
                yield gw, ["ok0", "ok1"]
    finally:
        for e in engines:
            await e.stop()


async def chat(s: aiohttp.ClientSession, gw: RunningGateway, **extra: Any) -> tuple[int, str]:
    async with s.post(gw.url + "/v1/chat/completions",
                      json={"model": "m", "messages": MSG, "max_tokens": 4, **extra}) as r:
        body = await r.text()
        return r.status, body


def charged(gw: RunningGateway, node: str) -> int:
    det = gw.fleet.balancer.outliers
    assert det is not None
    h = det.health.get(node)
    return h.own_failures if h is not None else 0


def assert_healthy_untouched(gw: RunningGateway, healthy: list[str]) -> None:
    for nid in healthy:
        assert gw.fleet.balancer.nodes[nid].state is NodeState.HEALTHY, nid
        assert charged(gw, nid) == 0, nid


def test_a_hung_node_is_given_up_on_in_seconds_and_the_retry_succeeds() -> None:
    """30 concurrent non-streamed requests, a third of them first sent to the hung node:
    each of those is retried after the attempt's own bound, well inside total_s."""
    async def body() -> None:
        async with fleet({"first_byte_s": 3.0, "total_s": 10.0}) as (gw, healthy), \
                aiohttp.ClientSession() as s:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            got = await asyncio.gather(*(chat(s, gw) for _ in range(30)))
            took = loop.time() - t0
            assert [status for status, _ in got] == [200] * 30, got
            assert took < 6.0  # the hung attempts gave up after seconds, not total_s
            assert charged(gw, "hung") > 0  # the hung node's own timeouts are its own
            assert_healthy_untouched(gw, healthy)
            streamed = await asyncio.gather(*(chat(s, gw, stream=True) for _ in range(9)))
            assert [status for status, _ in streamed] == [200] * 9
            assert_healthy_untouched(gw, healthy)
            assert gw.fleet.in_flight() == 0 and gw.fleet.balancer.double_release == 0

    asyncio.run(body())


def test_the_request_deadline_charges_no_node_and_starts_no_late_retry() -> None:
    """Answers too long for the attempt's own bound to bind: the request's deadline
    cuts the hung copy, nothing is retried in the time left, the 504 names the hung
    node, and no node (the hung one included) is charged for the request's time."""
    async def body() -> None:
        async with fleet({"first_byte_s": 3.0, "total_s": 1.5}) as (gw, healthy), \
                aiohttp.ClientSession() as s:
            got = await asyncio.gather(*(chat(s, gw, max_tokens=100_000) for _ in range(12)))
            failed = [text for status, text in got if status != 200]
            assert failed, "some requests went to the hung node first"
            assert all('"code": "upstream_timeout"' in t or "upstream_timeout" in t
                       for t in failed)
            assert all("hung" in t for t in failed), failed
            assert_healthy_untouched(gw, healthy)
            assert charged(gw, "hung") == 0
            assert gw.fleet.in_flight() == 0 and gw.fleet.balancer.double_release == 0

    asyncio.run(body())
