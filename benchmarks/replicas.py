"""Several gateway replicas, with and without shared state (Redis), against one gateway.

One emulated mixed fleet (the engine model in real time, in this process with
the load generators) and one seeded open-loop load (``--load`` x the fleet's
SLO capacity bound), through, one after the other on fresh engines:

* **one**: one ``tailguard serve``;
* **two-alone**: two replicas that know nothing of each other;
* **two-shared**, **three-shared**: two and three replicas sharing state
  through a real ``redis-server`` (``shared_state:`` in the fleet file).

One seeded Poisson stream of requests is dealt round robin over the
replicas, as a Kubernetes Service would spread them (``tailguard bench
--target URL1,URL2``), so every variant gets the very same requests. Part-way through
(``--fault-at``, 0.3 of the run), one of the A100s is throttled to
``--factor`` (0.3) of its speed: the detection time is from then until a
replica's ``/admin/nodes`` shows it degraded or quarantined (first replica and
last replica). Each run reports SLO attainment, TTFT/TPOT p99, failures, each
GPU class's share of the requests, and the gateways' CPU time per request
(read from ``/proc``).

Then the faults, with two shared replicas:

* **kill-replica**: replica b is killed (SIGKILL) at half-time. Its clients'
  requests that were in flight fail (a Service then sends new ones to a
  live replica: the benchmark sends b's turn to a); the survivor's
  view of b's load (``in_flight_elsewhere``) must drop to 0 within ``ttl_s``.
* **kill-redis**: Redis is killed at 0.4 of the run and restarted at 0.6:
  zero failed requests, both replicas alive at the end and synced again.

Prints what it measured; asserts nothing.

    python benchmarks/replicas.py [--load 0.8] [--duration 40] [--pin]
        [--fleet H100-SXM:2,A100-80GB:3,L4:4] [--rounds 3] [--period 0.25]
        [--runs one,two-alone,two-shared,three-shared,kill-replica,kill-redis]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import yaml
from gateway_overhead import cpu_s, free_port

from epp import parse_fleet_arg, wait_http  # this folder's: run as a script
from tailguard.bench import BenchConfig, LoadGenerator
from tailguard.bench.loadgen import Record, summarize
from tailguard.core.policies import Slo
from tailguard.emulator import EmulatedNode, run_emulator
from tailguard.sim.fleet_bound import capacity_bound
from tailguard.traffic.workload import parse_length_dist

MODEL = "llama-3.1-8b"
INPUT = {"dist": "lognormal", "mu": 6.0, "sigma": 0.7, "max": 4096}
OUTPUT = {"dist": "uniform", "min": 16, "max": 128}
SLO = Slo(ttft_s=1.0, tpot_s=0.08)
TOKEN = "replicas-bench"
TTL_S = 2.0


GATEWAY_CPUS: set[int] = set()  # --pin: the gateways (and Redis) here, the rest elsewhere


def _pin(cpus: set[int]) -> Any:
    if not cpus:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


class Redis:
    def __init__(self, work: Path) -> None:
        self.port = free_port()
        self.work = work
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            sys.exit("redis-server is not installed (apt-get install redis-server)")
        self.proc = subprocess.Popen([binary, "--port", str(self.port), "--bind", "127.0.0.1",
                                      "--save", "", "--appendonly", "no"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     preexec_fn=_pin(GATEWAY_CPUS))
        time.sleep(0.3)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class Replicas:
    """``k`` tailguard serve processes over the same fleet; shared through ``redis`` if given."""

    def __init__(self, k: int, nodes: list[EmulatedNode], urls: dict[str, str], work: Path,
                 redis: Redis | None, period: float = 0.25) -> None:
        self.names = [chr(ord("a") + i) for i in range(k)]
        self.ports = [free_port() for _ in range(k)]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.work = work
        self.docs = []
        for name, port in zip(self.names, self.ports, strict=True):
            doc: dict[str, Any] = {
                "listen": f"127.0.0.1:{port}",
                "nodes": [{"id": n.id, "url": urls[n.id], "gpu": n.gpu, "models": [MODEL]}
                          for n in nodes],
                "pools": {MODEL: {"slo": {"ttft_s": SLO.ttft_s, "tpot_s": SLO.tpot_s},
                                  "limits": {"kind": "gradient"},
                                  "admission": {"queue_max": 256}}},
                "admin": {"token_env": "TG_BENCH_TOKEN"}}
            if redis is not None:
                doc["shared_state"] = {"url": redis.url, "replica": name, "period_s": period,
                                       "ttl_s": TTL_S}
            self.docs.append(doc)

    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    async def start(self) -> None:
        env = {**os.environ, "TG_BENCH_TOKEN": TOKEN}
        for name, doc in zip(self.names, self.docs, strict=True):
            path = self.work / f"fleet-{name}.yaml"
            path.write_text(yaml.safe_dump(doc))
            log = open(self.work / f"{name}.log", "wb")  # noqa: SIM115 - lives with the process
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "tailguard", "serve", "-c", str(path), "--log-level",
                 "warning"], stdout=log, stderr=subprocess.STDOUT, env=env,
                preexec_fn=_pin(GATEWAY_CPUS)))
        for url in self.urls():
            await wait_http(url + "/health")

    def cpu(self) -> float:
        return sum(cpu_s(p.pid) for p in self.procs if p.poll() is None)

    def alive(self) -> list[bool]:
        return [p.poll() is None for p in self.procs]

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()


async def nodes_view(session: aiohttp.ClientSession, url: str) -> dict[str, Any] | None:
    try:
        async with session.get(url + "/admin/nodes",
                               headers={"Authorization": f"Bearer {TOKEN}"},
                               timeout=aiohttp.ClientTimeout(total=2)) as r:
            body: dict[str, Any] = await r.json()
            return body
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


async def watch_detection(urls: list[str], victim: str, since: float,
                          stop: asyncio.Event) -> dict[str, float]:
    """Seconds from ``since`` until each replica shows ``victim`` degraded or quarantined."""
    found: dict[str, float] = {}
    async with aiohttp.ClientSession() as s:
        while not stop.is_set() and len(found) < len(urls):
            if time.monotonic() >= since:
                for url in urls:
                    if url in found:
                        continue
                    view = await nodes_view(s, url)
                    for n in (view or {}).get("nodes", []):
                        if n["id"] == victim and n["state"] in ("degraded", "quarantined"):
                            found[url] = time.monotonic() - since
            await asyncio.sleep(0.1)
    return found


async def set_fault(url: str, fault: dict[str, Any]) -> None:
    async with aiohttp.ClientSession() as s, s.post(url + "/admin/faults", json=fault) as r:
        r.raise_for_status()


def result(records: list[Record], gen_cfg: BenchConfig, elapsed: float, warmup: float,
           duration: float, gpu_of: dict[str, str]) -> dict[str, Any]:
    steady = [r for r in records if r.arrival >= warmup]
    res = summarize(steady, replace(gen_cfg, duration_s=duration - warmup), elapsed)
    by_class: dict[str, int] = {}
    for r in records:
        if r.error == "ok":
            g = gpu_of.get(r.node, "?")
            by_class[g] = by_class.get(g, 0) + 1
    total = sum(by_class.values()) or 1
    return {"attainment": res["slo_attainment"], "ttft_p99": res["ttft_s"]["p99"],
            "tpot_p99": res["tpot_s"]["p99"], "completed": res["completed"],
            "failed": sum(1 for r in records if r.error not in ("ok", "http_429")),
            "errors": dict(Counter(r.error for r in records if r.error != "ok")),
            "rejected": sum(1 for r in records if r.error == "http_429"),
            "shares": {g: round(c / total, 3) for g, c in sorted(by_class.items())}}


async def run(name: str, k: int, shared: bool, nodes: list[EmulatedNode], rate: float,
              args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"tailguard-replicas-{name}-"))
    duration, warmup = args.duration, args.duration / 5
    victim = next(n.id for n in nodes if n.gpu.startswith("A100"))
    gpu_of = {n.id: n.gpu for n in nodes}
    redis = Redis(work) if shared else None
    if redis is not None:
        redis.start()
    async with run_emulator(nodes, host="127.0.0.1") as emu:
        reps = Replicas(k, nodes, emu.urls, work, redis, args.period)
        out: dict[str, Any] = {}
        try:
            await reps.start()
            if shared:
                await asyncio.sleep(3 * args.period)  # the replicas meet
            urls = reps.urls()
            gen = LoadGenerator(BenchConfig(
                ",".join(urls), model=MODEL, rate=rate, duration_s=duration,
                input_tokens=parse_length_dist(INPUT, "input_tokens", "input_tokens"),
                output_tokens=parse_length_dist(OUTPUT, "output_tokens", "output_tokens"),
                slo=SLO, ignore_eos=True, drain_s=30.0, seed=7, label=name))
            t0 = time.monotonic()
            stop = asyncio.Event()
            fault_at = t0 + args.fault_at * duration
            detect = asyncio.create_task(watch_detection(urls, victim, fault_at, stop))
            cpu0 = reps.cpu()

            async def inject() -> None:
                await asyncio.sleep(args.fault_at * duration)
                await set_fault(emu.urls[victim], {"kind": "throttle", "factor": args.factor,
                                                   "duration_s": duration})

            async def chaos() -> None:
                if name == "kill-replica":
                    await asyncio.sleep(duration / 2)
                    killed_at = time.monotonic()
                    reps.procs[1].send_signal(signal.SIGKILL)
                    out["killed_at_s"] = killed_at - t0
                    gen.urls[1] = gen.urls[0]  # the Service sends b's share to a;
                    # requests already sent to b are lost with it
                    async with aiohttp.ClientSession() as s:
                        while True:
                            view = await nodes_view(s, urls[0])
                            if view is not None and sum(n["in_flight_elsewhere"]
                                                        for n in view["nodes"]) == 0:
                                out["view_corrected_s"] = round(time.monotonic() - killed_at, 2)
                                return
                            if time.monotonic() - killed_at > 5 * TTL_S:
                                out["view_corrected_s"] = None
                                return
                            await asyncio.sleep(0.05)
                elif name == "kill-redis" and redis is not None:
                    await asyncio.sleep(0.4 * duration)
                    redis.kill()
                    await asyncio.sleep(0.2 * duration)
                    redis.start()

            side = [asyncio.create_task(inject()), asyncio.create_task(chaos())]
            await gen.run()
            elapsed = time.monotonic() - t0
            cpu = reps.cpu() - cpu0
            stop.set()
            found = await detect
            await asyncio.gather(*side)
            records = gen.records
            res = result(records, gen.cfg, elapsed, warmup, duration, gpu_of)
            res.update(out)
            res["detect_first_s"] = round(min(found.values()), 2) if found else None
            res["detect_last_s"] = (round(max(found.values()), 2) if len(found) == k else None)
            res["cpu_ms_per_request"] = round(cpu * 1000 / max(len(records), 1), 3)
            res["alive"] = reps.alive()
            if name == "kill-replica":
                killed = out.get("killed_at_s", duration)
                # b's requests sent before the kill that failed were b's in flight;
                # any other failure would be a's
                res["failed_in_flight_on_b"] = sum(
                    1 for r in records if r.target == 1 and r.arrival <= killed
                    and r.error not in ("ok", "http_429"))
                res["failed_elsewhere"] = res["failed"] - res["failed_in_flight_on_b"]
            if shared:
                async with aiohttp.ClientSession() as s:
                    views = [await nodes_view(s, u) for u, ok in zip(urls, res["alive"],
                                                                      strict=True) if ok]
                res["synced_at_end"] = [v["shared_state"]["up"] if v else None for v in views]
        finally:
            reps.stop()
            if redis is not None:
                redis.kill()
    return res


RUNS = {"one": (1, False), "two-alone": (2, False), "two-shared": (2, True),
        "three-shared": (3, True), "kill-replica": (2, True), "kill-redis": (2, True)}


async def main_async(args: argparse.Namespace) -> None:
    fleet = parse_fleet_arg(args.fleet)
    nodes = [EmulatedNode(f"{g.split('-')[0].lower()}-{i}", g, models=(MODEL,))
             for g, c in fleet for i in range(c)]
    bound = capacity_bound(MODEL, SLO, fleet, INPUT, OUTPUT)
    rate = args.load * bound
    print(f"fleet {fleet}, capacity bound {bound:.1f} req/s, offering {rate:.1f} req/s "
          f"({args.load:.2f}) for {args.duration:.0f} s, statistics after "
          f"{args.duration / 5:.0f} s; an A100 throttled to {args.factor} at "
          f"{args.fault_at * args.duration:.0f} s", flush=True)
    rounds: list[dict[str, dict[str, Any]]] = []
    for i in range(args.rounds):
        results: dict[str, dict[str, Any]] = {}
        for name in filter(None, args.runs.split(",")):
            k, shared = RUNS[name]
            r = await run(name, k, shared, nodes, rate, args)
            results[name] = r
            extra = {key: r[key] for key in ("killed_at_s", "view_corrected_s",
                                              "failed_in_flight_on_b", "failed_elsewhere",
                                              "synced_at_end") if key in r}
            print(f"{f'[{i + 1}] ' if args.rounds > 1 else ''}{name:12s} attainment "
                  f"{r['attainment']:.4f}  TTFT p99 {r['ttft_p99']:.3f} s  TPOT p99 "
                  f"{r['tpot_p99'] * 1000:.1f} ms  completed {r['completed']} failed "
                  f"{r['failed']} 429 {r['rejected']}  detect {r['detect_first_s']}/"
                  f"{r['detect_last_s']} s  CPU {r['cpu_ms_per_request']:.3f} ms/request  "
                  f"shares {r['shares']}  alive {r['alive']}" + (f"  {extra}" if extra else ""),
                  flush=True)
        rounds.append(results)
    if "one" not in rounds[0]:
        return
    for name in rounds[0]:
        if name == "one" or name.startswith("kill"):
            continue
        att = [100 * (r[name]["attainment"] - r["one"]["attainment"]) for r in rounds]
        det = [r[name]["detect_last_s"] / r["one"]["detect_last_s"] for r in rounds
               if r[name]["detect_last_s"] and r["one"]["detect_last_s"]]
        cpu = [r[name]["cpu_ms_per_request"] / max(r["one"]["cpu_ms_per_request"], 1e-9)
               for r in rounds]
        print(f"{name} - one, per round: attainment {[round(a, 2) for a in att]} points "
              f"(median {float(np.median(att)):+.2f}); detection (last replica) "
              f"{[round(d, 2) for d in det]}x"
              + (f" (median {float(np.median(det)):.2f}x)" if det else "")
              + f"; CPU per request {[round(c, 2) for c in cpu]}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--load", type=float, default=0.8)
    ap.add_argument("--duration", type=float, default=40.0)
    ap.add_argument("--fleet", default="H100-SXM:2,A100-80GB:3,L4:4")
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--fault-at", type=float, default=0.3, help="throttle time, share of the run")
    ap.add_argument("--factor", type=float, default=0.3, help="the throttled A100's speed")
    ap.add_argument("--period", type=float, default=0.25, help="shared_state.period_s")
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat the runs; differences to one are per round, with medians")
    ap.add_argument("--pin", action="store_true",
                    help="gateways and Redis on the last CPU, engines and clients on the others: "
                         "one gateway and several then get the same CPU, and the emulated "
                         "engines keep their timing")
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if args.pin and len(cpus) > 1:
        GATEWAY_CPUS.add(cpus[-1])
        os.sched_setaffinity(0, set(cpus[:-1]))
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
