"""Replica formation from a mixed inventory (issue 16): the planner against naive formations.

Each case draws an inventory (2-4 hosts of GPU types from the catalog, 1-8
GPUs each, NVLink or PCIe where the card allows), a model and a TPOT SLO
from a seed, so the inventories are not chosen by hand. For each formation
the SLO goodput (the highest Poisson rate at 90% attainment, TTFT 2 s,
azure-conv lengths) is measured in the simulator behind the tailguard policy,
and divided by the formation's $/h:

* planned, per-dollar: ``tailguard plan --inventory`` as it comes;
* planned, goodput: ``--objective goodput`` (every GPU that adds goodput);
* one replica per GPU (TP-1 wherever the model fits);
* TP across types (the GPUs in order, in TP groups of the smallest degree
  that fits on all, across hosts and types).

Prints what it measured, and per case the planned/best-naive ratio of
goodput per dollar, with the ceiling the ratings set: a fleet's rated goodput
per dollar is its replicas' ratios averaged by cost, so no formation rates
above the inventory's best shape, and best shape / naive bounds the ratio any
formation can reach.

    python benchmarks/formation.py [--cases 6] [--seed 1] [--duration 90] [--only K]
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from tailguard.core.hardware import DEFAULT_CATALOG
from tailguard.core.policies import Slo
from tailguard.planner.formation import (
    Formation,
    Rater,
    plan_formation,
)
from tailguard.planner.inventory import NVLINK_MIN_GBPS, parse_inventory
from tailguard.planner.naive import one_per_gpu, tp_across_types
from tailguard.planner.verify import base_scenario, measured_goodput

GPUS = ("H200", "H100-SXM", "H100-PCIe", "A100-80GB", "A100-40GB", "L40S", "A10G", "L4", "T4")
MODELS = ("llama-3.1-8b", "qwen2.5-32b", "llama-3.1-70b")
TPOTS = (0.05, 0.08, 0.1)


def draw(rng: random.Random) -> tuple[dict[str, Any], str, float]:
    hosts = []
    for i in range(rng.randint(2, 4)):
        gpu = DEFAULT_CATALOG.gpu(rng.choice(GPUS))
        host: dict[str, Any] = {"name": f"n{i}", "gpu": gpu.name,
                                "count": rng.choice((1, 2, 4, 8))}
        if gpu.interconnect_gbps > NVLINK_MIN_GBPS:
            host["link"] = rng.choice(("nvlink", "pcie"))
        hosts.append(host)
    return {"hosts": hosts}, rng.choice(MODELS), rng.choice(TPOTS)


def row(name: str, f: Formation, base: Any) -> float:
    g = measured_goodput(f, base, 0.9)
    cost = f.cost_per_hour
    ratio = g / cost if cost > 0 else 0.0
    shapes: dict[str, int] = {}
    for r in f.replicas:
        shapes[r.rated.shape.name] = shapes.get(r.rated.shape.name, 0) + 1
    print(f"  {name:<22} {g:8.2f} req/s  {f.gpus:3d} GPUs ${cost:7.2f}/h  {ratio:6.3f} req/s per $/h"
          f"  {', '.join(f'{n}x {s}' for s, n in shapes.items()) or '-'}")
    return ratio


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=6)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--duration", type=float, default=90.0)
    ap.add_argument("--only", type=int, action="append",
                    help="run only this case of the seed's draws (repeatable)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    summary = []
    for case in range(args.cases):
        raw, model_name, tpot = draw(rng)
        if args.only and case not in args.only:
            continue
        inv = parse_inventory(raw)
        model = DEFAULT_CATALOG.model(model_name)
        base = base_scenario(model.name, Slo(2.0, tpot, 0.9), inv.catalog(),
                             duration_s=args.duration)
        rater = Rater(base, model, 1155.0, 211.0, inv.gpu_counts())
        hosts = ", ".join(f"{h.count}x{h.gpu.name}" for h in inv.hosts)
        print(f"case {case}: {model.name}, TPOT {tpot:g} s; {hosts}")
        t0 = time.perf_counter()
        plan = plan_formation(inv, rater)
        planning = time.perf_counter() - t0
        mine = row("planned, per-dollar", plan, base)
        row("planned, goodput", plan_formation(inv, rater, objective="goodput"), base)
        naives = (one_per_gpu(inv, rater), tp_across_types(inv, rater, model))
        naive = max(row(f.name, f, base) for f in naives)
        verdict = (f"{mine / naive:.2f}x" if naive > 0.01 * mine else
                   "naive serves nothing" if naive == 0 else "naive serves under 1%")
        if mine == 0:
            verdict = "nothing meets the SLO"
        print(f"  planned / best naive goodput per dollar: {verdict} (planning {planning:.1f} s)")
        # By the ratings alone: how far any formation could get above the naive one.
        top, rated_naive = plan.ceiling, max(f.rated_ratio for f in naives)
        if top is not None and rated_naive > 0:
            print(f"  by the ratings: planned {plan.rated_ratio:.3f}, best naive {rated_naive:.3f}, "
                  f"best shape {top.shape.name} {top.ratio:.3f} req/s per $/h: no formation "
                  f"rates above {top.ratio / rated_naive:.2f}x the naive one")
            verdict += f" (at most {top.ratio / rated_naive:.2f}x)"
        summary.append(verdict)
    print("summary:", ", ".join(summary))


if __name__ == "__main__":
    main()
