"""Disaggregated prefill/decode against co-located serving, and P/D routing policies.

One mixed inventory is deployed as formations: co-located (every replica does
both phases) and P/D splits (each GPU type given a role). Each formation is
run on long-prompt traffic (Mooncake-like: lognormal prompts, mean about 13k
tokens) and on short-prompt traffic (Azure conversation), at the same offered
rates, with the policies that apply to it:

* co-located: ``tailguard``, ``least_request``;
* P/D: ``tailguard`` (pairs by predicted finish: hardware, load, link),
  ``round_robin`` and ``cache_aware`` phase by phase (vllm-router's P/D),
  ``dynamo`` (Dynamo's conditional rule, least loaded per phase).

It prints attainment, TTFT and TPOT p99, the share of prompts computed on
another node, the KV transfer p99 and, with ``--goodput``, the highest rate at
which each keeps the SLO attainment (bisection), per dollar-hour of the
inventory. Every number comes from one run of the simulator; nothing is
asserted.

    python benchmarks/pd.py [--inventory mixed|h100-a100] [--rates 1.5,2.5]
                            [--workloads long,short] [--duration 600] [--seed 1]
                            [--goodput] [--json out.json]
    python benchmarks/pd.py --bound [--inventory mixed] [--rates 2,3]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from tailguard.core.hardware import DEFAULT_CATALOG
from tailguard.sim.run import RunOptions, simulate
from tailguard.sim.scenario import PolicyChoice, parse_scenario

# Inventories as (gpu, count); formations give each GPU type a role.
INVENTORIES: dict[str, list[tuple[str, int]]] = {
    "mixed": [("H100-SXM", 2), ("A100-80GB", 4), ("L40S", 4)],
    "h100-a100": [("H100-SXM", 2), ("A100-80GB", 4)],
    "skewed": [("H100-SXM", 1), ("L40S", 3), ("A100-80GB", 4)],
    "homogeneous": [("H100-SXM", 6)],
}
# A formation gives each GPU type a role, or (homogeneous inventories) counts of it
# to each role, as "GPU": {"prefill": n, "decode": m}.
FORMATIONS: dict[str, dict[str, dict[str, Any]]] = {
    "mixed": {
        "co-located": {},
        "H100 prefill": {"H100-SXM": "prefill", "A100-80GB": "decode", "L40S": "decode"},
        "H100+L40S prefill": {"H100-SXM": "prefill", "A100-80GB": "decode",
                              "L40S": "prefill"},
        "H100 both": {"H100-SXM": "both", "A100-80GB": "decode", "L40S": "decode"},
    },
    "skewed": {  # prefill nodes of very unequal speed: where pairing by hardware shows
        "co-located": {},
        "H100+L40S prefill": {"H100-SXM": "prefill", "L40S": "prefill", "A100-80GB": "decode"},
    },
    "homogeneous": {  # DistServe's setting: one GPU type, split by count
        "co-located": {},
        "2 prefill, 4 decode": {"H100-SXM": {"prefill": 2, "decode": 4}},
        "3 prefill, 3 decode": {"H100-SXM": {"prefill": 3, "decode": 3}},
    },
    "h100-a100": {
        "co-located": {},
        "H100 prefill": {"H100-SXM": "prefill", "A100-80GB": "decode"},
        "H100 both": {"H100-SXM": "both", "A100-80GB": "decode"},
    },
}
WORKLOADS: dict[str, dict[str, Any]] = {
    "long": {"input_tokens": {"dist": "lognormal", "mu": 9.1, "sigma": 0.9, "min": 64,
                              "max": 100_000},
             "output_tokens": {"dist": "lognormal", "mu": 5.5, "sigma": 0.7, "min": 2,
                               "max": 2000},
             "slo": {"ttft_s": 5.0, "tpot_s": 0.05}},
    "short": {"input_tokens": {"dist": "azure-conv"}, "output_tokens": {"dist": "azure-conv"},
              "slo": {"ttft_s": 2.0, "tpot_s": 0.05}},
}
COLOCATED = ["tailguard", "least_request"]
PAIRED = ["tailguard", "round_robin", "cache_aware", "dynamo"]


def scenario(inventory: str, formation: str, workload: str, rate: float, duration: float,
             seed: int) -> dict[str, Any]:
    roles = FORMATIONS[inventory][formation]
    wl = WORKLOADS[workload]
    return {
        "name": f"{formation} / {workload}", "seed": seed, "model": "llama-3.1-8b",
        "slo": wl["slo"], "network_rtt_s": 0.001,
        "fleet": fleet(inventory, roles),
        "workload": {"duration_s": duration, "warmup_s": min(60.0, duration / 10),
                     "arrival": {"process": "poisson", "rate": rate},
                     "input_tokens": wl["input_tokens"], "output_tokens": wl["output_tokens"]},
        "policies": COLOCATED if all(g["role"] == "both" for g in fleet(inventory, roles))
        else PAIRED,
    }


def fleet(inventory: str, roles: dict[str, Any]) -> list[dict[str, Any]]:
    """The scenario's fleet entries of a formation."""
    out: list[dict[str, Any]] = []
    for g, n in INVENTORIES[inventory]:
        role = roles.get(g, "both")
        if isinstance(role, dict):
            out += [{"gpu": g, "count": k, "role": r} for r, k in role.items()]
        else:
            out.append({"gpu": g, "count": n, "role": role})
    return out


