"""A fast node lost at high load, live: emulated engines, the real gateway, one load.

Issue 15's incident: a mixed fleet (default two each of H100, A100, L4 and T4
serving llama-3.2-3b, one T4 permanently 1.4x slow) offered ``--load`` (0.7)
of its SLO capacity bound (the simulator's capacity search); at
``--throttle-at`` one node of the fastest class is throttled to ``--factor``
(a third) of its speed for ``--throttle-s`` (30) seconds. The prompts are long
(about 3,000 tokens) and the answers short, so the run stays within what one
process can emulate on two cores while prompts computed beside the decodes
matter, as they do in production.

Each policy runs on fresh engines, the same seeded requests, one after the
other. Prints per run: SLO attainment over the whole run (the issue's target:
0.99), TTFT/TPOT p99, each GPU class's share and attainment, the healthy fast
peer's TPOT p99 against the SLO while its peer was throttled, the throttled
node's share then, and the detector's events. Everything runs in one process:
the event loop's worst lag is printed too (a stalled loop delays tokens, which
no engine caused). Asserts nothing.

Issue 16's live checks use the same run: ``--tp 2 --gpu-index 1 --dcgm``
throttles one GPU of the victim's TP-2 replica and scrapes every node's DCGM
page, so the events name the GPU (``detected after``: the victim's first
degraded or quarantined event after its fault began); ``--throttle-s 0`` runs
without a fault (a healthy soak: every degraded or quarantined event is false).

    python benchmarks/incident_live.py [--policies tailguard,tailguard+limits,least_request]
        [--fleet H100-SXM:2,A100-80GB:2,L4:2,T4:2] [--load 0.7] [--duration 80] [--json F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from typing import Any

import numpy as np

from tailguard.bench import BenchConfig, LoadGenerator
from tailguard.bench.loadgen import Record, summarize
from tailguard.config.fleet import parse_fleet
from tailguard.core.hardware import DEFAULT_CATALOG, PerfModel
from tailguard.core.policies import Slo
from tailguard.emulator import EmulatedNode, parse_fault, run_emulator
from tailguard.gateway.app import run_gateway
from tailguard.sim.fleet_bound import capacity_bound
from tailguard.traffic.workload import parse_length_dist

INPUT = {"dist": "lognormal", "mu": 8.0, "sigma": 0.5, "max": 16000}
OUTPUT = {"dist": "uniform", "min": 16, "max": 128}


def parse_fleet_arg(text: str) -> list[tuple[str, int]]:
    out = []
    for part in text.split(","):
        gpu, _, count = part.partition(":")
        out.append((DEFAULT_CATALOG.gpu(gpu).name, int(count or 1)))
    return out


def build_nodes(fleet: list[tuple[str, int]], model: str, slow: tuple[str, float] | None,
                tp: int = 1) -> tuple[list[EmulatedNode], str, str | None]:
    """The emulated nodes, the node to throttle (first of the fastest class) and the
    permanently slow one."""
    nodes, slow_id = [], None
    for gpu, count in fleet:
        for i in range(count):
            nid = f"{gpu.split('-')[0].lower()}-{i}"
            speed = 1.0
            if slow is not None and gpu == slow[0] and i == count - 1 and slow_id is None:
                speed, slow_id = 1.0 / slow[1], nid
            nodes.append(EmulatedNode(nid, gpu, models=(model,), speed=speed, tp=tp))
    m = DEFAULT_CATALOG.model(model)
    fastest = min(fleet, key=lambda g: PerfModel(DEFAULT_CATALOG.gpu(g[0]), m, tp).decode_step(8, 3000))
    victim = next(n.id for n in nodes if n.gpu == fastest[0])
    return nodes, victim, slow_id


def pool_config(policy: str, slo: Slo) -> dict[str, Any]:
    name, _, extra = policy.partition("+")
    cfg: dict[str, Any] = {"policy": name, "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s}}
    if extra == "limits":
        cfg["limits"] = {"kind": "gradient"}
        cfg["admission"] = {"queue_max": 512}
    elif extra:
        raise SystemExit(f"unknown policy variant {policy!r} (use NAME or NAME+limits)")
    return cfg


def tpot(r: Record) -> float:
    return (r.end - r.first) / (r.tokens - 1) if r.tokens > 1 else 0.0


def meets(r: Record, slo: Slo) -> bool:
    return r.error == "ok" and r.first - r.arrival <= slo.ttft_s and tpot(r) <= slo.tpot_s


async def lag_probe(out: list[float]) -> None:
    while True:
        t = time.monotonic()
        await asyncio.sleep(0.005)
        out.append(time.monotonic() - t - 0.005)


async def one_run(policy: str, args: argparse.Namespace, fleet: list[tuple[str, int]],
                  rate: float, slo: Slo) -> dict[str, Any]:
    slow = None
    if args.slow:
        gpu, _, factor = args.slow.partition(":")
        slow = (DEFAULT_CATALOG.gpu(gpu).name, float(factor or 1.4))
    nodes, victim, slow_id = build_nodes(fleet, args.model, slow, args.tp)
    gpu_of = {n.id: n.gpu for n in nodes}
    events: list[tuple[float, str, str, str]] = []
    lags: list[float] = []
    async with run_emulator(nodes, host="127.0.0.1") as emu:
        gw_fleet = parse_fleet({
            "listen": "127.0.0.1:0",
            "nodes": [{"id": n.id, "url": emu.urls[n.id], "gpu": n.gpu, "tp": args.tp,
                       "models": [args.model],
                       **({"dcgm_url": emu.urls[n.id] + "/dcgm"} if args.dcgm else {})}
                      for n in nodes],
            "pools": {args.model: pool_config(policy, slo)},
        })
        async with run_gateway(gw_fleet, host="127.0.0.1", port=0) as gw:
            t0 = time.monotonic()
            gw.fleet.event_listeners.append(
                lambda ev: events.append((time.monotonic() - t0, ev.node, ev.state, ev.reason,
                                          ev.cause))
                if ev.kind == "state" else None)
            gen = LoadGenerator(BenchConfig(
                gw.url, model=args.model, rate=rate, duration_s=args.duration,
                input_tokens=parse_length_dist(INPUT, "input_tokens", "input_tokens"),
                output_tokens=parse_length_dist(OUTPUT, "output_tokens", "output_tokens"),
                slo=slo, ignore_eos=True, drain_s=30.0, seed=args.seed, label=policy))

            async def throttle() -> None:
                if args.throttle_s <= 0:
                    return
                await asyncio.sleep(args.throttle_at)
                fault: dict[str, Any] = {"kind": "throttle", "factor": args.factor,
                                         "duration_s": args.throttle_s}
                if args.gpu_index is not None:
                    fault["gpu_index"] = args.gpu_index
                emu.server(victim).inject(parse_fault(fault))

            tasks = [asyncio.ensure_future(throttle()), asyncio.ensure_future(lag_probe(lags))]
            try:
                await gen.run()
            finally:
                for task in tasks:
                    task.cancel()
    recs = gen.records
    summary = summarize(recs, gen.cfg, gen.elapsed_s)
    ok = [r for r in recs if r.error == "ok"]
    start, end = args.throttle_at, args.throttle_at + args.throttle_s
    during = [r for r in ok if start <= r.arrival < end]
    peer = next((n.id for n in nodes if gpu_of[n.id] == gpu_of[victim] and n.id != victim), None)
    peer_tpots = [tpot(r) for r in during if r.node == peer and r.tokens > 1]
    classes: dict[str, dict[str, float]] = {}
    for gpu, _ in fleet:
        mine = [r for r in recs if gpu_of.get(r.node) == gpu]
        done = [r for r in mine if r.error == "ok"]
        classes[gpu] = {"share": round(len(mine) / max(1, len(recs)), 4),
                        "attainment": round(sum(meets(r, slo) for r in mine) / len(mine), 4)
                        if mine else 0.0,
                        "ttft_misses": sum(r.first - r.arrival > slo.ttft_s for r in done),
                        "tpot_misses": sum(tpot(r) > slo.tpot_s for r in done)}
    return {
        "policy": policy, "rate": round(rate, 2), "requests": len(recs),
        "slo_attainment": round(sum(meets(r, slo) for r in recs) / max(1, len(recs)), 4),
        "ttft_p99_s": summary["ttft_s"]["p99"], "tpot_p99_s": summary["tpot_s"]["p99"],
        "failed": summary["failed"], "classes": classes, "victim": victim, "slow_node": slow_id,
        "victim_share_during": round(sum(r.node == victim for r in during) / max(1, len(during)), 4),
        "peer": peer, "peer_share_during": round(sum(r.node == peer for r in during)
                                                 / max(1, len(during)), 4),
        "peer_tpot_p99_over_slo": round(float(np.percentile(peer_tpots, 99)) / slo.tpot_s, 3)
        if peer_tpots else None,
        "events": [(round(t, 1), n, s, why, cause) for t, n, s, why, cause in events],
        # The victim's first degraded or quarantined event after its fault began, and
        # every other one (a healthy node flagged, or the victim before its fault).
        "detected_s": next((round(t - start, 1) for t, n, s, _, _ in events
                            if n == victim and t >= start and args.throttle_s > 0
                            and s in ("degraded", "quarantined")), None),
        "false_detections": sum(1 for t, n, s, _, _ in events
                                if s in ("degraded", "quarantined")
                                and (n != victim or t < start or args.throttle_s <= 0)),
        "loop_lag_max_s": round(max(lags), 3) if lags else None,
        # Every answered request that missed: arrival, node, TTFT, TPOT, tokens in and out.
        "misses": [(round(r.arrival, 2), r.node, round(r.first - r.arrival, 3), round(tpot(r), 4),
                    r.input, r.tokens) for r in ok if not meets(r, slo)],
    }


def report(res: dict[str, Any]) -> str:
    cls = ", ".join(f"{g} {c['share']:.1%} at {c['attainment']:.3f} (misses: TTFT "
                    f"{c['ttft_misses']}, TPOT {c['tpot_misses']})"
                    for g, c in res["classes"].items())
    evs = "; ".join(f"{t:.0f}s {n} {s}" + (f" ({cause})" if cause else "")
                    for t, n, s, _, cause in res["events"]) or "none"
    return (f"{res['policy']}: attainment {res['slo_attainment']:.4f} of {res['requests']} "
            f"({res['failed']} failed), TTFT p99 {res['ttft_p99_s']:.2f} s, TPOT p99 "
            f"{res['tpot_p99_s'] * 1000:.0f} ms\n  classes: {cls}\n  while {res['victim']} was "
            f"throttled: its share {res['victim_share_during']:.1%}, {res['peer']}'s "
            f"{res['peer_share_during']:.1%} at TPOT p99 {res['peer_tpot_p99_over_slo']}x the "
            f"SLO\n  events: {evs}\n  victim detected after {res['detected_s']} s; false "
            f"detections {res['false_detections']}\n  loop lag max {res['loop_lag_max_s']} s")


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    fleet = parse_fleet_arg(args.fleet)
    slo = Slo(ttft_s=args.ttft, tpot_s=args.tpot)
    bound = capacity_bound(args.model, slo, fleet, INPUT, OUTPUT, args.tp)
    rate = args.load * bound
    print(f"{args.fleet} serving {args.model}: SLO capacity bound {bound:.1f} req/s, offering "
          f"{rate:.1f} ({args.load:g}x) for {args.duration:.0f} s; throttle {args.factor:g}x at "
          f"{args.throttle_at:g} s for {args.throttle_s:g} s; slow node {args.slow or 'none'}",
          flush=True)
    out = []
    for policy in args.policies.split(","):
        res = await one_run(policy, args, fleet, rate, slo)
        print(report(res), flush=True)
        out.append(res)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="tailguard,tailguard+limits,least_request")
    ap.add_argument("--fleet", default="H100-SXM:2,A100-80GB:2,L4:2,T4:2")
    ap.add_argument("--model", default="llama-3.2-3b")
    ap.add_argument("--slow", default="T4:1.4", help="GPU:factor, one node permanently slow ('')")
    ap.add_argument("--load", type=float, default=0.7)
    ap.add_argument("--ttft", type=float, default=2.0)
    ap.add_argument("--tpot", type=float, default=0.05)
    ap.add_argument("--duration", type=float, default=80.0)
    ap.add_argument("--throttle-at", type=float, default=25.0)
    ap.add_argument("--throttle-s", type=float, default=30.0)
    ap.add_argument("--factor", type=float, default=1.0 / 3.0)
    ap.add_argument("--tp", type=int, default=1, help="GPUs per emulated replica")
    ap.add_argument("--gpu-index", type=int, help="throttle this GPU of the victim only")
    ap.add_argument("--dcgm", action="store_true",
                    help="scrape each emulated node's DCGM page (events name the GPU)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    for name in ("tailguard.request", "tailguard.adapters.monitor", "tailguard.gateway"):
        logging.getLogger(name).setLevel(logging.ERROR)
    out = asyncio.run(main_async(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
