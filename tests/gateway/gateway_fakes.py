"""A small fake OpenAI-compatible engine for the gateway tests.

It stands in for the emulated engine (``tailguard.emulator``) until that
exists, and keeps failure modes the emulator need not have: a 500 or 429
answer, a slow first byte, a stream that dies after a few chunks, a hang.
Each engine runs on its own free port on 127.0.0.1 and records what it
received, so tests can check that bodies and headers were passed through.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from tailguard.config.fleet import parse_fleet
from tailguard.gateway.app import RunningGateway, run_gateway


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Behavior:
    """What the engine does with the next requests (tests change it at will)."""

    mode: str = "ok"  # ok | error500 | error429 | die_mid_stream | hang | bad_request
    tokens: int = 5  # default answer length when max_tokens is absent
    token_delay_s: float = 0.0
    first_delay_s: float = 0.0
    die_after: int = 2  # chunks sent before die_mid_stream aborts
    metrics_status: int = 200
    health_status: int = 200
    running: int = 0
    waiting: int = 0
    preemptions: int = 0  # vLLM's count since the engine started


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class FakeEngine:
    name: str
    behavior: Behavior = field(default_factory=Behavior)
    seen: list[Seen] = field(default_factory=list)
    port: int = 0
    runner: web.AppRunner | None = None
    served: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, port: int | None = None) -> FakeEngine:
        app = web.Application()
        app.add_routes([
            web.post("/v1/chat/completions", self._generate),
            web.post("/v1/completions", self._generate),
            web.post("/v1/embeddings", self._embeddings),
            web.get("/health", self._health),
            web.get("/metrics", self._metrics),
        ])
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self.runner.setup()
        self.port = port or self.port or free_port()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    # -- handlers --------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.behavior.health_status, text="ok")

    async def _metrics(self, request: web.Request) -> web.Response:
        b = self.behavior
        text = (
            "# HELP vllm:num_requests_running Number of requests running.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="m"}} {b.running}.0\n'
            f'vllm:num_requests_waiting{{model_name="m"}} {b.waiting}.0\n'
            'vllm:kv_cache_usage_perc{model_name="m"} 0.25\n'
            "# TYPE vllm:num_preemptions_total counter\n"
            f'vllm:num_preemptions_total{{model_name="m"}} {b.preemptions}.0\n'
        )
        return web.Response(status=b.metrics_status, text=text)

    async def _embeddings(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.seen.append(Seen(request.path, dict(request.headers), body))
        self.served += 1
        return web.json_response({"object": "list", "model": body["model"],
                                  "data": [{"object": "embedding", "index": 0,
                                            "embedding": [0.1, 0.2]}],
                                  "usage": {"prompt_tokens": 2, "total_tokens": 2}})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(Seen(request.path, dict(request.headers), body))
        b = self.behavior
        if b.mode == "error500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        if b.mode == "error429":
            return web.json_response({"error": {"message": "busy"}}, status=429,
                                     headers={"Retry-After": "2"})
        if b.mode == "bad_request":
            return web.json_response({"error": {"message": "context too long",
                                                "type": "BadRequestError", "code": 400}},
                                     status=400)
        if b.mode == "hang":
            await asyncio.sleep(3600)
        if b.first_delay_s:
            await asyncio.sleep(b.first_delay_s)
        chat = request.path.endswith("chat/completions")
        n = int(body.get("max_tokens") or b.tokens)
        model = body["model"]
        self.served += 1
        usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}
        if not body.get("stream"):
            for _ in range(n):
                if b.token_delay_s:
                    await asyncio.sleep(b.token_delay_s)
            if chat:
                choice: dict[str, Any] = {"index": 0, "finish_reason": "length",
                                          "message": {"role": "assistant",
                                                      "content": " tok" * n}}
            else:
                choice = {"index": 0, "finish_reason": "length", "text": " tok" * n}
            return web.json_response({
                "id": "x", "object": "chat.completion" if chat else "text_completion",
                "created": 0, "model": model, "choices": [choice], "usage": usage,
                "engine": self.name})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "x-engine": self.name})
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list[Any], extra: dict[str, Any] | None = None) -> bytes:
            d: dict[str, Any] = {"id": "x", "object": obj, "created": 0, "model": model,
                                 "choices": choices}
            if extra:
                d.update(extra)
            return b"data: " + json.dumps(d).encode() + b"\n\n"

        def token(i: int) -> bytes:
            if chat:
                return event([{"index": 0, "delta": {"content": " tok"}, "finish_reason": None}])
            return event([{"index": 0, "text": " tok", "finish_reason": None}])

        if chat:
            await resp.write(event([{"index": 0, "delta": {"role": "assistant"},
                                     "finish_reason": None}]))
        for i in range(n):
            if b.mode == "die_mid_stream" and i >= b.die_after:
                assert request.transport is not None
                request.transport.abort()  # the engine process died
                return resp
            if b.token_delay_s:
                await asyncio.sleep(b.token_delay_s)
            try:
                await resp.write(token(i))
            except ConnectionError:  # the gateway hung up (its client went away)
                return resp
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(event([], {"usage": usage}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def fleet_doc(engines: list[FakeEngine], model: str = "m", **extra: Any) -> dict[str, Any]:
    """A fleet-file document for ``engines`` (all L4s serving ``model``)."""
    doc: dict[str, Any] = {
        "listen": "127.0.0.1:0",
        "nodes": [{"id": e.name, "url": e.url, "gpu": "L4", "models": [model]} for e in engines],
        "pools": {model: {"policy": "least_request",
                          "timeouts": {"connect_s": 1.0, "first_byte_s": 5.0, "idle_s": 5.0,
                                       "total_s": 20.0}}},
        "scrape": {"interval_s": 0.1, "stale_s": 0.5},
        "health": {"interval_s": 0.1, "failures": 2},
    }
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(doc.get(k), dict):
            doc[k] = {**doc[k], **v}
        else:
            doc[k] = v
    return doc


@asynccontextmanager
async def fleet_and_gateway(
    names: list[str], model: str = "m", **extra: Any
) -> AsyncIterator[tuple[RunningGateway, list[FakeEngine]]]:
    """Fake engines ``names`` and a gateway in front of them; all cleaned up on exit."""
    engines = [await FakeEngine(n).start() for n in names]
    try:
        cfg = parse_fleet(fleet_doc(engines, model, **extra))
        async with run_gateway(cfg) as gw:
            yield gw, engines
    finally:
        for e in engines:
            await e.stop()


async def wait_for(pred: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def wait_serving(url: str, proc: subprocess.Popen[bytes], path: str = "/health",
                       timeout: float = 30.0) -> None:
    """Until a gateway process started on ``url`` answers 200 on ``path``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    async with aiohttp.ClientSession() as s:
        while True:
            try:
                async with s.get(url + path) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            assert proc.poll() is None, "the gateway process exited"
            assert loop.time() < deadline, f"{url}{path} never answered 200"
            await asyncio.sleep(0.05)
