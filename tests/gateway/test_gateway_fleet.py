"""Changing the fleet of a running gateway: admin API, hot reload, signals."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from gateway_fakes import FakeEngine, fleet_and_gateway, fleet_doc, free_port, wait_for

from tailguard.config.faults import FaultSpec
from tailguard.config.fleet import EmulatorOptions, load_fleet
from tailguard.core.fleet import NodeState
from tailguard.gateway.app import RunningGateway, run_gateway

MSG = [{"role": "user", "content": "hello"}]
TOKEN = "admin-sekret"
SRC = str(Path(__file__).resolve().parents[2] / "src")


async def admin(gw: RunningGateway, method: str, path: str, token: str | None = TOKEN,
                body: Any = None) -> tuple[int, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with aiohttp.ClientSession() as s, \
            s.request(method, gw.url + path, headers=headers, json=body) as r:
        return r.status, await r.json()


async def chat(gw: RunningGateway, stream: bool = False, max_tokens: int = 3) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, \
            s.post(gw.url + "/v1/chat/completions",
                   json={"model": "m", "messages": MSG, "max_tokens": max_tokens,
                         "stream": stream}) as r:
        raw = await r.read()
        ok = r.status == 200 and (not stream or raw.endswith(b"data: [DONE]\n\n"))
        return (r.status if ok else -r.status), r.headers.get("x-tailguard-node", "")


def test_admin_is_off_without_a_token() -> None:
    async def body() -> None:
        async with fleet_and_gateway(["a"], admin={"token_env": "TG_TEST_UNSET_TOKEN"}) as (gw, _):
            status, data = await admin(gw, "GET", "/admin/nodes")
            assert status == 404 and data["error"]["code"] == "admin_disabled"

    asyncio.run(body())


def test_admin_api(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TG_TEST_ADMIN_TOKEN", TOKEN)

    async def body() -> None:
        extra = await FakeEngine("c").start()
        cfg = {"token_env": "TG_TEST_ADMIN_TOKEN", "allow": ["127.0.0.1/32"]}
        try:
            async with fleet_and_gateway(["a", "b"], admin=cfg) as (gw, _):
                for token in (None, "wrong"):
                    status, data = await admin(gw, "GET", "/admin/nodes", token)
                    assert status == 401 and data["error"]["code"] == "invalid_admin_token"
                await chat(gw, stream=True)
                await wait_for(lambda: gw.fleet.monitors["a"].sample is not None, what="a scraped")
                status, data = await admin(gw, "GET", "/admin/nodes")
                assert status == 200
                nodes = {n["id"]: n for n in data["nodes"]}
                assert set(nodes) == {"a", "b"}
                a_info = nodes["a"]
                assert a_info["gpu_class"] == "L4" and a_info["state"] == "healthy"
                assert a_info["in_flight"] == 0 and a_info["capacity"]["tokens_per_s"] > 0
                assert a_info["health"]["up"] is True
                assert a_info["engine_metrics"]["preemptions"] == 0

                entry = {"id": "c", "url": "http://10.9.9.9:8000", "gpu": "A100",
                         "models": ["m"]}
                status, data = await admin(gw, "POST", "/admin/nodes", body=entry)
                assert status == 400 and data["error"]["code"] == "url_not_allowed"
                status, data = await admin(gw, "POST", "/admin/nodes",
                                           body={**entry, "url": extra.url, "gpu": 7})
                assert status == 400 and "node.gpu" in data["error"]["message"]
                status, data = await admin(gw, "POST", "/admin/nodes", body={**entry, "url": extra.url})
                assert status == 201 and data["gpu_class"] == "A100-80GB" and data["registered"]
                status, _ = await admin(gw, "POST", "/admin/nodes", body={**entry, "url": extra.url})
                assert status == 409

                for node in ("a", "b"):
                    status, data = await admin(gw, "POST", f"/admin/nodes/{node}/drain")
                    assert status == 200 and data["state"] == "draining"
                for _ in range(3):
                    assert await chat(gw) == (200, "c")
                status, data = await admin(gw, "POST", "/admin/nodes/a/resume")
                assert data["state"] == "healthy"
                status, data = await admin(gw, "DELETE", "/admin/nodes/c")
                assert status == 202 and data["state"] == "draining"
                await wait_for(lambda: "c" not in gw.fleet.balancer.nodes, what="c removed")
                assert await chat(gw) == (200, "a")
                status, _ = await admin(gw, "DELETE", "/admin/nodes/zz")
                assert status == 404
        finally:
            await extra.stop()

    asyncio.run(body())


def _write(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(doc))
    os.replace(tmp, path)  # atomic: the poller never reads half a file


def test_hot_reload_under_traffic(tmp_path: Path) -> None:
    async def body() -> None:
        a, b = await FakeEngine("a").start(), await FakeEngine("b").start()
        for e in (a, b):
            e.behavior.token_delay_s = 0.01  # requests stay in flight across the reloads
        path = tmp_path / "fleet.yaml"
        _write(path, fleet_doc([a], reload={"poll_s": 0.05}))
        results: list[tuple[int, str]] = []
        stop = asyncio.Event()

        async def worker(i: int, gw: RunningGateway) -> None:
            while not stop.is_set():
                results.append(await chat(gw, stream=i % 2 == 0, max_tokens=5))

        try:
            async with run_gateway(load_fleet(path)) as gw:
                workers = [asyncio.create_task(worker(i, gw)) for i in range(6)]
                await wait_for(lambda: len(results) > 10, what="traffic")
                _write(path, fleet_doc([a, b], reload={"poll_s": 0.05}))
                await wait_for(lambda: any(n == "b" for _, n in results[-20:]), what="b serves")
                _write(path, fleet_doc([b], reload={"poll_s": 0.05}))
                await wait_for(lambda: "a" not in gw.fleet.balancer.nodes, what="a removed")
                mark = len(results)
                await wait_for(lambda: len(results) > mark + 10, what="traffic after")
                stop.set()
                await asyncio.gather(*workers)
                assert all(n == "b" for _, n in results[mark + 6:])
                assert gw.fleet.in_flight() == 0
                # a broken file changes nothing
                path.write_text("nodes: [{id: x}]\n")
                await wait_for(lambda: gw.metrics.reloads.labels("error")._value.get() >= 1,
                               what="failed reload counted")
                assert list(gw.fleet.balancer.nodes) == ["b"]
        finally:
            await a.stop()
            await b.stop()
        failures = [r for r in results if r[0] != 200]
        assert not failures, failures[:5]
        assert {n for _, n in results} == {"a", "b"}

    asyncio.run(body())


def test_serve_process_sighup_and_graceful_sigterm(tmp_path: Path) -> None:
    async def body() -> None:
        a, b = await FakeEngine("a").start(), await FakeEngine("b").start()
        a.behavior.token_delay_s = 0.05
        port = free_port()
        path = tmp_path / "fleet.yaml"
        _write(path, fleet_doc([a], listen=f"127.0.0.1:{port}", reload={"poll_s": 0}))
        env = {**os.environ, "PYTHONPATH": SRC}
        proc = subprocess.Popen(
            [sys.executable, "-m", "tailguard.cli", "serve", "--config", str(path),
             "--log-level", "warning"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as s:
                async def up() -> bool:
                    try:
                        async with s.get(url + "/ready") as r:
                            return r.status == 200
                    except aiohttp.ClientError:
                        return False

                for _ in range(200):
                    if await up():
                        break
                    assert proc.poll() is None, proc.communicate()
                    await asyncio.sleep(0.05)
                # SIGHUP reloads (polling is off)
                _write(path, fleet_doc([a, b], listen=f"127.0.0.1:{port}", reload={"poll_s": 0}))
                proc.send_signal(signal.SIGHUP)
                for _ in range(100):
                    async with s.get(url + "/metrics") as r:
                        if 'node="b"' in await r.text():
                            break
                    await asyncio.sleep(0.05)
                else:
                    raise AssertionError("SIGHUP did not reload")
                # SIGTERM while a stream is in flight: it finishes, then the process exits
                b.behavior.token_delay_s = 0.05
                r = await s.post(url + "/v1/chat/completions",
                                 json={"model": "m", "messages": MSG, "max_tokens": 20,
                                       "stream": True})
                first = await r.content.readany()
                proc.send_signal(signal.SIGTERM)
                rest = await r.read()
                assert (first + rest).endswith(b"data: [DONE]\n\n")
                assert (first + rest).count(b"tok") == 20
            code = await asyncio.get_running_loop().run_in_executor(None, proc.wait, 10)
            assert code == 0
        finally:
            if proc.poll() is None:
                proc.kill()
            _, err = proc.communicate()
            await a.stop()
            await b.stop()
        assert b"Traceback" not in err, err.decode()
        assert b"tailguard gateway on" in err

    asyncio.run(body())


def test_fleet_file_is_shared_with_the_emulator_shape(tmp_path: Path) -> None:
    """The emulator's keys are checked with the fleet file and ride along in NodeConfig."""
    path = tmp_path / "fleet.yaml"
    path.write_text(json.dumps({
        "nodes": [{"id": "x", "url": "http://127.0.0.1:8101", "gpu": "H100", "models": ["m"],
                   "faults": [{"kind": "stall", "seconds": 1, "at_s": 3, "duration_s": 2}],
                   "emulator": {"max_num_batched_tokens": 2048}}],
        "emulator": {"speed": 1.0},
    }))
    cfg = load_fleet(path)
    assert cfg.nodes[0].faults == (FaultSpec("stall", 3.0, 2.0, seconds=1.0),)
    assert cfg.nodes[0].emulator == EmulatorOptions(max_num_batched_tokens=2048)
    assert cfg.emulator == EmulatorOptions(speed=1.0)
    assert cfg.nodes[0].port == 8101 and cfg.nodes[0].host == "127.0.0.1"
    assert cfg.nodes[0].spec().gpu is not None
    assert NodeState.DOWN.routable is False
