"""Limits and the admission queue in the live gateway, on real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from typing import Any

import aiohttp
from gateway_fakes import fleet_and_gateway, wait_for

from tailguard.gateway.app import RunningGateway

MSG = [{"role": "user", "content": "hello"}]
POOL = {"m": {"policy": "least_request", "slo": {"ttft_s": 5.0, "tpot_s": 1.0},
              "limits": {"kind": "fixed", "initial": 1},
              "admission": {"queue_max": 1},
              "timeouts": {"connect_s": 1.0, "first_byte_s": 5.0, "idle_s": 5.0,
                           "total_s": 20.0}}}


async def chat(gw: RunningGateway, priority: str = "normal",
               timeout: float = 10.0) -> tuple[int, dict[str, Any], dict[str, str], float]:
    t0 = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s, \
            s.post(gw.url + "/v1/chat/completions",
                   json={"model": "m", "messages": MSG, "max_tokens": 4},
                   headers={"x-tailguard-priority": priority}) as r:
        raw = await r.read()
        return r.status, json.loads(raw), dict(r.headers), time.monotonic() - t0


def test_queue_priorities_displacement_and_fast_429() -> None:
    async def body() -> None:
        os.environ["TG_TEST_ADMISSION_TOKEN"] = "tok"
        async with fleet_and_gateway(["a"], pools=POOL,
                                     admin={"token_env": "TG_TEST_ADMISSION_TOKEN"}) as (gw, eng):
            eng[0].behavior.token_delay_s = 0.15  # ~0.6 s a request
            node = gw.fleet.balancer.nodes["a"]
            first = asyncio.create_task(chat(gw))
            await wait_for(lambda: node.in_flight == 1, what="first dispatched")
            low = asyncio.create_task(chat(gw, "low"))
            pool = gw.fleet.balancer.pools["m"]
            assert pool.queue is not None
            queue = pool.queue
            await wait_for(lambda: queue.length == 1, what="low queued")
            high = asyncio.create_task(chat(gw, "high"))
            status, err, headers, took = await low  # displaced by the high one
            assert status == 429 and err["error"]["code"] == "shed_displaced"
            assert int(headers["Retry-After"]) >= 1
            assert err["error"]["type"] == "rate_limit_error"
            status, err, headers, took = await chat(gw, "low")  # queue full of higher priority
            assert status == 429 and err["error"]["code"] == "shed_queue_full"
            assert took < 0.05, f"429 took {took * 1000:.1f} ms"
            assert node.in_flight == 1  # the limit held throughout
            s1, _, _, t1 = await first
            s2, _, h2, t2 = await high
            assert (s1, s2) == (200, 200) and h2["x-tailguard-node"] == "a"
            assert t2 > 0.9 * t1  # it waited for the first to finish: queue time in its TTFT
            async with aiohttp.ClientSession() as s:
                async with s.get(gw.url + "/admin/nodes",
                                 headers={"Authorization": "Bearer tok"}) as r:
                    nodes = await r.json()
                async with s.get(gw.url + "/metrics") as r:
                    text = await r.text()
            (a,) = [n for n in nodes["nodes"]] if "nodes" in nodes else nodes
            assert a["limit"]["limit"] == 1 and a["limit"]["successes"] == 2
            assert 'tailguard_node_limit_requests{gpu="L4",node="a"} 1.0' in text
            assert node.limiter is not None and node.limiter.inflight == 0

    asyncio.run(body())


def test_client_leaving_the_queue_frees_its_place() -> None:
    async def body() -> None:
        async with fleet_and_gateway(["a"], pools=POOL) as (gw, eng):
            eng[0].behavior.token_delay_s = 0.1
            node = gw.fleet.balancer.nodes["a"]
            first = asyncio.create_task(chat(gw))
            await wait_for(lambda: node.in_flight == 1, what="first dispatched")
            queue = gw.fleet.balancer.pools["m"].queue
            assert queue is not None
            with contextlib.suppress(TimeoutError):
                await chat(gw, timeout=0.2)
            await wait_for(lambda: queue.length == 0, what="the cancelled client to leave")
            assert (await first)[0] == 200
            assert (await chat(gw))[0] == 200
            assert node.in_flight == 0 and node.limiter is not None
            assert node.limiter.inflight == 0

    asyncio.run(body())
