"""The load generator against emulated engines on 127.0.0.1."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tailguard.bench import BenchConfig, length_dist_mapping, parse_length_arg, run_bench
from tailguard.cli import main
from tailguard.core.policies import Slo
from tailguard.emulator import EmulatedNode, Emulator, run_emulator
from tailguard.errors import ConfigError
from tailguard.traffic.workload import FixedLength


@asynccontextmanager
async def header_proxy(upstreams: dict[str, str], reject_every: int = 0
                       ) -> AsyncIterator[str]:
    """A stand-in for the gateway: round robin, ``x-tailguard-node``, a 429 every n-th request."""
    order = itertools.cycle(upstreams.items())
    counter = itertools.count(1)
    session = aiohttp.ClientSession()

    async def forward(request: web.Request) -> web.StreamResponse:
        if reject_every and next(counter) % reject_every == 0:
            return web.json_response({"error": {"message": "busy"}}, status=429)
        node, base = next(order)
        body = await request.read()
        async with session.post(base + request.path, data=body,
                                headers={"Content-Type": "application/json"}) as up:
            resp = web.StreamResponse(status=up.status, headers={
                "Content-Type": up.headers["Content-Type"], "x-tailguard-node": node})
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    async def models(request: web.Request) -> web.Response:
        async with session.get(next(iter(upstreams.values())) + "/v1/models") as up:
            return web.Response(body=await up.read(), content_type="application/json")

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", forward)
    app.router.add_post("/v1/completions", forward)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
        await session.close()


def test_length_words() -> None:
    assert length_dist_mapping("200") == {"dist": "fixed", "value": 200}
    assert length_dist_mapping("uniform:10,100") == {"dist": "uniform", "min": 10, "max": 100}
    assert length_dist_mapping("lognormal:6.6,1.0,4096") == {
        "dist": "lognormal", "mu": 6.6, "sigma": 1.0, "max": 4096}
    assert length_dist_mapping("azure-code:max=2048") == {"dist": "azure-code", "max": 2048}
    assert parse_length_arg("azure-conv", "--x", "output_tokens").max_tokens == 4096
    assert parse_length_arg("fixed:7", "--x", "input_tokens").mean() == 7
    for bad in ("zipf:1", "uniform:5", "fixed:x", "fixed:1,2", "uniform:9,3", "lognormal:1,0"):
        with pytest.raises(ConfigError) as err:
            parse_length_arg(bad, "--output-tokens", "output_tokens")
        assert err.value.field.startswith("--output-tokens")


def test_open_loop_through_a_proxy_counts_nodes_rejections_and_tokens() -> None:
    async def go() -> dict[str, object]:
        nodes = [EmulatedNode("h100-0", "H100"), EmulatedNode("a100-0", "A100")]
        async with run_emulator(nodes, speed=5) as emu, \
                header_proxy(emu.urls, reject_every=5) as proxy:
            cfg = BenchConfig(proxy, rate=100, duration_s=1.5, input_tokens=FixedLength(100),
                              output_tokens=FixedLength(40), slo=Slo(1.0, 0.05), seed=3)
            return await asyncio.wait_for(run_bench(cfg), 20)

    doc = asyncio.run(go())
    assert doc["model"] == "llama-3.1-8b"  # discovered from /v1/models
    r = doc["results"]["bench"]  # type: ignore[index]
    assert 100 <= r["requests"] <= 200  # Poisson, 150 expected
    assert r["rejected"] == r["requests"] // 5
    assert r["failed"] == 0
    assert r["completed"] == r["requests"] - r["rejected"]
    assert r["errors"] == {"http_429": r["rejected"]}
    assert r["output_tokens_per_s"] == pytest.approx(r["completed"] * 40 / 1.5)
    assert 0 < r["ttft_s"]["p50"] < 0.5
    assert 0 < r["tpot_s"]["p50"] < 0.02  # ~2-3 ms per step at speed 5
    assert r["slo_attainment"] == pytest.approx(r["completed"] / r["requests"], abs=0.05)
    nodes = r["per_node"]
    assert set(nodes) == {"h100-0", "a100-0", "direct"}  # 429s come from the proxy itself
    assert nodes["direct"]["requests"] == r["rejected"]
    assert abs(nodes["h100-0"]["requests"] - nodes["a100-0"]["requests"]) <= 1
    assert sum(n["share"] for n in nodes.values()) == pytest.approx(1.0)
    # the A100 decodes an 8B model ~1.3-1.6x slower than the H100
    assert nodes["a100-0"]["tpot_p50_s"] > nodes["h100-0"]["tpot_p50_s"]


def test_closed_loop_non_streaming_and_errors_by_kind() -> None:
    async def go() -> dict[str, object]:
        async with run_emulator([EmulatedNode("a", "L4")], speed=math.inf) as emu:
            async with aiohttp.ClientSession() as s, s.post(
                    emu.urls["a"] + "/admin/faults", json={"kind": "errors", "rate": 0.25}):
                pass
            cfg = BenchConfig(emu.urls["a"] + "/v1", concurrency=4, duration_s=0.5,
                              stream=False, endpoint="completions", max_requests=200,
                              output_tokens=FixedLength(12))
            return await run_bench(cfg)

    doc = asyncio.run(go())
    r = doc["results"]["bench"]  # type: ignore[index]
    assert r["requests"] == 200
    assert r["mode"] == "closed"
    assert set(r["errors"]) == {"http_5xx"}
    assert 25 <= r["failed"] <= 75
    assert r["completed"] + r["failed"] == 200
    assert r["output_tokens_per_s"] == pytest.approx(r["completed"] * 12 / 0.5)
    assert set(r["per_node"]) == {"direct"}


def test_unfinished_requests_are_bounded_by_the_drain() -> None:
    async def go() -> dict[str, object]:
        async with run_emulator([EmulatedNode("a", "L4")]) as emu:
            cfg = BenchConfig(emu.urls["a"], rate=20, duration_s=0.3, drain_s=0.2,
                              output_tokens=FixedLength(3000), max_requests=5)
            return await asyncio.wait_for(run_bench(cfg), 10)

    r = asyncio.run(go())["results"]["bench"]  # type: ignore[index]
    assert r["completed"] == 0
    assert r["unfinished"] == r["requests"] == r["failed"] > 0
    assert r["ttft_s"]["p50"] > 0  # cut-off requests still count in the TTFT statistics


@pytest.fixture
def emulator_thread() -> Iterator[str]:
    """An emulator on its own loop in a thread, for the synchronous CLI."""
    ready = threading.Event()
    urls: dict[str, str] = {}
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def serve() -> None:
        async with Emulator([EmulatedNode("x", "H100")], speed=20) as emu:
            urls.update(emu.urls)
            ready.set()
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),))
    thread.start()
    assert ready.wait(10)
    yield urls["x"]
    loop.call_soon_threadsafe(stop.set)
    thread.join(10)
    loop.close()


def test_cli_writes_the_sim_shaped_json(emulator_thread: str, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    rc = main(["bench", "--target", emulator_thread, "--concurrency", "2", "--duration", "0.4",
               "--output-tokens", "uniform:5,10", "--input-tokens", "azure-conv", "--json",
               str(out), "--quiet"])
    assert rc == 0
    doc = json.loads(out.read_text())
    r = doc["results"]["bench"]
    for key in ("offered_rps", "requests", "completed", "failed", "throughput_rps",
                "output_tokens_per_s", "ttft_s", "tpot_s", "e2e_s", "slo_attainment",
                "goodput_rps", "per_node"):
        assert key in r
    assert set(r["ttft_s"]) == {"mean", "p50", "p90", "p99", "max"}
    assert r["completed"] == r["requests"] > 0


def test_cli_flag_errors_exit_2() -> None:
    assert main(["bench", "--target", "ftp://x", "--rate", "1"]) == 2
    assert main(["bench", "--target", "http://127.0.0.1:1", "--rate", "-1"]) == 2
    assert main(["bench", "--target", "http://127.0.0.1:1", "--rate", "1",
                 "--output-tokens", "zipf"]) == 2


def test_unreachable_target_exits_1() -> None:
    assert main(["bench", "--target", "http://127.0.0.1:1", "--rate", "1", "--duration", "0.1",
                 "--quiet"]) == 1
