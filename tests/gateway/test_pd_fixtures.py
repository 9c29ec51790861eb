"""vLLM's P/D request and answer shapes, recorded in ``fixtures/vllm_pd.json`` from
vLLM's own sources (cited there): the gateway's two legs must be what vLLM's
proxy sends, and the emulated engines must answer as vLLM does.

The gateway side runs over real sockets against recording stand-ins (the prefill
one answers with the recorded prefill answer); the emulator side sends the
recorded legs to emulated engines."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from gateway_fakes import FakeEngine, free_port

from tailguard.config.fleet import parse_fleet
from tailguard.emulator import EmulatedNode, run_emulator
from tailguard.gateway.app import run_gateway

FIXTURE: dict[str, Any] = json.loads(
    (Path(__file__).parent / "fixtures" / "vllm_pd.json").read_text())


class PrefillStandIn:
    """Records each request and answers with the recorded prefill answer."""

    def __init__(self) -> None:
        self.seen: list[tuple[dict[str, str], dict[str, Any]]] = []
        self.port = free_port()
        self.runner: web.AppRunner | None = None

    async def _answer(self, request: web.Request) -> web.Response:
        self.seen.append((dict(request.headers), await request.json()))
        return web.json_response(FIXTURE["prefill_answer"])

    async def _ok(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def start(self) -> str:
        app = web.Application()
        app.add_routes([web.post("/v1/chat/completions", self._answer),
                        web.get("/health", self._ok), web.get("/metrics", self._ok)])
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return f"http://127.0.0.1:{self.port}"


def test_the_gateways_two_legs_are_vllms() -> None:
    async def body() -> None:
        pre = PrefillStandIn()
        dec = await FakeEngine("dec").start()
        try:
            cfg = parse_fleet({
                "listen": "127.0.0.1:0",
                "nodes": [{"id": "pre", "url": await pre.start(), "gpu": "H100-SXM",
                           "models": ["m"], "role": "prefill"},
                          {"id": "dec", "url": dec.url, "gpu": "A100-80GB", "models": ["m"],
                           "role": "decode"}],
                # a single-node policy routes each phase on its own: every request splits
                "pools": {"m": {"policy": "round_robin"}},
            })
            async with run_gateway(cfg) as gw, aiohttp.ClientSession() as s, \
                    s.post(gw.url + "/v1/chat/completions", json=FIXTURE["client_request"],
                           headers={"x-request-id": "pd-fixture-1"}) as r:
                assert r.status == 200, await r.text()
                await r.read()
        finally:
            await dec.stop()
            if pre.runner is not None:
                await pre.runner.cleanup()
        (pre_headers, leg), = pre.seen
        # vllm-router adds min_tokens 1 where vLLM's proxy drops it: both valid for a
        # one-token leg; the gateway does as vllm-router
        assert leg.pop("min_tokens", 1) == 1
        assert leg == FIXTURE["prefill_request"]
        (seen,) = dec.seen
        assert seen.body == FIXTURE["decode_request"]  # the params verbatim
        ids = {v for h in (pre_headers, seen.headers) for k, v in h.items()
               if k.lower() == "x-request-id"}
        assert ids == {"pd-fixture-1"}  # one id on both legs

    asyncio.run(asyncio.wait_for(body(), 30))


def _shape(doc: Any) -> Any:
    """A document's keys and value types, recursively (values themselves differ)."""
    if isinstance(doc, dict):
        return {k: _shape(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_shape(doc[0])] if doc else []
    return type(doc).__name__


def test_the_emulated_engines_answer_as_vllm() -> None:
    async def body() -> None:
        nodes = [EmulatedNode("pre", "H100-SXM", ("m",)), EmulatedNode("dec", "A100-80GB", ("m",))]
        async with run_emulator(nodes, speed=10.0) as emu, aiohttp.ClientSession() as s:
            async with s.post(emu.urls["pre"] + "/v1/chat/completions",
                              json=FIXTURE["prefill_request"]) as r:
                assert r.status == 200, await r.text()
                answer = await r.json()
            want = FIXTURE["prefill_answer"]
            assert _shape(answer["kv_transfer_params"]) == _shape(want["kv_transfer_params"])
            assert answer["kv_transfer_params"]["do_remote_prefill"] is True
            (choice,) = answer["choices"]
            assert choice["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 1
            # every field a client of vLLM reads is there
            assert set(answer) >= {"id", "object", "created", "model", "choices", "usage",
                                   "kv_transfer_params"}
            decode = dict(FIXTURE["decode_request"],
                          kv_transfer_params=answer["kv_transfer_params"], stream=False)
            decode.pop("stream_options")
            async with s.post(emu.urls["dec"] + "/v1/chat/completions", json=decode) as r:
                assert r.status == 200, await r.text()
                done = await r.json()
            assert done["usage"]["completion_tokens"] == 24
            assert emu.server("dec").kv_received == 1 and emu.server("dec").kv_missing == 0
            assert emu.server("pre").kv_sent == 1

    asyncio.run(asyncio.wait_for(body(), 30))
