"""How many streamed tokens per second the emulated engines sustain.

The emulator runs in a child process (so its CPU is measured apart from the
load generator's) with ``--nodes`` H100 engines on real time; the parent opens
``--concurrency`` streaming chat requests per node, each for ``--max-tokens``
tokens, keeps them going for ``--duration`` seconds, and counts the token
events that arrive. It prints the tokens per second delivered, what the
engine model itself would allow, and the CPU seconds each process spent per
wall second (a machine with 2 cores has 2.0 to give in total).

    PYTHONPATH=src .venv/bin/python benchmarks/emulator_throughput.py
    PYTHONPATH=src .venv/bin/python benchmarks/emulator_throughput.py --nodes 8 --concurrency 64

Goal (issue 3): at least 5,000 streamed tokens/s in total on a 2-core machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

import aiohttp

MARKER = b'"content":" tok"'


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process from /proc (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def serve(nodes: int, gpu: str, speed: float) -> None:
    from tailguard.emulator import EmulatedNode, run_emulator

    specs = [EmulatedNode(f"{gpu.lower()}-{i}", gpu) for i in range(nodes)]
    async with run_emulator(specs, speed=speed) as emu:
        print(json.dumps(emu.urls), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


async def one_stream(session: aiohttp.ClientSession, url: str, max_tokens: int) -> int:
    body = {"model": "llama-3.1-8b", "messages": [{"role": "user", "content": "hi " * 50}],
            "max_tokens": max_tokens, "stream": True}
    n = 0
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for data in resp.content.iter_any():
            n += data.count(MARKER)
    return n


async def load(urls: list[str], concurrency: int, max_tokens: int, duration: float,
               child: int) -> dict[str, float]:
    counts = {"tokens": 0, "requests": 0}
    deadline = time.perf_counter() + duration

    async def worker(session: aiohttp.ClientSession, url: str) -> None:
        while time.perf_counter() < deadline:
            n = await one_stream(session, url, max_tokens)  # not `+= await`: that reads first
            counts["tokens"] += n
            counts["requests"] += 1

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        # warm up one round so connection setup is not measured
        await asyncio.gather(*(one_stream(session, u, 4) for u in urls))
        t0, c0, p0 = time.perf_counter(), cpu_seconds(child), time.process_time()
        await asyncio.gather(*(worker(session, u) for u in urls for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        c1, p1 = cpu_seconds(child), time.process_time()
    return {"wall_s": wall, "tokens": counts["tokens"], "requests": counts["requests"],
            "tokens_per_s": counts["tokens"] / wall, "emulator_cpu": (c1 - c0) / wall,
            "client_cpu": (p1 - p0) / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--gpu", default="H100")
    ap.add_argument("--concurrency", type=int, default=32, help="streams per node")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--speed", type=float, default=1.0)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        uvloop = None  # type: ignore[assignment]
    run = uvloop.run if uvloop is not None else asyncio.run
    if args.serve:
        run(serve(args.nodes, args.gpu, args.speed))
        return
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--nodes", str(args.nodes), "--gpu", args.gpu,
         "--speed", str(args.speed)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdin is not None
        urls = list(json.loads(child.stdout.readline()).values())
        res = run(load(urls, args.concurrency, args.max_tokens, args.duration, child.pid))
    finally:
        if child.stdin is not None:
            child.stdin.close()
        child.wait(timeout=10)
    from tailguard.core.hardware import perf_model

    pm = perf_model(args.gpu, "llama-3.1-8b")
    model_tps = args.nodes * pm.decode_tokens_per_s(args.concurrency, 300) * args.speed
    print(f"cores: {os.cpu_count()}  nodes: {args.nodes} x {args.gpu}  streams: "
          f"{args.nodes * args.concurrency}  max_tokens: {args.max_tokens}  speed: {args.speed}")
    print(f"requests: {res['requests']}  tokens: {res['tokens']}  wall: {res['wall_s']:.1f} s")
    print(f"streamed tokens/s: {res['tokens_per_s']:.0f}  "
          f"(engine model at this batch, decode only: {model_tps:.0f})")
    print(f"CPU per wall second: emulator {res['emulator_cpu']:.2f}, "
          f"load generator {res['client_cpu']:.2f}")


if __name__ == "__main__":
    main()
