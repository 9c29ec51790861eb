"""Limits and the admission queue in the live gateway, on emulated engines.

Emulated engines (the engine model in real time) for a small mixed fleet, the
gateway in front of them, and three open-loop load generators (priorities
high/normal/low at 20/60/20% of the rate) offering ``--load`` x the fleet's
SLO capacity bound. Runs twice on fresh engines: the ``tailguard`` policy
without limits, then with ``limits: {kind: gradient}`` + ``admission``.
Every engine gets the plan's chunked-prefill budget in both runs. While the
limited run is overloaded it also times 429s (low-priority probes). Prints
goodput, per-GPU-class P99 TPOT of admitted requests, per-priority
attainment, the 429 latency and each node's limit and permits in use every
2 s. Asserts nothing.

As in the simulator's results, statistics count the requests that arrive
after ``--warmup`` (default: a fifth of the run, the simulator benchmark's
share): the fleet starts empty at its planned limits and the limits need a
few dozen samples per node to adapt. The per-priority attainment over the
whole run is printed too. Everything runs in one process, so the event
loop's lag (how late a 5 ms timer fires) is printed with each run: on a
busy machine a stalled loop delays tokens and shows up as TTFT and TPOT
misses that no engine caused.

    python benchmarks/limits_live.py [--load 1.3] [--duration 40] [--warmup 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from dataclasses import replace
from typing import Any

import aiohttp

from tailguard.bench import BenchConfig, LoadGenerator
from tailguard.bench.loadgen import summarize
from tailguard.config.fleet import parse_fleet
from tailguard.core.hardware import DEFAULT_CATALOG
from tailguard.core.policies import Slo
from tailguard.emulator import EmulatedNode, run_emulator
from tailguard.engine import EngineConfig
from tailguard.gateway.app import run_gateway
from tailguard.planner.plan import plan_groups
from tailguard.sim.fleet_bound import capacity_bound
from tailguard.traffic.workload import parse_length_dist

MODEL = "llama-3.1-8b"
FLEET = (("A100-80GB", 1), ("L4", 3))
INPUT = {"dist": "lognormal", "mu": 6.5, "sigma": 0.6, "max": 4096}
OUTPUT = {"dist": "uniform", "min": 16, "max": 96}
SLO = Slo(ttft_s=1.0, tpot_s=0.10)
SHARES = {"high": 0.2, "normal": 0.6, "low": 0.2}


def nodes() -> list[EmulatedNode]:
    model = DEFAULT_CATALOG.model(MODEL)
    plans = plan_groups([(DEFAULT_CATALOG.gpu(g), 1, c) for g, c in FLEET], model, SLO.tpot_s,
                        700.0, 56.0)
    out = []
    for (gpu, count), plan in zip(FLEET, plans, strict=True):
        engine = EngineConfig(max_num_batched_tokens=plan.max_num_batched_tokens)
        out += [EmulatedNode(f"{gpu.split('-')[0].lower()}-{i}", gpu, models=(MODEL,),
                             engine=engine) for i in range(count)]
    return out


async def probe_429(url: str, n: int) -> list[float]:
    """Latency of low-priority requests answered 429 (seconds)."""
    out: list[float] = []
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 500}],
            "max_tokens": 32}
    async with aiohttp.ClientSession() as s:
        for _ in range(n):
            t0 = time.monotonic()
            async with s.post(url + "/v1/chat/completions", json=body,
                              headers={"x-tailguard-priority": "low"}) as r:
                await r.read()
                if r.status == 429:
                    out.append(time.monotonic() - t0)
            await asyncio.sleep(0.05)
    return out


async def loop_lag(samples: list[float]) -> None:
    """How late a 5 ms sleep wakes up, appended to ``samples`` until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        t = loop.time()
        await asyncio.sleep(0.005)
        samples.append(loop.time() - t - 0.005)


async def limit_trace(balancer: Any, out: list[tuple[float, dict[str, tuple[int, int]]]],
                      every: float = 2.0) -> None:
    """Each limited node's (limit, permits in use) every ``every`` seconds until cancelled."""
    t0 = time.monotonic()
    while True:
        out.append((round(time.monotonic() - t0, 1),
                    {n.id: (n.limiter.limit, n.limiter.inflight)
                     for n in balancer.nodes.values() if n.limiter is not None}))
        await asyncio.sleep(every)


