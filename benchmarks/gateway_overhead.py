"""What the gateway adds to a request: direct to an engine vs through the gateway, one run.

A zero-delay emulated engine (``speed=inf``: answers at once) isolates the
gateway's own cost. Measures, side by side in the same process and run:

* added p50/p99 latency at concurrency 1, non-streaming and streaming;
* the highest non-streaming request rate at 64 connections (closed loop);
* with ``--wrk`` (and Debian's ``wrk`` installed), the same rate with the
  engine and the gateway in their own processes (``tailguard emulate``,
  ``tailguard serve``) and the load from ``wrk``, so that the client's cost
  does not count against the gateway; in rounds, with the gateway's CPU time
  per request, and with ``--baseline-src DIR`` a second gateway from another
  source tree alternating with this one (how an optimisation is measured on a
  shared machine).

Goal (issue 3): added p50 <= 1 ms at concurrency 1, >= 4,000 req/s through
the gateway. Prints what it measured; asserts nothing. Load generator,
gateway and engine share this machine's cores, so the absolute numbers are
pessimistic; compare the two columns.

    python benchmarks/gateway_overhead.py [--requests 2000] [--seconds 5]
        [--wrk [--wrk-rounds 3] [--baseline-src /tmp/old/src] [--wrk-stream]]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
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

from tailguard.config.fleet import parse_fleet
from tailguard.emulator import EmulatedNode, run_emulator
from tailguard.gateway.app import run_gateway

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
                             "pools": {MODEL: {"policy": "tailguard"}}})
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


def wrk_run(url: str, lua: Path, seconds: float, conns: int = 64) -> tuple[float, int]:
    """Requests per second and requests completed by ``wrk`` against ``url``."""
    out = subprocess.run(["wrk", "-t1", f"-c{conns}", f"-d{seconds:g}s", "--timeout", "30s",
                          "-s", str(lua), url],
                         capture_output=True, text=True, check=True).stdout
    rate = re.search(r"Requests/sec:\s+([\d.]+)", out)
    done = re.search(r"(\d+) requests in", out)
    if rate is None or done is None or "Non-2xx" in out:
        raise RuntimeError(f"wrk failed:\n{out}")
    return float(rate.group(1)), int(done.group(1))


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


STREAM_TOKENS = 200


def separate_processes(seconds: float, rounds: int = 3, baseline: str | None = None,
                       stream: bool = False) -> None:
    """wrk against the engine and the gateway(s), in their own processes, in rounds.

    Each round runs wrk against the engine directly, then against the
    gateway (and against a second gateway run from the ``baseline`` source
    tree, e.g. ``git archive <commit> src | tar -x -C /tmp/old``), one after
    the other, so a busy moment on the shared machine hits all of them in
    turn. Besides the rate it prints each gateway's CPU time per request.

    ``stream``: instead, 256 streams of 200 tokens each through 4 emulated
    H100s running in real time (tokens arrive one by one, as from an engine),
    and the gateway's CPU time per streamed token (completed streams only, so
    slightly high); there is no direct column (the load is spread over nodes).
    """
    if shutil.which("wrk") is None:
        print("--wrk: wrk is not installed (apt-get install wrk); skipped")
        return
    with tempfile.TemporaryDirectory() as tmp:
        n_nodes = 4 if stream else 1
        eng_ports = [free_port() for _ in range(n_nodes)]
        lua = Path(tmp) / "post.lua"
        req = body(False) if not stream else json.dumps({
            "model": MODEL, "max_tokens": STREAM_TOKENS, "stream": True,
            "messages": [{"role": "user", "content": "hello there"}]}).encode()
        lua.write_text(WRK_LUA % req.decode())
        conns = 256 if stream else 64
        trees = {"gateway": str(Path(__file__).resolve().parents[1] / "src")}
        if baseline:
            trees["baseline"] = str(Path(baseline).resolve())
        procs: list[subprocess.Popen[bytes]] = []
        gateways: dict[str, tuple[int, subprocess.Popen[bytes]]] = {}

        def spawn(src: str, *args: str) -> subprocess.Popen[bytes]:
            env = {**os.environ, "PYTHONPATH": src}
            p = subprocess.Popen([sys.executable, "-m", "tailguard.cli", *args], env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs.append(p)
            return p

        try:
            for name, src in trees.items():
                port = free_port()
                fleet = Path(tmp) / f"{name}.yaml"
                fleet.write_text(f"listen: 127.0.0.1:{port}\nnodes:\n" + "".join(
                    f"  - {{id: e{i}, url: http://127.0.0.1:{p}, gpu: H100, models: [{MODEL}]}}\n"
                    for i, p in enumerate(eng_ports)))
                if not procs:  # one set of engines for all, from this tree
                    spawn(trees["gateway"], "emulate", "--fleet", str(fleet),
                          "--speed", "1" if stream else "inf")
                gateways[name] = (port, spawn(src, "serve", "--config", str(fleet),
                                              "--log-level", "warning"))
            for p in eng_ports:
                wait_for(p)
            for port, _ in gateways.values():
                wait_for(port)
            time.sleep(1.0)
            path = "/v1/chat/completions"
            if stream:
                print(f"wrk, separate processes, {conns} streams of {STREAM_TOKENS} tokens, "
                      f"4 emulated H100 in real time, {seconds:g} s per target and round:")
            else:
                print(f"wrk, separate processes, {conns} connections, non-streaming, {seconds:g} s "
                      "per target and round (gateway CPU per request in brackets):")
            for r in range(rounds):
                line = f"  round {r + 1}:"
                direct = 0.0
                if not stream:
                    direct, _ = wrk_run(f"http://127.0.0.1:{eng_ports[0]}{path}", lua, seconds)
                    line += f" direct {direct:,.0f} req/s"
                for name, (port, proc) in gateways.items():
                    c0 = cpu_s(proc.pid)
                    rate, n = wrk_run(f"http://127.0.0.1:{port}{path}", lua, seconds, conns)
                    used = cpu_s(proc.pid) - c0
                    if stream:
                        tokens = n * STREAM_TOKENS
                        line += (f" | {name} {tokens / seconds:,.0f} tokens/s "
                                 f"({used / tokens * 1e6:.1f} us CPU per token)")
                    else:
                        line += (f" | {name} {rate:,.0f} req/s ({used / n * 1e6:.0f} us CPU), "
                                 f"ratio {rate / direct:.2f}")
                print(line + f" | load {os.getloadavg()[0]:.2f}", flush=True)
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
    ap.add_argument("--wrk-rounds", type=int, default=3)
    ap.add_argument("--baseline-src", help="with --wrk: also run a gateway from this src tree")
    ap.add_argument("--wrk-stream", action="store_true",
                    help="with --wrk: also streamed tokens/s through real-time engines")
    args = ap.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main(args.requests, args.seconds))
    if args.wrk:
        separate_processes(args.seconds, args.wrk_rounds, args.baseline_src)
        if args.wrk_stream:
            separate_processes(args.seconds * 2, args.wrk_rounds, args.baseline_src, stream=True)
