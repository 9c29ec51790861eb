"""Prefix-cache-aware routing (issue 15), measured in the simulator.

Every case draws a fleet and a shared-prefix workload from ``--seed`` (nothing
here is tuned to a shipped scenario) and runs the same requests through each
policy side by side: ``tailguard``, ``cache_aware`` (SGLang's / vllm-router's),
``least_request`` and ``round_robin``. Engines cache prefixes (vLLM's rules,
tailguard.engine.prefix_cache); the router only sees what a gateway sees.

Workloads (``--workloads``):

* ``multi-turn``: chat sessions resending their history, tenants' shared
  system prompts, a share of agent loops;
* ``agents``: agent loops only (short pauses, tool results appended);
* ``trace``: a Mooncake FAST'25-format trace (``timestamp`` ms, ``hash_ids`` of
  512-token blocks) written from a generated session workload and replayed
  through ``arrival: {process: trace, time_scale: X}``.

Fleets (``--fleets``): ``mixed`` (H100/A100/L40S/L4/T4, 2-4 classes) and
``homogeneous`` (one class). Loads (``--loads``) are fractions of the fleet's
SLO capacity for the same prompts *uncached* (caching lets a fleet carry more).

Printed per case: SLO attainment, TTFT p99, hit rate (cached prompt tokens /
prompt tokens) per policy, then tailguard's ratios: TTFT p99 of cache_aware and
least_request over tailguard's (targets >= 1.5 and >= 3 on mixed fleets),
hit rate over cache_aware's (>= 0.8), and, on homogeneous fleets, tailguard's
TTFT p99 over the best policy's (<= 1.05).

Live (``--live``): emulated engines with prefix caching (a mixed fleet,
``--live-fleet``), the gateway in front with each policy in turn (fresh
engines, empty caches, for every policy), and ``tailguard bench --workload``'s
generator offering the same multi-turn workload at ``--live-rate``; the hit
rate is what the engines reported (``usage.prompt_tokens_details``).

    python benchmarks/prefix.py [--seed 1] [--cases 2] [--loads 1.0,1.5]
                                [--fleets mixed,homogeneous] [--workloads multi-turn,agents,trace]
                                [--duration 240] [--jobs 2] [--json FILE]
    python benchmarks/prefix.py --live [--live-rate 6] [--live-duration 40]
                                [--live-fleet H100-SXM:1,A100-80GB:1,L4:2]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from tailguard.errors import ConfigError
from tailguard.sim.run import simulate
from tailguard.sim.scenario import parse_scenario
from tailguard.traffic.sessions import PrefixSpec, generate_sessions
from tailguard.traffic.traces import MOONCAKE_BLOCK_TOKENS
from tailguard.traffic.workload import parse_length_dist

POLICIES = ("tailguard", "cache_aware", "least_request", "round_robin", "consistent_hash")
MIXED = ("H100-SXM", "A100-80GB", "L40S", "L4", "T4")
HOMOGENEOUS = ("H100-SXM", "A100-80GB", "L40S")
MESSAGE = {"dist": "lognormal", "mu": 5.5, "sigma": 0.8, "max": 4096}
ANSWER = {"dist": "azure-conv", "max": 1024}


def draw_fleet(rng: random.Random, kind: str) -> list[dict[str, Any]]:
    if kind == "homogeneous":
        return [{"gpu": rng.choice(HOMOGENEOUS), "count": rng.randint(4, 8)}]
    classes = rng.sample(MIXED, rng.randint(2, 4))
    if not {"H100-SXM", "A100-80GB"} & set(classes):
        classes[0] = rng.choice(("H100-SXM", "A100-80GB"))
    # llama-3.1-8b needs two T4s (16 GB each) per replica.
    return [{"gpu": g, "count": rng.randint(1, 4), **({"tp": 2} if g == "T4" else {})}
            for g in classes]


def draw_prefix(rng: random.Random, workload: str) -> dict[str, Any]:
    agents = 1.0 if workload == "agents" else round(rng.uniform(0.0, 0.4), 2)
    return {
        "block_tokens": MOONCAKE_BLOCK_TOKENS if workload == "trace" else rng.choice((64, 128)),
        "tenants": rng.randint(4, 40),
        "system_tokens": rng.randint(300, 3000),
        "zipf": round(rng.uniform(0.5, 1.3), 2),
        "turns": round(rng.uniform(2.0, 8.0), 1),
        "think_s": round(rng.uniform(5.0, 40.0), 1),
        "agents": agents,
        "agent_steps": round(rng.uniform(4.0, 12.0), 1),
        "agent_think_s": round(rng.uniform(0.5, 3.0), 1),
        "tool_tokens": rng.randint(100, 800),
        "max_context": 12000,
    }


def write_mooncake(path: Path, prefix: dict[str, Any], rate: float, duration: float,
                   seed: int) -> None:
    """A Mooncake-format trace: sessions as generated, lines as in the FAST'25 release."""
    rng = random.Random(seed)
    spec = PrefixSpec(**prefix)
    starts: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate / spec.requests_per_session)
        if t >= duration:
            break
        starts.append(t)
    got = generate_sessions(spec, starts, duration, {
        "input_tokens": parse_length_dist(MESSAGE, "m", "input_tokens"),
        "output_tokens": parse_length_dist(ANSWER, "a", "output_tokens")}, rng)
    bt = spec.block_tokens
    with path.open("w") as out:
        for ts, n_in, n_out, blocks in zip(got.arrival_s, got.input_tokens, got.output_tokens,
                                           got.blocks, strict=True):
            ids = list(blocks[: -(-n_in // bt)])  # the input's blocks, the last one partial
            out.write(json.dumps({"timestamp": int(ts * 1000), "input_length": n_in,
                                  "output_length": n_out, "hash_ids": ids}) + "\n")


def scenario(seed: int, fleet_kind: str, workload: str, load: float, duration: float,
             trace_dir: Path) -> dict[str, Any]:
    rng = random.Random(f"prefix:{seed}:{fleet_kind}:{workload}")
    fleet = draw_fleet(rng, fleet_kind)
    prefix = draw_prefix(rng, workload)
    wl: dict[str, Any] = {"duration_s": duration, "warmup_s": 60.0}
    if workload == "trace":
        # Written at a nominal 10 req/s and long enough for 40 req/s once the run
        # scales it to the load's rate (think times shrink with it).
        path = trace_dir / f"trace-{seed}-{fleet_kind}.jsonl"
        if not path.exists():
            write_mooncake(path, prefix, 10.0, duration * 4.0, seed)
        wl["arrival"] = {"process": "trace", "path": str(path), "load": load}
    else:
        wl.update(arrival={"process": "poisson", "load": load}, input_tokens=MESSAGE,
                  output_tokens=ANSWER, prefix=prefix)
    return {"name": f"prefix-{seed}-{fleet_kind}-{workload}", "seed": seed,
            "model": "llama-3.1-8b", "slo": {"ttft_s": 2.0, "tpot_s": 0.1},
            "network_rtt_s": 0.001, "fleet": fleet, "workload": wl,
            "policies": list(POLICIES)}


def run_case(args: tuple[dict[str, Any], str]) -> dict[str, Any]:
    raw, policy = args
    scn = parse_scenario(raw)
    t0 = time.perf_counter()
    try:
        out = simulate(scn, [p for p in scn.policies if p.label == policy])
    except ConfigError as exc:  # e.g. a fleet with no SLO capacity for the workload
        return {"name": raw["name"], "load": raw["workload"]["arrival"]["load"],
                "policy": policy, "fleet": raw["fleet"], "error": str(exc)}
    res = out["results"][policy]
    pre = res.get("prefix", {})
    return {"name": raw["name"], "load": raw["workload"]["arrival"]["load"], "policy": policy,
            "fleet": raw["fleet"], "offered_rps": res["offered_rps"],
            "attainment": res["slo_attainment"], "ttft_p99": res["ttft_s"]["p99"],
            "ttft_p50": res["ttft_s"]["p50"], "tpot_p99": res["tpot_s"]["p99"],
            "hit_rate": pre.get("hit_rate", 0.0),
            "ttft_cached_p99": pre.get("ttft_cached_s", {}).get("p99", 0.0),
            "ttft_uncached_p99": pre.get("ttft_uncached_s", {}).get("p99", 0.0),
            "unfinished": res["unfinished"], "wall_s": round(time.perf_counter() - t0, 1)}


LIVE_WORKLOAD = {
    "arrival": {"process": "poisson"},
    "input_tokens": {"dist": "lognormal", "mu": 5.0, "sigma": 0.7, "max": 2048},
    "output_tokens": {"dist": "uniform", "min": 16, "max": 96},
    "prefix": {"block_tokens": 64, "tenants": 8, "system_tokens": 1200, "zipf": 1.0,
               "turns": 5, "think_s": 6, "agents": 0.2, "agent_steps": 6, "agent_think_s": 1,
               "tool_tokens": 200, "max_context": 12000},
}


async def live_one(policy: str, fleet: list[tuple[str, int]], rate: float, duration: float,
                   warmup: float, seed: int) -> dict[str, Any]:
    from dataclasses import replace

    from tailguard.bench import BenchConfig, LoadGenerator
    from tailguard.bench.loadgen import summarize
    from tailguard.config.fleet import parse_fleet
    from tailguard.core.policies import Slo
    from tailguard.emulator import EmulatedNode, run_emulator
    from tailguard.gateway.app import run_gateway
    from tailguard.traffic.workload import generate, parse_workload

    model = "llama-3.1-8b"
    slo = Slo(ttft_s=1.0, tpot_s=0.1)
    emulated = [EmulatedNode(f"{g.split('-')[0].lower()}-{i}", g, models=(model,))
                for g, count in fleet for i in range(count)]
    spec = parse_workload({**LIVE_WORKLOAD, "duration_s": duration,
                           "arrival": {"process": "poisson", "rate": rate}})
    reqs = generate(spec, None, random.Random(f"{seed}:live"))
    async with run_emulator(emulated, host="127.0.0.1") as emu:
        gw_fleet = parse_fleet({
            "listen": "127.0.0.1:0",
            "nodes": [{"id": n.id, "url": emu.urls[n.id], "gpu": n.gpu, "models": [model]}
                      for n in emulated],
            "pools": {model: {"policy": policy,
                              "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s}}},
        })
        async with run_gateway(gw_fleet, host="127.0.0.1", port=0) as gw:
            gen = LoadGenerator(BenchConfig(gw.url, model=model, workload=reqs,
                                            duration_s=duration, slo=slo, ignore_eos=True,
                                            drain_s=30.0, label=policy))
            await gen.run()
    steady = [r for r in gen.records if r.arrival >= warmup]
    res = summarize(steady, replace(gen.cfg, duration_s=duration - warmup), gen.elapsed_s)
    gpu_of = {n.id: n.gpu for n in emulated}
    share: dict[str, float] = {}
    for node, info in res["per_node"].items():
        share[gpu_of.get(node, node)] = share.get(gpu_of.get(node, node), 0.0) + info["share"]
    return {"policy": policy, "requests": res["requests"], "attainment": res["slo_attainment"],
            "ttft_p50": res["ttft_s"]["p50"], "ttft_p99": res["ttft_s"]["p99"],
            "tpot_p99": res["tpot_s"]["p99"],
            "hit_rate": res.get("prefix", {}).get("hit_rate", 0.0),
            "failed": res["failed"], "share": share}


def live(args: argparse.Namespace) -> None:
    import asyncio

    fleet = [(g, int(c)) for g, c in (x.split(":") for x in args.live_fleet.split(","))]
    warmup = args.live_duration / 5
    rows = []
    for policy in args.policies.split(","):
        r = asyncio.run(live_one(policy, fleet, args.live_rate, args.live_duration, warmup,
                                 args.seed))
        rows.append(r)
        print(f"  {policy:14s} att {r['attainment']:.4f}  TTFT p50 {r['ttft_p50']:.3f} "
              f"p99 {r['ttft_p99']:.3f} s  TPOT p99 {r['tpot_p99']:.3f}  hit "
              f"{r['hit_rate']:.3f}  requests {r['requests']}  failed {r['failed']}  "
              f"share {json.dumps({k: round(v, 2) for k, v in r['share'].items()})}",
              flush=True)
    by = {r["policy"]: r for r in rows}
    if "tailguard" in by and "cache_aware" in by:
        tg, ca = by["tailguard"], by["cache_aware"]
        print(f"  cache_aware TTFT p99 / tailguard {ca['ttft_p99'] / max(tg['ttft_p99'], 1e-9):.2f}x;"
              f" attainment {tg['attainment']:.4f} vs {ca['attainment']:.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--cases", type=int, default=1)
    ap.add_argument("--loads", default="1.0,1.5")
    ap.add_argument("--fleets", default="mixed,homogeneous")
    ap.add_argument("--workloads", default="multi-turn,agents,trace")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--duration", type=float, default=240.0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", help="write every row here")
    ap.add_argument("--live", action="store_true", help="emulated engines and the gateway")
    ap.add_argument("--live-rate", type=float, default=6.0)
    ap.add_argument("--live-duration", type=float, default=40.0)
    ap.add_argument("--live-fleet", default="H100-SXM:1,A100-80GB:1,L4:2")
    a = ap.parse_args()
    if a.live:
        live(a)
        return
    policies = a.policies.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        jobs = []
        for case in range(a.cases):
            for fleet in a.fleets.split(","):
                for workload in a.workloads.split(","):
                    for load in (float(x) for x in a.loads.split(",")):
                        raw = scenario(a.seed + case, fleet, workload, load, a.duration,
                                       Path(tmp))
                        jobs += [(raw, p) for p in policies]
        with ProcessPoolExecutor(a.jobs) as pool:
            rows = list(pool.map(run_case, jobs))
    by_case: dict[tuple[str, float], dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_case.setdefault((r["name"], r["load"]), {})[r["policy"]] = r
    verdicts = []
    for (name, load), got in by_case.items():
        fleet = " ".join(f"{g['count']}x{g['gpu']}" for g in next(iter(got.values()))["fleet"])
        errors = {r["error"] for r in got.values() if "error" in r}
        if errors:
            print(f"\n{name} load {load} ({fleet}): not run: {'; '.join(sorted(errors))}")
            continue
        print(f"\n{name} load {load} ({fleet}), {next(iter(got.values()))['offered_rps']:.1f} "
              "req/s")
        for p, r in got.items():
            print(f"  {p:14s} att {r['attainment']:.4f}  TTFT p50 {r['ttft_p50']:8.3f} "
                  f"p99 {r['ttft_p99']:8.3f} s  TPOT p99 {r['tpot_p99']:.3f}  "
                  f"hit {r['hit_rate']:.3f}  (cached p99 {r['ttft_cached_p99']:.3f}, "
                  f"uncached {r['ttft_uncached_p99']:.3f})  unfinished {r['unfinished']}")
        tg = got.get("tailguard")
        if tg is None:
            continue
        line = []
        for other in ("cache_aware", "least_request"):
            if other in got:
                ratio = got[other]["ttft_p99"] / max(tg["ttft_p99"], 1e-9)
                line.append(f"{other} TTFT p99 / tailguard {ratio:.2f}x")
        if "cache_aware" in got and got["cache_aware"]["hit_rate"] > 0:
            line.append(f"hit rate / cache_aware {tg['hit_rate'] / got['cache_aware']['hit_rate']:.2f}")
        if "homogeneous" in name:
            best = min(r["ttft_p99"] for r in got.values())
            line.append(f"TTFT p99 / best {tg['ttft_p99'] / max(best, 1e-9):.3f}")
        print("  " + "; ".join(line))
        verdicts.append((name, load, tg["attainment"]))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