async def one_run(limited: bool, rate: float, duration: float, warmup: float,
                  limit_opts: dict[str, Any]) -> dict[str, Any]:
    emulated = nodes()
    lag: list[float] = []
    async with run_emulator(emulated, host="127.0.0.1") as emu:
        pool: dict[str, Any] = {"policy": "tailguard",
                                "slo": {"ttft_s": SLO.ttft_s, "tpot_s": SLO.tpot_s}}
        if limited:
            pool["limits"] = {"kind": "gradient", "input_tokens": 700, "output_tokens": 56,
                              **limit_opts}
            pool["admission"] = {"queue_max": 256}
        fleet = parse_fleet({
            "listen": "127.0.0.1:0",
            "nodes": [{"id": n.id, "url": emu.urls[n.id], "gpu": n.gpu, "models": [MODEL]}
                      for n in emulated],
            "pools": {MODEL: pool},
        })
        async with run_gateway(fleet, host="127.0.0.1", port=0) as gw:
            gens = [LoadGenerator(BenchConfig(
                gw.url, model=MODEL, rate=rate * share, duration_s=duration,
                input_tokens=parse_length_dist(INPUT, "input_tokens", "input_tokens"),
                output_tokens=parse_length_dist(OUTPUT, "output_tokens", "output_tokens"),
                slo=SLO, ignore_eos=True, drain_s=20.0, seed=i, label=name,
                headers={"x-tailguard-priority": name}))
                for i, (name, share) in enumerate(SHARES.items())]

            async def late_probe() -> list[float]:
                await asyncio.sleep(duration / 2)
                return await probe_429(gw.url, 20) if limited else []

            monitor = asyncio.ensure_future(loop_lag(lag))
            trace: list[tuple[float, dict[str, tuple[int, int]]]] = []
            tracer = asyncio.ensure_future(limit_trace(gw.fleet.balancer, trace))
            *_, lat = await asyncio.gather(*(g.run() for g in gens), late_probe())
            monitor.cancel()
            tracer.cancel()
            limits = {n.id: n.limiter.limit for n in gw.fleet.balancer.nodes.values()
                      if n.limiter is not None}
            queue = gw.fleet.balancer.pools[MODEL].queue
            reasons = dict(queue.shed_total) if queue is not None else {}
    gpu_of = {n.id: n.gpu for n in emulated}
    lag.sort()
    res: dict[str, Any] = {"goodput_rps": 0.0, "rejected": 0, "per_priority": {},
                           "whole_run": {}, "misses": {}, "tpot_p99_by_class": {},
                           "limits": limits, "limit_trace": trace,
                           "probe_429_s": lat, "shed_reasons": reasons,
                           "loop_lag_ms": {"p99": round(lag[int(0.99 * len(lag))] * 1e3, 1),
                                           "max": round(lag[-1] * 1e3, 1)} if lag else {}}
    for gen in gens:
        label = gen.cfg.label
        whole = summarize(gen.records, gen.cfg, gen.elapsed_s)
        res["whole_run"][label] = whole["slo_attainment"]
        res["misses"][label] = _misses(gen.records)
        steady = [r for r in gen.records if r.arrival >= warmup]
        r = summarize(steady, replace(gen.cfg, duration_s=duration - warmup), gen.elapsed_s)
        res["goodput_rps"] += r["goodput_rps"]
        res["rejected"] += r["rejected"]
        ok = [x for x in steady if x.error == "ok"]
        ttft_miss = sum(1 for x in ok if x.first - x.arrival > SLO.ttft_s)
        tpot_miss = sum(1 for x in ok if x.tokens > 1
                        and (x.end - x.first) / (x.tokens - 1) > SLO.tpot_s)
        res["per_priority"][label] = {"requests": r["requests"], "rejected": r["rejected"],
                                      "slo_attainment": r["slo_attainment"],
                                      "ttft_misses": ttft_miss, "tpot_misses": tpot_miss,
                                      "ttft_p99_s": r["ttft_s"]["p99"],
                                      "tpot_p99_s": r["tpot_s"]["p99"]}
        for node, info in r["per_node"].items():
            g = gpu_of.get(node)
            if g is not None and info["completed"]:
                cur = res["tpot_p99_by_class"].get(g, 0.0)
                res["tpot_p99_by_class"][g] = max(cur, info["tpot_p99_s"])
    return res


