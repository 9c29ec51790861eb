"""Soak: does `tailguard serve` grow in memory, file descriptors or tasks over a long run?

Starts `tailguard emulate` and `tailguard serve` as separate processes on
127.0.0.1 (a mixed fleet of four emulated engines), then drives a mixed load
for ``--minutes``: Poisson arrivals at ``--rate`` req/s, 90% streamed chat, 5%
of streams closed by the client after a few chunks, and a node fault every
``--fault-every-s`` (throttle, 30% errors, a stall, a crash, a hang, in turn).
Every ``--sample-s`` it samples the gateway's RSS and open file descriptors
(from /proc) and its asyncio tasks (``tailguard_asyncio_tasks``), then fits a
least-squares slope to RSS after the warm-up and prints it as MB per hour and
per 10 req/s (the issue's bound is 1). After the load it waits for idle
timeouts and compares file descriptors and tasks with their values before the
load (the baseline).

``--tracemalloc`` has the gateway write a tracemalloc snapshot at the end of
the warm-up and after the final idle wait (``TAILGUARD_TRACEMALLOC_DIR`` +
SIGUSR1) and prints the 15 biggest growths between them: where to look when
the slope is not flat. Tracing starts at the first snapshot and its own
bookkeeping grows RSS with every traced allocation, so measure the slope in
a run without it.

    python benchmarks/soak.py                  # 30 minutes, 15 req/s
    python benchmarks/soak.py --minutes 5 --rate 10 --json soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import aiohttp
import yaml

MODEL = "llama-3.1-8b"
GPUS = ("H100-SXM", "A100-80G", "L4", "L4")
FAULTS: tuple[dict[str, Any], ...] = (
    {"kind": "throttle", "factor": 0.4, "duration_s": 30},
    {"kind": "errors", "rate": 0.3, "duration_s": 20},
    {"kind": "stall", "seconds": 3},
    {"kind": "crash", "duration_s": 15},
    {"kind": "hang", "duration_s": 10},
)
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven",
         "wizards", "quietly", "hex")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def proc_sample(pid: int) -> tuple[int, int]:
    """(RSS in KiB, open file descriptors) of ``pid``."""
    rss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1])
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def slope_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) points, per minute."""
    n = len(points)
    if n < 2:
        return 0.0
    mx = sum(t for t, _ in points) / n
    my = sum(v for _, v in points) / n
    sxx = sum((t - mx) ** 2 for t, _ in points)
    sxy = sum((t - mx) * (v - my) for t, v in points)
    return sxy / sxx * 60.0 if sxx > 0 else 0.0


class Load:
    """The client side: counts what came back."""

    def __init__(self, url: str, rate: float, seed: int) -> None:
        self.url = url
        self.rate = rate
        self.rng = random.Random(seed)
        self.sent = 0
        self.ok = 0
        self.closed_early = 0
        self.errors_before_first_byte = 0
        self.errors_mid_stream = 0
        self.status: dict[int, int] = {}
        self.tasks: set[asyncio.Task[None]] = set()

    async def run(self, until: float) -> None:
        conn = aiohttp.TCPConnector(limit=256)
        async with aiohttp.ClientSession(connector=conn,
                                         timeout=aiohttp.ClientTimeout(total=120)) as s:
            loop = asyncio.get_running_loop()
            while loop.time() < until:
                await asyncio.sleep(self.rng.expovariate(self.rate))
                t = asyncio.ensure_future(self.one(s))
                self.tasks.add(t)
                t.add_done_callback(self.tasks.discard)
            await asyncio.gather(*self.tasks, return_exceptions=True)

    async def one(self, s: aiohttp.ClientSession) -> None:
        rng = self.rng
        self.sent += 1
        stream = rng.random() < 0.9
        close_early = stream and rng.random() < 0.05 / 0.9
        words = " ".join(rng.choice(WORDS) for _ in range(int(rng.lognormvariate(4.0, 0.8))))
        body = {"model": MODEL, "messages": [{"role": "user", "content": words}],
                "max_tokens": max(2, int(rng.lognormvariate(3.8, 0.7))), "stream": stream}
        try:
            async with s.post(self.url + "/v1/chat/completions", json=body) as r:
                self.status[r.status] = self.status.get(r.status, 0) + 1
                if r.status != 200:
                    self.errors_before_first_byte += 1
                    await r.read()
                    return
                if not stream:
                    await r.read()
                    self.ok += 1
                    return
                chunks = 0
                async for chunk in r.content.iter_any():
                    chunks += 1
                    if b'"error"' in chunk:
                        self.errors_mid_stream += 1
                        return
                    if close_early and chunks >= 3:
                        self.closed_early += 1
                        return  # leaving the block closes the connection mid-stream
                self.ok += 1
        except (TimeoutError, aiohttp.ClientError):
            self.errors_before_first_byte += 1


