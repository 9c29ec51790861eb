"""A live stack for browser and Prometheus tests: emulated engines, a gateway, light load.

Runs in a background thread with its own event loop, so that a test can drive
external processes (Chromium, Prometheus) from the main thread with plain
blocking calls. Everything listens on 127.0.0.1 on free ports and is stopped
on exit.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import threading
import urllib.request
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp
import pytest

from tailguard.config.fleet import parse_fleet
from tailguard.emulator import EmulatedNode, run_emulator
from tailguard.gateway.app import RunningGateway, run_gateway

MODEL = "llama-3.1-8b"
MIXED = (("h100-0", "H100-SXM"), ("a100-0", "A100-80GB"), ("a100-1", "A100-80GB"),
         ("l4-0", "L4"), ("l4-1", "L4"), ("l4-2", "L4"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def need_binary(name: str) -> str:
    """The binary's path, or skip: ``make sysdeps`` installs it where it can (Debian, root)."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed and could not be installed "
                    "(make sysdeps: apt-get install prometheus chromium chromium-driver)")
    return path


def http_json(method: str, url: str, body: Any = None, timeout: float = 10.0) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    return json.loads(raw) if raw else None


class LiveStack:
    """``with LiveStack(...) as st: st.gw.url, st.engine_urls, st.call(lambda gw: ...)``."""

    def __init__(self, nodes: tuple[tuple[str, str], ...] = MIXED, rate: float = 6.0,
                 pool: dict[str, Any] | None = None, max_tokens: int = 24) -> None:
        self.nodes = [EmulatedNode(nid, gpu, models=(MODEL,)) for nid, gpu in nodes]
        self.rate = rate
        self.pool = pool or {"policy": "tailguard"}
        self.max_tokens = max_tokens
        self.gw: RunningGateway | None = None
        self.engine_urls: dict[str, str] = {}
        self.sent = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="live-stack", daemon=True)

    @property
    def url(self) -> str:
        assert self.gw is not None
        return self.gw.url

    def __enter__(self) -> LiveStack:
        self._thread.start()
        if not self._ready.wait(30) or self._error is not None:
            self.__exit__(None, None, None)
            raise RuntimeError(f"live stack did not start: {self._error!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        assert not self._thread.is_alive(), "live stack did not stop"

    def call(self, fn: Callable[[RunningGateway], Any]) -> Any:
        """Run ``fn(gw)`` on the stack's loop (the gateway is not thread-safe) and return it."""
        assert self._loop is not None and self.gw is not None
        gw = self.gw

        async def run() -> Any:
            return fn(gw)

        return self.run(run())

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)

    def fault(self, node_id: str, fault: dict[str, Any]) -> None:
        """Inject a fault into an emulated engine (``POST /admin/faults``)."""
        http_json("POST", self.engine_urls[node_id] + "/admin/faults", fault)

    # -- the loop ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported to __enter__ / the test
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with run_emulator(self.nodes, host="127.0.0.1") as emu:
            self.engine_urls = dict(emu.urls)
            fleet = parse_fleet({
                "listen": "127.0.0.1:0",
                "nodes": [{"id": n.id, "url": emu.urls[n.id], "gpu": n.gpu, "models": [MODEL]}
                          for n in self.nodes],
                "pools": {MODEL: self.pool},
                "scrape": {"interval_s": 0.25, "stale_s": 1.0},
                "health": {"interval_s": 0.25, "timeout_s": 0.5, "failures": 2},
            })
            async with run_gateway(fleet) as gw:
                self.gw = gw
                load = asyncio.create_task(self._load(gw.url))
                self._ready.set()
                await self._stop.wait()
                load.cancel()
                await asyncio.gather(load, return_exceptions=True)

    async def _load(self, url: str) -> None:
        """Poisson-free steady load: one streamed request every 1/rate s."""
        body = {"model": MODEL, "messages": [{"role": "user", "content": "tell me a story " * 20}],
                "max_tokens": self.max_tokens, "stream": True, "ignore_eos": True}
        tasks: set[asyncio.Task[None]] = set()
        async with aiohttp.ClientSession() as s:

            async def one() -> None:
                try:
                    async with s.post(url + "/v1/chat/completions", json=body) as r:
                        await r.read()
                except aiohttp.ClientError:
                    pass  # faults are injected on purpose; the gateway counts them

            try:
                while True:
                    t = asyncio.create_task(one())
                    tasks.add(t)
                    t.add_done_callback(tasks.discard)
                    self.sent += 1
                    await asyncio.sleep(1.0 / self.rate)
            finally:
                for t in list(tasks):
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