def _misses(records: list[Any]) -> list[tuple[float, str, str, float, float]]:
    """Admitted requests that missed the SLO: (arrival, node, which, TTFT, TPOT)."""
    out = []
    for x in records:
        if x.error != "ok":
            continue
        ttft = x.first - x.arrival
        tpot = (x.end - x.first) / (x.tokens - 1) if x.tokens > 1 else 0.0
        which = "+".join(k for k, miss in (("ttft", ttft > SLO.ttft_s),
                                           ("tpot", tpot > SLO.tpot_s)) if miss)
        if which:
            out.append((round(x.arrival, 2), x.node, which, round(ttft, 3), round(tpot, 4)))
    return sorted(out)


async def main_async(load: float, duration: float, warmup: float, limit_opts: dict[str, Any],
                     baseline: bool) -> None:
    bound = capacity_bound(MODEL, SLO, FLEET, INPUT, OUTPUT)
    rate = load * bound
    print(f"fleet {FLEET}, capacity bound {bound:.1f} req/s, offering {rate:.1f} req/s "
          f"({load:.2f}) for {duration:.0f} s, statistics after {warmup:.0f} s", flush=True)
    for limited in (False, True) if baseline else (True,):
        r = await one_run(limited, rate, duration, warmup, limit_opts)
        lat = sorted(r["probe_429_s"])
        lat_s = (f"; 429 latency max {lat[-1] * 1000:.1f} ms over {len(lat)} probes"
                 if lat else "")
        tpot = {g: round(v / SLO.tpot_s, 3) for g, v in r["tpot_p99_by_class"].items()}
        print(f"limits={'gradient' if limited else 'none':8s} goodput {r['goodput_rps']:.2f} "
              f"req/s, 429s {r['rejected']}, P99 TPOT/SLO by class {tpot}{lat_s}")
        print(f"    per priority {r['per_priority']}")
        print(f"    attainment over the whole run (with warm-up) {r['whole_run']}; "
              f"event-loop lag {r['loop_lag_ms']} ms")
        high = r["misses"].get("high", [])
        early = sum(1 for m in high if m[0] < warmup)
        print(f"    high misses over the whole run: {len(high)} ({early} in the warm-up); "
              f"first ones {high[:20]}")
        if r["limits"]:
            print(f"    final limits {r['limits']}; shed by reason {r['shed_reasons']}")
            ids = sorted(r["limits"])
            print(f"    limit/in use over time ({', '.join(ids)}):")
            for t, snap in r["limit_trace"]:
                cells = " ".join(f"{snap[i][0]:3d}/{snap[i][1]:<3d}" for i in ids if i in snap)
                print(f"      t={t:5.1f} {cells}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--load", type=float, default=1.3)
    ap.add_argument("--duration", type=float, default=40.0)
    ap.add_argument("--warmup", type=float, default=None,
                    help="seconds excluded from the statistics (default: a fifth of the run)")
    ap.add_argument("--limit-opts", default="{}", help="extra limits keys as JSON")
    ap.add_argument("--no-baseline", action="store_true", help="skip the run without limits")
    args = ap.parse_args()
    warmup = args.duration / 5 if args.warmup is None else args.warmup
    if not 0 <= warmup < args.duration:
        ap.error("--warmup must be in [0, duration)")
    # Clients cut off at the end of the overloaded run without limits log a
    # warning line each (499); the benchmark reports them in its own summary.
    logging.getLogger("tailguard.request").setLevel(logging.ERROR)
    asyncio.run(main_async(args.load, args.duration, warmup, json.loads(args.limit_opts),
                           not args.no_baseline))


if __name__ == "__main__":
    main()
