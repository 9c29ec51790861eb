"""Straggler detection, quarantine and remediation live: gateway + emulated engines.

Real sockets on 127.0.0.1, free ports; faults injected through the
emulator's ``POST /admin/faults``, exactly as an operator would.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tailguard.config.fleet import parse_fleet
from tailguard.emulator import EmulatedNode, run_emulator
from tailguard.gateway.app import RunningGateway, run_gateway

# Its bars are wall-clock times and live comparisons: `make test` runs it alone,
# after the rest has run two at a time (a second worker's load would move them).
pytestmark = pytest.mark.solo

MODEL = "llama-3.1-8b"
TOKEN = "straggler-test-token"
NODES = ["a0", "a1", "a2", "a3"]


def fleet_doc(urls: dict[str, str], *, migration: bool = True,
              **extra: Any) -> dict[str, Any]:
    return {
        "listen": "127.0.0.1:0",
        "nodes": [{"id": n, "url": url, "gpu": "A100-80GB", "models": [MODEL]}
                  for n, url in urls.items()],
        "pools": {MODEL: {"policy": "tailguard",
                          "timeouts": {"connect_s": 1.0, "first_byte_s": 5.0, "idle_s": 5.0,
                                       "total_s": 20.0},
                          "migration": {"enabled": migration}}},
        "scrape": {"interval_s": 0.2},
        "health": {"interval_s": 0.2},
        "admin": {"token_env": "TG_STRAGGLER_TOKEN"},
        **extra,
    }


async def load(gw: RunningGateway, stop: asyncio.Event, workers: int = 8) -> None:
    """Closed-loop streaming clients until ``stop``."""

    async def one(session: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 200}],
                    "max_tokens": 24, "stream": True}
            with contextlib.suppress(aiohttp.ClientError):
                async with session.post(gw.url + "/v1/chat/completions", json=body) as r:
                    await r.read()

    async with aiohttp.ClientSession() as s:
        await asyncio.gather(*(one(s) for _ in range(workers)))


async def get_json(url: str, path: str) -> Any:
    async with aiohttp.ClientSession() as s, \
            s.get(url + path, headers={"Authorization": f"Bearer {TOKEN}"}) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def node_state(gw: RunningGateway, node: str) -> str:
    data = await get_json(gw.url, "/admin/nodes")
    return next(str(n["state"]) for n in data["nodes"] if n["id"] == node)


async def wait_state(gw: RunningGateway, node: str, states: tuple[str, ...],
                     timeout: float) -> float:
    t0 = time.monotonic()
    while True:
        if await node_state(gw, node) in states:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{node} not {states} after {timeout} s "
                                 f"(now {await node_state(gw, node)})")
        await asyncio.sleep(0.1)


async def emulator_fault(url: str, fault: dict[str, Any] | None) -> None:
    async with aiohttp.ClientSession() as s:
        if fault is None:
            async with s.delete(url + "/admin/faults") as r:
                assert r.status == 200
        else:
            async with s.post(url + "/admin/faults", json=fault) as r:
                assert r.status == 200, await r.text()


def test_throttled_node_detected_live_within_15_s(monkeypatch: pytest.MonkeyPatch) -> None:
    """Default detection settings (5 s intervals, K = 2): a node at 40% speed is caught."""
    monkeypatch.setenv("TG_STRAGGLER_TOKEN", TOKEN)

    async def body() -> None:
        async with run_emulator([EmulatedNode(n, "A100-80GB") for n in NODES], speed=4) as emu:
            cfg = parse_fleet(fleet_doc(emu.urls))
            async with run_gateway(cfg) as gw:
                stop = asyncio.Event()
                task = asyncio.create_task(load(gw, stop))
                try:
                    await asyncio.sleep(11)  # two intervals of healthy history
                    assert [await node_state(gw, n) for n in NODES] == ["healthy"] * 4
                    await emulator_fault(emu.urls["a1"], {"kind": "throttle", "factor": 0.4})
                    took = await wait_state(gw, "a1", ("degraded", "quarantined"), 15.0)
                    print(f"live throttle 0.4 detected after {took:.1f} s")
                    assert [await node_state(gw, n) for n in ("a0", "a2", "a3")] == \
                        ["healthy"] * 3
                finally:
                    stop.set()
                    await task

    asyncio.run(body())


def test_fault_quarantine_remediation_probation_healthy(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TG_STRAGGLER_TOKEN", TOKEN)
    marker = tmp_path / "remediated.txt"
    script = ("import os, pathlib; pathlib.Path(os.environ['OUT']).write_text("
              "os.environ['TAILGUARD_NODE_ID'] + ' ' + os.environ['TAILGUARD_NODE_GPU'] + ' ' "
              "+ os.environ['TAILGUARD_NODE_REASON'])")
    monkeypatch.setenv("OUT", str(marker))

    async def body() -> None:
        async with run_emulator([EmulatedNode(n, "A100-80GB") for n in NODES], speed=4) as emu:
            cfg = parse_fleet(fleet_doc(
                emu.urls,
                outliers={"interval_s": 1.0, "base_ejection_s": 2.0, "slow_start_s": 2.0,
                          "jitter": 0.0},
                remediation={"cooldown_s": 0, "rules": [
                    {"on": "quarantined", "command": [sys.executable, "-c", script]},
                    {"on": "recovered", "command": [sys.executable, "-c", "pass"]}]}))
            async with run_gateway(cfg) as gw:
                stop = asyncio.Event()
                task = asyncio.create_task(load(gw, stop))
                try:
                    await asyncio.sleep(1.0)
                    await emulator_fault(emu.urls["a2"], {"kind": "errors", "rate": 1.0})
                    await wait_state(gw, "a2", ("quarantined",), 10.0)
                    async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
                        text = await r.text()
                    assert 'tailguard_node_state{gpu="A100-80GB",node="a2",state="quarantined"} 1.0' \
                        in text
                    assert 'tailguard_outlier_ejections_total{kind="enforced"}' in text
                    for _ in range(100):  # the command runs in the background
                        if marker.exists():
                            break
                        await asyncio.sleep(0.05)
                    text = marker.read_text()
                    assert text.startswith("a2 A100-80GB ") and "consecutive failures" in text
                    await emulator_fault(emu.urls["a2"], None)
                    await wait_state(gw, "a2", ("healthy",), 15.0)
                finally:
                    stop.set()
                    await task
                events = (await get_json(gw.url, "/admin/events"))["events"]
        a2 = [(e["kind"], e.get("state") or e.get("trigger"), e.get("result"))
              for e in events if e["node"] == "a2"]
        assert ("state", "quarantined", None) in a2
        assert ("action", "quarantined", "ok") in a2
        # Out of quarantine only through probation, and healthy last.
        states = [s for k, s, _ in a2 if k == "state"]
        assert "probation" in states and states[-1] == "healthy"
        assert ("action", "recovered", "ok") in a2

    asyncio.run(body())


def test_hedge_races_a_stalled_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stalled node's requests are answered by their hedges; the losers are released."""
    monkeypatch.setenv("TG_STRAGGLER_TOKEN", TOKEN)

    async def stream(gw: RunningGateway) -> tuple[float, str, bytes]:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 8, "stream": True}
        t0 = time.monotonic()
        async with aiohttp.ClientSession() as s, \
                s.post(gw.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            first = await r.content.readany()
            ttft = time.monotonic() - t0
            rest = await r.read()
            return ttft, r.headers["x-tailguard-node"], first + rest

    async def body() -> None:
        nodes = [EmulatedNode(n, "A100-80GB") for n in ("a0", "a1")]
        async with run_emulator(nodes, speed=4) as emu:
            doc = fleet_doc(emu.urls, outliers={"enabled": False})
            doc["pools"][MODEL].update(policy="round_robin",
                                       hedging={"enabled": True, "after_s": 0.3, "budget": 1.0})
            async with run_gateway(parse_fleet(doc)) as gw:
                await emulator_fault(emu.urls["a0"], {"kind": "stall", "seconds": 20})
                results = await asyncio.gather(*(stream(gw) for _ in range(6)))
                assert all(b.rstrip().endswith(b"data: [DONE]") for _, _, b in results)
                # Every answer came from the healthy node, within a second.
                assert {n for _, n, _ in results} == {"a1"}
                assert max(t for t, _, _ in results) < 2.0
                bal = gw.fleet.balancer
                assert bal.nodes["a0"].in_flight == 0 and bal.nodes["a1"].in_flight == 0
                async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
                    text = await r.text()
                assert 'tailguard_hedges_total{pool="llama-3.1-8b",result="won"} 3.0' in text
                await emulator_fault(emu.urls["a0"], None)

    asyncio.run(body())


def test_hedge_with_the_learned_per_request_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    """Default hedging (no fixed delay): after warm-up traffic the delay is learned from
    the class's TTFTs (expected TTFT x the learned p95 of observed/expected, capped by the
    class's p95), and a stalled node's streams are still answered by their hedges."""
    monkeypatch.setenv("TG_STRAGGLER_TOKEN", TOKEN)

    async def stream(gw: RunningGateway) -> tuple[float, str]:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 4, "stream": True}
        t0 = time.monotonic()
        async with aiohttp.ClientSession() as s, \
                s.post(gw.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            first = await r.content.readany()
            ttft = time.monotonic() - t0
            # A short stream may arrive in one chunk: the end is in first + rest.
            assert (first + await r.read()).rstrip().endswith(b"data: [DONE]")
            return ttft, r.headers["x-tailguard-node"]

    async def body() -> None:
        nodes = [EmulatedNode(n, "A100-80GB") for n in ("a0", "a1")]
        async with run_emulator(nodes, speed=4) as emu:
            doc = fleet_doc(emu.urls, outliers={"enabled": False})
            doc["pools"][MODEL].update(policy="round_robin",
                                       hedging={"enabled": True, "budget": 1.0})
            async with run_gateway(parse_fleet(doc)) as gw:
                for _ in range(30):  # warm-up: the hedger learns the class's TTFTs
                    await stream(gw)
                hedger = gw.fleet.balancer.pools[MODEL].hedger
                assert hedger is not None
                after = hedger.hedge_after("A100-80GB")
                assert after is not None and after < 1.0  # learned, not a fixed value
                await emulator_fault(emu.urls["a0"], {"kind": "stall", "seconds": 20})
                results = await asyncio.gather(*(stream(gw) for _ in range(6)))
                assert {n for _, n in results} == {"a1"}
                assert max(t for t, _ in results) < 2.0
                bal = gw.fleet.balancer
                assert bal.nodes["a0"].in_flight == 0 and bal.nodes["a1"].in_flight == 0
                await emulator_fault(emu.urls["a0"], None)

    asyncio.run(body())


def test_a_node_that_stalls_now_and_then_stays_healthy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node paused 2 s in every 8: each pause is counted as a stall, on that node
    and on no other, whether a prompt waited through it (the router dodges those
    as they happen) or only streams froze (the gaps they resume from); the
    decode pieces timed across them are left out of the detector's evidence,
    and the node is never degraded for them (silent a quarter of the time, it
    is no slower than a 1.33x node, not flagged). Migration is off: with it, a
    stream paused past its stall trigger moves and is not timed across the
    pause at all."""
    monkeypatch.setenv("TG_STRAGGLER_TOKEN", TOKEN)

    async def body() -> None:
        async with run_emulator([EmulatedNode(n, "A100-80GB") for n in NODES], speed=4) as emu:
            cfg = parse_fleet(fleet_doc(emu.urls, migration=False))
            async with run_gateway(cfg) as gw:
                stop = asyncio.Event()
                task = asyncio.create_task(load(gw, stop, workers=16))
                states: set[str] = set()
                try:
                    await asyncio.sleep(5)  # healthy history first
                    # five pauses (at 0, 8, ..., 32 s)
                    await emulator_fault(emu.urls["a0"], {"kind": "stall", "seconds": 2,
                                                          "period_s": 8, "duration_s": 36})
                    t_end = time.monotonic() + 38
                    while time.monotonic() < t_end:
                        states.add(await node_state(gw, "a0"))
                        await asyncio.sleep(0.25)
                finally:
                    stop.set()
                    await task
                nodes = gw.fleet.balancer.nodes
                det = gw.fleet.balancer.outliers
                assert det is not None
                print(f"live stalls: {nodes['a0'].stalls} stalls, {nodes['a0'].stalled_s:.1f} s "
                      f"silent, {det.stall_samples} decode samples left out; a0 {states}")
                assert states == {"healthy"}
                assert nodes["a0"].stalls >= 4
                assert [nodes[n].stalls for n in NODES[1:]] == [0, 0, 0]
                assert det.stall_samples > 0
                async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
                    text = await r.text()
                assert f'tailguard_node_stalls_total{{gpu="A100-80GB",node="a0"}} ' \
                       f'{float(nodes["a0"].stalls)}' in text

    asyncio.run(body())


def test_a_stalled_stream_that_wins_its_race_tells_the_stall(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream moved for a stall races its continuation; where the stalled node
    comes back first (the other node is slow to prefill the continuation), the
    stream goes on from it, and the gap it resumed from is its node's stall, as a
    stream that never moved tells it."""
    monkeypatch.setenv("TG_STRAGGLER_TOKEN", TOKEN)

    async def body() -> None:
        nodes = [EmulatedNode(n, "A100-80GB") for n in ("a0", "a1")]
        async with run_emulator(nodes, speed=4) as emu, \
                run_gateway(parse_fleet(fleet_doc(emu.urls))) as gw:
            # a1 prefills at a fiftieth of its speed: the stream goes to a0, and
            # its continuation on a1 takes seconds to its first token
            await emulator_fault(emu.urls["a1"], {"kind": "throttle", "factor": 0.02})
            req = {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 2000}],
                   "max_tokens": 400, "stream": True}
            async with aiohttp.ClientSession() as s, \
                    s.post(gw.url + "/v1/chat/completions", json=req) as r:
                assert r.headers["x-tailguard-node"] == "a0"
                await r.content.readany()
                await asyncio.sleep(0.2)
                await emulator_fault(emu.urls["a0"], {"kind": "stall", "seconds": 2})
                text = (await r.read()).decode()
            assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text
            reg = gw.metrics.registry
            resumed = reg.get_sample_value("tailguard_migrations_total",
                                           {"pool": MODEL, "cause": "stall",
                                            "result": "resumed"})
            a0 = gw.fleet.balancer.nodes["a0"]
            print(f"resumed {resumed}; a0 {a0.stalls} stalls, {a0.stalled_s:.2f} s")
            assert resumed == 1.0
            assert a0.stalls == 1 and a0.stalled_s >= 1.8
            assert gw.fleet.balancer.nodes["a1"].stalls == 0

    asyncio.run(body())
