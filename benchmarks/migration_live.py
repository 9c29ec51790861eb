"""Mid-stream migration, live: a node frozen (SIGSTOP) or killed under streaming load.

Four emulated A100 engines (Llama-3.1-8B timings), each a ``tailguard emulate``
process of its own, behind ``tailguard serve``; closed-loop clients stream
long chat answers (``--tokens``). After a warm-up one node, the busiest, is
frozen for ``--freeze-s`` seconds (SIGSTOP, then SIGCONT) or killed (SIGKILL).
Each case runs twice, fresh, with migration on and off, and prints for the
streams that were running or started during the fault window: how many ended
in an error (an SSE error event or a broken stream), and the longest gap
between two chunks that each client saw (p50, p99, max). Nothing is asserted.

    python benchmarks/migration_live.py [--cases freeze,kill] [--workers 12]
                                        [--tokens 300] [--freeze-s 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import yaml

from tailguard.config.fleet import load_fleet
from tailguard.gateway.app import RunningGateway, run_gateway

SRC = str(Path(__file__).resolve().parents[1] / "src")
MSG = [{"role": "user", "content": "tell me a long story about a lighthouse keeper"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Clients:
    """Closed-loop streaming clients; per stream: start, end, longest gap, error."""

    def __init__(self, url: str, workers: int, tokens: int) -> None:
        self.url = url
        self.workers = workers
        self.tokens = tokens
        self.streams: list[tuple[float, float, float, bool]] = []
        self._stop = asyncio.Event()

    async def run(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            await asyncio.gather(*(self._worker(s) for _ in range(self.workers)))

    def stop(self) -> None:
        self._stop.set()

    async def _worker(self, s: aiohttp.ClientSession) -> None:
        body = {"model": "m", "messages": MSG, "max_tokens": self.tokens, "stream": True}
        while not self._stop.is_set():
            t0 = time.monotonic()
            last: float | None = None  # gaps between chunks, not the wait for the first
            gap = 0.0
            raw = b""
            error = False
            try:
                async with s.post(self.url + "/v1/chat/completions", json=body) as r:
                    if r.status != 200:
                        error = True
                    async for chunk in r.content.iter_any():
                        now = time.monotonic()
                        if last is not None:
                            gap = max(gap, now - last)
                        last = now
                        raw = (raw + chunk)[-4096:]
            except aiohttp.ClientError:
                error = True
            if b'data: {"error"' in raw or not raw.endswith(b"data: [DONE]\n\n"):
                error = True
            self.streams.append((t0, time.monotonic(), gap, error))


def fleet_file(tmp: Path, ports: list[int], migration: bool) -> Path:
    doc: dict[str, Any] = {
        "listen": "127.0.0.1:0",
        "nodes": [{"id": f"n{i}", "url": f"http://127.0.0.1:{p}", "gpu": "A100",
                   "models": ["m"]} for i, p in enumerate(ports)],
        "pools": {"m": {"policy": "tailguard",
                        "timeouts": {"connect_s": 0.5, "first_byte_s": 2.0, "idle_s": 30.0,
                                     "total_s": 90.0},
                        "migration": {"enabled": migration}}},
        "scrape": {"interval_s": 0.2, "stale_s": 1.0},
        "health": {"interval_s": 0.5, "failures": 2},
    }
    path = tmp / "fleet.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def start_engines(tmp: Path, ports: list[int]) -> list[subprocess.Popen[bytes]]:
    procs = []
    env = {**os.environ, "PYTHONPATH": SRC}
    for i, p in enumerate(ports):
        path = tmp / f"n{i}.yaml"
        path.write_text(yaml.safe_dump({"nodes": [{"id": f"n{i}", "url": f"http://127.0.0.1:{p}",
                                                   "gpu": "A100", "models": ["m"]}]}))
        procs.append(subprocess.Popen([sys.executable, "-m", "tailguard", "emulate", "--fleet",
                                       str(path)], env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
    return procs


async def listening(port: int) -> None:
    for _ in range(200):
        try:
            _, w = await asyncio.open_connection("127.0.0.1", port)
            w.close()
            return
        except OSError:
            await asyncio.sleep(0.1)
    raise RuntimeError(f"nothing listens on {port}")


async def one(case: str, migration: bool, args: argparse.Namespace) -> dict[str, Any]:
    ports = [free_port() for _ in range(args.nodes)]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        procs = start_engines(tmp, ports)
        try:
            for p in ports:
                await listening(p)
            async with run_gateway(load_fleet(fleet_file(tmp, ports, migration))) as gw:
                return await _drive(gw, procs, case, args, migration)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGCONT)
                    proc.kill()
                proc.wait(timeout=10)


async def _drive(gw: RunningGateway, procs: list[subprocess.Popen[bytes]], case: str,
                 args: argparse.Namespace, migration: bool) -> dict[str, Any]:
    clients = Clients(gw.url, args.workers, args.tokens)
    task = asyncio.create_task(clients.run())
    await asyncio.sleep(args.warmup_s)
    nodes = gw.fleet.balancer.nodes
    victim = max(sorted(nodes), key=lambda n: nodes[n].decoding)  # streams under way
    on_victim = nodes[victim].decoding
    proc = procs[int(victim[1:])]
    t_fault = time.monotonic()
    if case == "freeze":
        proc.send_signal(signal.SIGSTOP)
        await asyncio.sleep(args.freeze_s)
        proc.send_signal(signal.SIGCONT)
    else:
        proc.kill()
        await asyncio.sleep(args.freeze_s)
    t_end = time.monotonic()
    await asyncio.sleep(args.after_s)
    clients.stop()
    await task
    hit = [s for s in clients.streams if s[1] >= t_fault and s[0] <= t_end]
    gaps = np.array([s[2] for s in hit if not s[3]]) if hit else np.zeros(1)
    reg = gw.metrics.registry
    moved = sum(v for m in reg.collect() if m.name == "tailguard_migrations"
                for smp in m.samples if smp.name.endswith("_total") for v in [smp.value])
    return {"case": case, "migration": migration, "victim": victim, "streams_on_victim": on_victim,
            "streams_in_window": len(hit), "errors": sum(1 for s in hit if s[3]),
            "gap_p50_s": round(float(np.percentile(gaps, 50)), 3),
            "gap_p99_s": round(float(np.percentile(gaps, 99)), 3),
            "gap_max_s": round(float(gaps.max()), 3), "migrations": moved,
            "streams_total": len(clients.streams)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cases", default="freeze,kill")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--freeze-s", type=float, default=10.0)
    ap.add_argument("--warmup-s", type=float, default=6.0)
    ap.add_argument("--after-s", type=float, default=8.0)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for case in args.cases.split(","):
        for migration in (True, False):
            row = asyncio.run(one(case, migration, args))
            rows.append(row)
            print(f"{case:6s} migration {'on ' if migration else 'off'}: "
                  f"{row['streams_in_window']} streams in the fault window "
                  f"({row['streams_on_victim']} on {row['victim']} when it hit), "
                  f"{row['errors']} errors; longest gap per stream p50 {row['gap_p50_s']:.3f} s, "
                  f"p99 {row['gap_p99_s']:.3f} s, max {row['gap_max_s']:.3f} s; "
                  f"{row['migrations']:g} migrations", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
