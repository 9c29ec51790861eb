"""The gateway in front of emulated engines, driven by the official openai client.

Complements test_gateway_proxy.py (which scripts failure modes with a fake
upstream): here the upstreams are the real emulator, faults are the
emulator's own, and accounting is checked after each scenario.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import openai
import pytest

from tailguard.config.fleet import parse_fleet
from tailguard.emulator import EmulatedNode, parse_fault, run_emulator
from tailguard.emulator.server import Emulator
from tailguard.gateway.app import RunningGateway, run_gateway

MODEL = "llama-3.1-8b"
MSG = [{"role": "user", "content": "Why do mixed fleets have stragglers?"}]


@asynccontextmanager
async def fleet(*gpus: str, speed: float = 20.0) -> AsyncIterator[tuple[RunningGateway, Emulator]]:
    nodes = [EmulatedNode(f"n{i}", g, models=(MODEL,)) for i, g in enumerate(gpus)]
    async with run_emulator(nodes, speed=speed) as emu:
        cfg = parse_fleet({
            "listen": "127.0.0.1:0",
            "nodes": [{"id": n.id, "url": emu.urls[n.id], "gpu": n.gpu, "models": [MODEL]}
                      for n in nodes],
            "pools": {MODEL: {"policy": "round_robin"}},
        })
        async with run_gateway(cfg) as gw:
            yield gw, emu


def run(coro_fn: object) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), 60))  # type: ignore[operator]


def test_openai_client_chat_and_completions_with_usage() -> None:
    async def body() -> None:
        async with fleet("H100", "A100") as (gw, _):
            client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
            try:
                chat = await client.chat.completions.create(model=MODEL, messages=MSG,
                                                            max_tokens=12)
                assert chat.usage is not None and chat.usage.completion_tokens == 12
                comp = await client.completions.create(model=MODEL, prompt="hello", max_tokens=5)
                assert comp.usage is not None and comp.usage.completion_tokens == 5
                stream = await client.chat.completions.create(
                    model=MODEL, messages=MSG, max_tokens=9, stream=True,
                    stream_options={"include_usage": True})
                text, usage = "", None
                async for chunk in stream:
                    if chunk.choices:
                        text += chunk.choices[0].delta.content or ""
                    if chunk.usage is not None:
                        usage = chunk.usage
                assert text and usage is not None and usage.completion_tokens == 9
                models = await client.models.list()
                assert [m.id for m in models.data] == [MODEL]
            finally:
                await client.close()
            assert gw.fleet.in_flight() == 0

    run(body)


def test_crashed_node_fails_over_before_the_first_byte() -> None:
    async def body() -> None:
        async with fleet("A100", "A100") as (gw, emu):
            emu.server("n0").inject(parse_fault({"kind": "crash", "duration_s": 60}))
            client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
            try:
                for _ in range(4):  # round robin tries n0 for half of them
                    raw = await client.chat.completions.with_raw_response.create(
                        model=MODEL, messages=MSG, max_tokens=4)
                    assert raw.headers["x-tailguard-node"] == "n1"
                    assert raw.parse().usage.completion_tokens == 4  # type: ignore[union-attr]
            finally:
                await client.close()
            assert gw.fleet.in_flight() == 0

    run(body)


def test_crash_mid_stream_ends_with_an_sse_error_and_service_continues() -> None:
    async def body() -> None:
        async with fleet("L4", speed=1.0) as (gw, emu):
            async with aiohttp.ClientSession() as http:
                req = {"model": MODEL, "messages": MSG, "max_tokens": 200, "stream": True}
                async with http.post(gw.url + "/v1/chat/completions", json=req) as resp:
                    assert resp.status == 200
                    first = await resp.content.readline()
                    assert first.startswith(b"data: ")
                    emu.server("n0").inject(parse_fault({"kind": "crash", "duration_s": 0.5}))
                    rest = await resp.read()
                events = [e for e in rest.split(b"\n\n") if e.strip()]
                last = json.loads(events[-1].removeprefix(b"data: "))
                assert "error" in last
            assert gw.fleet.in_flight() == 0
            await asyncio.sleep(0.8)  # the crash window ends
            emu.server("n0").clear_faults()
            client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
            try:
                for _ in range(20):  # until the health check readmits the node
                    try:
                        out = await client.chat.completions.create(model=MODEL, messages=MSG,
                                                                   max_tokens=3)
                        break
                    except openai.APIStatusError:
                        await asyncio.sleep(0.25)
                else:
                    pytest.fail("the node never came back")
                assert out.usage is not None and out.usage.completion_tokens == 3
            finally:
                await client.close()
            assert gw.fleet.in_flight() == 0

    run(body)
