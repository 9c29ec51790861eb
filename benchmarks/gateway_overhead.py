"""What the gateway adds to a request: direct to an engine vs through the gateway, one run.

A zero-delay emulated engine (``speed=inf``: answers at once) isolates the
gateway's own cost. Measures, side by side in the same process and run:

* added p50/p99 latency at concurrency 1, non-streaming and streaming;
* the highest non-streaming request rate at 64 connections (closed loop);
* with ``--wrk`` (and Debian's ``wrk`` installed), the same rate with the
  engine and the gateway in their own processes (``tailguard emulate``,
  ``tailguard serve``) and the load from ``wrk``, so that the client's cost
  does not count against the gateway.

Goal (issue 3): added p50 <= 1 ms at concurrency 1, >= 4,000 req/s through
the gateway. Prints what it measured; asserts nothing. Load generator,
gateway and engine share this machine's cores, so the absolute numbers are
pessimistic; compare the two columns.

    python benchmarks/gateway_overhead.py [--requests 2000] [--seconds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

from tailguard.emulator import EmulatedNode, run_emulator
from tailguard.gateway.app import run_gateway
from tailguard.gateway.config import parse_fleet

MODEL = "llama-3.1-8b"


def body(stream: bool) -> bytes:
    return json.dumps({"model": MODEL, "max_tokens": 8, "stream": stream,
                       "messages": [{"role": "user", "content": "hello there"}]}).encode()


async def sequential(session: aiohttp.ClientSession, url: str, n: int, stream: bool) -> list[float]:
    data = body(stream)
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        async with session.post(url, data=data,
                                headers={"content-type": "application/json"}) as resp:
            await resp.read()
            assert resp.status == 200, resp.status
        out.append(time.perf_counter() - t0)
    return out


async def closed_loop(session: aiohttp.ClientSession, url: str, conns: int, seconds: float) -> float:
    data = body(False)
    done = 0
    stop = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            async with session.post(url, data=data,
                                    headers={"content-type": "application/json"}) as resp:
                await resp.read()
            done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conns)))
    return done / (time.perf_counter() - t0)


async def main(requests: int, seconds: float) -> None:
    async with run_emulator([EmulatedNode("e0", "H100", models=(MODEL,))], speed=math.inf) as emu:
        fleet = parse_fleet({"listen": "127.0.0.1:0",
                             "nodes": [{"id": "e0", "url": emu.urls["e0"], "gpu": "H100",
                                        "models": [MODEL]}],
                             "pools": {MODEL: {"policy": "tailguard"}}}, None)
        async with run_gateway(fleet) as gw, aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=256)) as session:
            targets = {"direct": emu.urls["e0"], "gateway": gw.url}
            print(f"{'':28s}{'direct':>12s}{'gateway':>12s}{'added':>12s}")
            for stream in (False, True):
                p = {}
                for name, base in targets.items():
                    url = base + "/v1/chat/completions"
                    await sequential(session, url, 50, stream)  # warm up connections
                    lat = np.array(await sequential(session, url, requests, stream)) * 1e3
                    p[name] = (float(np.percentile(lat, 50)), float(np.percentile(lat, 99)))
                kind = "streaming" if stream else "non-streaming"
                for i, q in enumerate(("p50", "p99")):
                    d, g = p["direct"][i], p["gateway"][i]
                    print(f"c=1 {kind:14s} {q} ms   {d:12.3f}{g:12.3f}{g - d:12.3f}")
            rates = {name: await closed_loop(session, base + "/v1/chat/completions", 64, seconds)
                     for name, base in targets.items()}
            print(f"64 connections, non-streaming req/s {rates['direct']:12.0f}"
                  f"{rates['gateway']:12.0f}   ratio {rates['gateway'] / rates['direct']:.2f}")


WRK_LUA = """wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '%s'
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {port}")


def wrk_rate(url: str, lua: Path, seconds: float, conns: int = 64) -> float:
    out = subprocess.run(["wrk", "-t1", f"-c{conns}", f"-d{seconds:g}s", "-s", str(lua), url],
                         capture_output=True, text=True, check=True).stdout
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if m is None or "Non-2xx" in out:
        raise RuntimeError(f"wrk failed:\n{out}")
    return float(m.group(1))


def separate_processes(seconds: float) -> None:
    if shutil.which("wrk") is None:
        print("--wrk: wrk is not installed (apt-get install wrk); skipped")
        return
    tailguard = str(Path(sys.executable).with_name("tailguard"))
    with tempfile.TemporaryDirectory() as tmp:
        gw_port, eng_port = free_port(), free_port()
        fleet = Path(tmp) / "fleet.yaml"
        fleet.write_text(f"listen: 127.0.0.1:{gw_port}\nnodes:\n"
                         f"  - {{id: e0, url: http://127.0.0.1:{eng_port}, gpu: H100, "
                         f"models: [{MODEL}]}}\n")
        lua = Path(tmp) / "post.lua"
        lua.write_text(WRK_LUA % body(False).decode())
        procs = [subprocess.Popen([tailguard, "emulate", "--fleet", str(fleet), "--speed", "inf"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
                 subprocess.Popen([tailguard, "serve", "--config", str(fleet), "--log-level",
                                   "warning"], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)]
        try:
            wait_for(eng_port)
            wait_for(gw_port)
            time.sleep(1.0)
            path = "/v1/chat/completions"
            direct = wrk_rate(f"http://127.0.0.1:{eng_port}{path}", lua, seconds)
            gateway = wrk_rate(f"http://127.0.0.1:{gw_port}{path}", lua, seconds)
            print(f"wrk, separate processes, 64 connections, non-streaming req/s: direct "
                  f"{direct:.0f}, gateway {gateway:.0f}, ratio {gateway / direct:.2f}")
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(timeout=10)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--wrk", action="store_true", help="also measure with wrk, separate processes")
    args = ap.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main(args.requests, args.seconds))
    if args.wrk:
        separate_processes(args.seconds)