async def metric(session: aiohttp.ClientSession, url: str, name: str) -> float:
    """The sum of the series ``name`` over its labels."""
    total = 0.0
    async with session.get(url + "/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
    return total


async def soak(args: argparse.Namespace, gw_pid: int, url: str, node_urls: list[str],
               snap_dir: Path | None, gw: subprocess.Popen[bytes]) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    samples: list[dict[str, float]] = []
    async with aiohttp.ClientSession() as s:
        async def sample(phase: str, t0: float) -> dict[str, float]:
            rss, fds = proc_sample(gw_pid)
            row = {"t_s": round(loop.time() - t0, 1), "rss_kib": rss, "fds": fds,
                   "tasks": await metric(s, url, "tailguard_asyncio_tasks"),
                   "in_flight": await metric(s, url, "tailguard_in_flight_requests"),
                   "phase": phase}
            print(json.dumps(row), flush=True)
            return row  # type: ignore[return-value]

        t0 = loop.time()
        await asyncio.sleep(2.0)
        baseline = await sample("baseline", t0)
        load = Load(url, args.rate, args.seed)
        end = loop.time() + args.minutes * 60.0
        runner = asyncio.ensure_future(load.run(end))
        warm_end = loop.time() + args.warmup_min * 60.0
        next_fault = loop.time() + args.fault_every_s
        fault_i = 0
        warm_snapped = False
        while not runner.done():
            await asyncio.sleep(min(args.sample_s, max(0.1, end - loop.time())))
            now = loop.time()
            if now >= next_fault and now < end:
                f = FAULTS[fault_i % len(FAULTS)]
                target = node_urls[fault_i % len(node_urls)]
                try:
                    async with s.post(target + "/admin/faults", json=f) as r:
                        await r.read()
                except aiohttp.ClientError as exc:  # still down from an earlier crash
                    print(f"# fault not set on {target}: {exc}", flush=True)
                print(f"# fault {f} on {target}", flush=True)
                fault_i += 1
                next_fault = now + args.fault_every_s
            phase = "warmup" if now < warm_end else "load"
            if phase == "load" and snap_dir is not None and not warm_snapped:
                gw.send_signal(signal.SIGUSR1)
                warm_snapped = True
            if now < end:
                samples.append(await sample(phase, t0))
        await runner
        for u in node_urls:  # clear what is left before idling (a crashed node refuses)
            try:
                async with s.delete(u + "/admin/faults") as r:
                    await r.read()
            except aiohttp.ClientError:
                pass
        await asyncio.sleep(args.idle_s)  # idle and keep-alive timeouts close connections
        after = await sample("after", t0)
        if snap_dir is not None:  # after the idle wait: what is still held is what leaked
            gw.send_signal(signal.SIGUSR1)
    load_points = [(r["t_s"], r["rss_kib"]) for r in samples if r["phase"] == "load"]
    kib_per_min = slope_per_min(load_points)
    mb_per_h = kib_per_min * 60.0 / 1024.0
    return {
        "minutes": args.minutes, "rate": args.rate, "sent": load.sent, "ok": load.ok,
        "closed_early": load.closed_early, "status": load.status,
        "errors_before_first_byte": load.errors_before_first_byte,
        "errors_mid_stream": load.errors_mid_stream, "faults": fault_i,
        "rss_slope_kib_per_min": round(kib_per_min, 2),
        "rss_mb_per_hour_per_10_rps": round(mb_per_h * 10.0 / args.rate, 3),
        "baseline": baseline, "after": after, "samples": samples,
    }


def snapshot_diff(folder: Path, top: int = 15) -> list[str]:
    snaps = sorted(folder.glob("snapshot-*.pickle"))
    if len(snaps) < 2:
        return ["(fewer than two snapshots)"]
    first = tracemalloc.Snapshot.load(str(snaps[0]))
    last = tracemalloc.Snapshot.load(str(snaps[-1]))
    stats = last.compare_to(first, "traceback")
    lines = []
    for st in stats[:top]:
        frame = st.traceback[-1] if st.traceback else None
        where = f"{frame.filename}:{frame.lineno}" if frame else "?"
        lines.append(f"{st.size_diff / 1024:+9.1f} KiB {st.count_diff:+7d} blocks  {where}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--rate", type=float, default=15.0, help="requests per second")
    ap.add_argument("--sample-s", type=float, default=30.0)
    ap.add_argument("--warmup-min", type=float, default=None,
                    help="minutes not fitted (default: a sixth of the run, at least 1)")
    ap.add_argument("--fault-every-s", type=float, default=180.0)
    ap.add_argument("--idle-s", type=float, default=25.0,
                    help="wait after the load before the final sample")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tracemalloc", action="store_true")
    ap.add_argument("--no-gc-tuning", action="store_true",
                    help="run the gateway with CPython's default collector thresholds")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args()
    if args.warmup_min is None:
        args.warmup_min = max(1.0, args.minutes / 6.0)
    with tempfile.TemporaryDirectory() as tmp:
        ports = [free_port() for _ in GPUS]
        gw_port = free_port()
        node_urls = [f"http://127.0.0.1:{p}" for p in ports]
        fleet = {
            "listen": f"127.0.0.1:{gw_port}",
            "nodes": [{"id": f"n{i}-{g.split('-')[0].lower()}", "url": u, "gpu": g,
                       "models": [MODEL]} for i, (g, u) in enumerate(zip(GPUS, node_urls, strict=True))],
            "pools": {MODEL: {"policy": "tailguard", "slo": {"ttft_s": 2.0, "tpot_s": 0.1}}},
            "outliers": {"enabled": True},
        }
        path = Path(tmp) / "fleet.yaml"
        path.write_text(yaml.safe_dump(fleet))
        snap_dir = Path(tmp) / "snapshots" if args.tracemalloc else None
        env = dict(os.environ)
        if snap_dir is not None:
            env["TAILGUARD_TRACEMALLOC_DIR"] = str(snap_dir)
        if args.no_gc_tuning:
            env["TAILGUARD_GC_TUNING"] = "0"
        tg = [sys.executable, "-m", "tailguard"]
        emu = subprocess.Popen([*tg, "emulate", "--fleet", str(path)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        gw_log = (Path(tmp) / "gateway.log").open("wb")
        gw = subprocess.Popen([*tg, "serve", "--config", str(path), "--log-level", "warning"],
                              env=env, stdout=subprocess.DEVNULL, stderr=gw_log)
        result: dict[str, Any] = {}
        try:
            url = f"http://127.0.0.1:{gw_port}"
            deadline = time.monotonic() + 30.0
            while True:
                try:
                    with socket.create_connection(("127.0.0.1", gw_port), timeout=0.5):
                        break
                except OSError:
                    if time.monotonic() > deadline or gw.poll() is not None:
                        raise SystemExit("the gateway did not start") from None
                    time.sleep(0.2)
            result = asyncio.run(soak(args, gw.pid, url, node_urls, snap_dir, gw))
            if snap_dir is not None:
                time.sleep(2.0)
                result["tracemalloc_top"] = snapshot_diff(snap_dir)
        finally:
            for p in (gw, emu):
                p.send_signal(signal.SIGTERM)
            for p in (gw, emu):
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
            gw_log.close()
            levels = [line.split(" ", 2)[1] for line in
                      (Path(tmp) / "gateway.log").read_text().splitlines() if " " in line]
            result["log_lines"] = {lv: levels.count(lv) for lv in set(levels)
                                   if lv in ("WARNING", "ERROR", "CRITICAL")}
    b, a = result["baseline"], result["after"]
    print(f"\n{result['sent']} requests in {args.minutes:g} min at {args.rate:g} req/s: "
          f"{result['ok']} ok, {result['closed_early']} closed early by the client, "
          f"{result['errors_before_first_byte']} errors before the first byte, "
          f"{result['errors_mid_stream']} mid-stream, {result['faults']} faults; "
          f"status {result['status']}")
    print(f"RSS slope after warm-up: {result['rss_slope_kib_per_min']:+.1f} KiB/min = "
          f"{result['rss_mb_per_hour_per_10_rps']:+.3f} MB/h per 10 req/s (bound 1)")
    print(f"fds {b['fds']} -> {a['fds']}, tasks {b['tasks']:g} -> {a['tasks']:g}, "
          f"RSS {b['rss_kib'] / 1024:.1f} -> {a['rss_kib'] / 1024:.1f} MiB, "
          f"in flight after {a['in_flight']:g}; gateway log lines {result['log_lines']}")
    for line in result.get("tracemalloc_top", []):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
