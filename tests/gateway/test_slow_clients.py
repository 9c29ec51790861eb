"""10,000 idle and slowloris connections against a `tailguard serve` process (issue 11).

The gateway runs as its own process (its own file-descriptor table, as in
production) in front of a fake engine; the test holds 5,000 connections that
send nothing and 5,000 that send half a request's headers, then checks that a
normal client is still answered within 1 s and that the gateway closes every
one of them within its timeouts, back to its baseline of file descriptors.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
import yaml
from gateway_fakes import FakeEngine, fleet_doc, free_port, wait_serving

SRC = str(Path(__file__).resolve().parents[2] / "src")
HOLD = 10_000


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_ten_thousand_idle_and_slowloris_connections(tmp_path: Path) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < HOLD + 2000:
        pytest.skip(f"the file-descriptor limit ({hard}) is below what the test holds")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        asyncio.run(_body(tmp_path))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def _body(tmp_path: Path) -> None:
    engine = await FakeEngine("a").start()
    port = free_port()
    doc = fleet_doc([engine], listen=f"127.0.0.1:{port}",
                    client={"header_timeout_s": 4.0, "idle_timeout_s": 6.0,
                            "max_connections": HOLD + 100})
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(doc))
    proc = subprocess.Popen([sys.executable, "-m", "tailguard", "serve", "--config", str(path),
                             "--log-level", "warning"],
                            env={**os.environ, "PYTHONPATH": SRC},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    held: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        url = f"http://127.0.0.1:{port}"
        loop = asyncio.get_running_loop()
        await wait_serving(url, proc)
        await asyncio.sleep(0.5)
        baseline = _fds(proc.pid)
        t_open = loop.time()
        for i in range(HOLD):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            if i % 2:  # slowloris: half a request, then nothing
                w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: 1")
            held.append((r, w))
        opened_in = loop.time() - t_open
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        async with aiohttp.ClientSession() as s:
            t0 = time.monotonic()
            async with s.post(url + "/v1/chat/completions", json=body) as resp:
                answer = await resp.read()
            took = time.monotonic() - t0
        assert resp.status == 200, answer[:300]
        assert took < 1.0, f"a normal client waited {took:.2f} s beside {HOLD} held connections"

        async def closed(r: asyncio.StreamReader) -> bool:
            try:
                return await asyncio.wait_for(r.read(), 20.0) == b""
            except ConnectionError:
                return True

        t_wait = loop.time()
        results = await asyncio.gather(*(closed(r) for r, _ in held))
        assert all(results)
        # all closed by the timeouts, counted from when each was opened (6 s idle at most)
        assert loop.time() - t_open < opened_in + 6.0 + 4.0, loop.time() - t_wait
        for _, w in held:
            w.close()
        held.clear()
        for _ in range(50):
            if _fds(proc.pid) <= baseline + 2:
                break
            await asyncio.sleep(0.1)
        assert _fds(proc.pid) <= baseline + 2, (baseline, _fds(proc.pid))
        async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
            text = await r.text()
        closed_by: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("tailguard_client_connections_closed_total{"):
                reason = line.split('reason="')[1].split('"')[0]
                closed_by[reason] = float(line.rsplit(" ", 1)[1])
        assert closed_by.get("header_timeout", 0) >= HOLD // 2 - 10, json.dumps(closed_by)
        assert closed_by.get("idle_timeout", 0) >= HOLD // 2 - 10, json.dumps(closed_by)
    finally:
        for _, w in held:
            w.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        await engine.stop()