def price_per_hour(inventory: str) -> float:
    return sum(DEFAULT_CATALOG.gpu(g).price_per_hour * n for g, n in INVENTORIES[inventory])


def prefill_floor(rate: float, lengths: dict[str, Any], gpus: list[str], seed: int = 1,
                  seconds: float = 3000.0) -> float:
    """TTFT p99 of a clairvoyant router on engines that take prompts first come first
    served: ``seconds`` of Poisson arrivals with lognormal prompt ``lengths`` (mu,
    sigma, min, max), each placed on the one of ``gpus`` where it would finish
    first, every prompt's compute time (the roofline's) and every queue known; no
    decode side, KV transfer or network. No router that places prompts one at a
    time as they come does better on those engines."""
    import numpy as np

    from tailguard.core.hardware import perf_model

    rng = np.random.default_rng(seed)
    n = int(rate * seconds)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
    sizes = np.clip(np.exp(rng.normal(lengths["mu"], lengths["sigma"], n)), lengths["min"],
                    lengths["max"]).astype(int)
    perfs = [perf_model(g, "llama-3.1-8b") for g in gpus]
    free = [0.0] * len(perfs)
    ttft = np.empty(n)
    for i, (a, size) in enumerate(zip(arrivals, sizes, strict=True)):
        ends = [max(f, a) + p.prefill_time(int(size)) for f, p in zip(free, perfs, strict=True)]
        k = min(range(len(ends)), key=ends.__getitem__)
        free[k] = ends[k]
        ttft[i] = ends[k] - a
    return float(np.percentile(ttft, 99))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inventory", choices=sorted(INVENTORIES), default="mixed")
    ap.add_argument("--rates", default="1.5,2.5", help="offered req/s, comma-separated")
    ap.add_argument("--workloads", default="long,short")
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--goodput", action="store_true",
                    help="also bisect each policy's highest rate at the SLO attainment")
    ap.add_argument("--json", help="write every result here")
    ap.add_argument("--bound", action="store_true",
                    help="instead: the long prompts' TTFT p99 floor of a clairvoyant router "
                         "on the inventory (any node may compute a prompt), seeds 1-3")
    args = ap.parse_args()
    if args.bound:
        gpus = [g for g, n in INVENTORIES[args.inventory] for _ in range(n)]
        for rate in (float(r) for r in args.rates.split(",")):
            floors = [prefill_floor(rate, WORKLOADS["long"]["input_tokens"], gpus, seed)
                      for seed in (1, 2, 3)]
            print(f"{args.inventory}, long prompts at {rate} req/s: a clairvoyant router's "
                  f"TTFT p99 {' / '.join(f'{f:.2f}' for f in floors)} s (seeds 1-3)")
        return
    dollars = price_per_hour(args.inventory)
    print(f"inventory {args.inventory}: "
          + ", ".join(f"{n} x {g}" for g, n in INVENTORIES[args.inventory])
          + f" (${dollars:.2f}/h)")
    rows: list[dict[str, Any]] = []
    for workload in args.workloads.split(","):
        for rate in (float(r) for r in args.rates.split(",")):
            print(f"\n{workload} prompts at {rate} req/s")
            print(f"  {'formation':18s} {'policy':13s} {'att.':>7s} {'TTFT p99':>9s} "
                  f"{'TPOT p99':>9s} {'remote':>7s} {'KV p99':>8s}"
                  + (f" {'goodput/s':>10s} {'per $/h':>8s}" if args.goodput else ""))
            for formation in FORMATIONS[args.inventory]:
                raw = scenario(args.inventory, formation, workload, rate, args.duration,
                               args.seed)
                scn = parse_scenario(raw)
                t0 = time.perf_counter()
                doc = simulate(scn, [PolicyChoice(p) for p in raw["policies"]],
                               RunOptions(rate=rate, find_goodput=args.goodput))
                wall = time.perf_counter() - t0
                for policy, r in doc["results"].items():
                    pd = r.get("disaggregation", {})
                    line = (f"  {formation:18s} {policy:13s} {r['slo_attainment']:7.4f} "
                            f"{r['ttft_s']['p99']:9.3f} {r['tpot_s']['p99']:9.4f} "
                            f"{pd.get('remote_share', 0.0):7.2f} "
                            f"{pd.get('kv_transfer_s', {}).get('p99', 0.0):8.4f}")
                    if args.goodput:
                        g = r["max_goodput_rps"]
                        line += f" {g:10.2f} {g / dollars:8.3f}"
                    print(line)
                    rows.append({"workload": workload, "rate": rate, "formation": formation,
                                 "policy": policy, **r})
                print(f"  ({formation}: {wall:.1f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
