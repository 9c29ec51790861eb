"""Long-prompt overloads: how much of the load each router still serves within the SLO.

Mixed fleets serving lognormal long prompts (means 5-15k tokens) at and past
their capacity bound (``sim/fleet_bound.py``), Poisson or Gamma arrivals, each
run by the simulator with the ``tailguard`` policy as shipped (the least
predicted SLO miss wins however large), the same with its overload spill
(``spill_excess: 0.5``) and ``least_request``. It prints each run's SLO attainment and
TTFT / TPOT p99, and with ``--goodput`` each router's goodput at attainment
0.99 (``sim.run.find_goodput``) against the bound. Nothing is asserted.

    python benchmarks/overload.py [--cases 0,1,2] [--loads 0.8,0.9,1.0,1.1]
                                  [--duration 1200] [--seed 11] [--goodput]
                                  [--engine '{"long_prefill_token_threshold": 1024}']
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from tailguard.core.policies.tailguard_options import TailguardOptions
from tailguard.sim.capacity import fleet_capacity
from tailguard.sim.fleet_bound import fleet_bound
from tailguard.sim.run import find_goodput, simulate
from tailguard.sim.scenario import PolicyChoice, parse_scenario


def fleet(*groups: tuple[str, int]) -> list[dict[str, Any]]:
    return [{"gpu": gpu, "count": n} for gpu, n in groups]


# (fleet, prompt lognormal mu and sigma, SLO TTFT s and TPOT s, arrival extras):
# the long-prompt cases of the split capacity bound (benchmarks/README.md).
CASES = [
    (fleet(("H100-SXM", 4), ("A100-80GB", 4), ("L4", 4)), 9.1, 0.9, 5.0, 0.15, {}),
    (fleet(("H100-SXM", 4), ("A100-80GB", 4), ("L4", 4)), 9.0, 0.9, 5.0, 0.15, {}),
    (fleet(("H100-SXM", 2), ("A100-80GB", 4), ("L4", 6)), 9.0, 0.8, 5.0, 0.10, {}),
    (fleet(("H100-SXM", 3), ("A100-40GB", 3), ("L40S", 3)), 8.5, 1.0, 3.0, 0.10,
     {"process": "gamma", "cv": 2.0}),
    (fleet(("H100-SXM", 1), ("A100-80GB", 2), ("L40S", 2), ("L4", 4)), 8.8, 0.8, 6.0, 0.15, {}),
    (fleet(("H100-SXM", 2), ("A100-80GB", 4), ("L4", 6)), 8.0, 1.0, 2.0, 0.08,
     {"process": "gamma", "cv": 1.5}),
    (fleet(("H100-SXM", 4), ("A100-80GB", 4), ("L4", 4)), 9.3, 0.7, 8.0, 0.12, {}),
]

CHOICES = [PolicyChoice("tailguard"),
           PolicyChoice("tailguard", TailguardOptions(spill_excess=0.5)),
           PolicyChoice("least_request")]


def scenario(case: int, rate: float | None, duration: float, seed: int,
             engine: dict[str, Any] | None = None) -> dict[str, Any]:
    groups, mu, sigma, ttft, tpot, arrival = CASES[case]
    if engine:
        groups = [{**g, "engine": engine} for g in groups]
    return {
        "name": f"overload-{case}", "seed": seed, "model": "llama-3.1-8b",
        "slo": {"ttft_s": ttft, "tpot_s": tpot}, "fleet": groups,
        "workload": {
            "duration_s": duration, "warmup_s": 60,
            "arrival": {"process": "poisson", **arrival,
                        **({"rate": rate} if rate is not None else {"load": 0.8})},
            "input_tokens": {"dist": "lognormal", "mu": mu, "sigma": sigma, "max": 120_000},
            "output_tokens": {"dist": "lognormal", "mu": 5.5, "sigma": 0.8, "max": 2000}},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(str(i) for i in range(len(CASES))))
    ap.add_argument("--loads", default="0.8,0.9,1.0,1.1",
                    help="offered rates as shares of each fleet's capacity bound")
    ap.add_argument("--duration", type=float, default=1200.0)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--goodput", action="store_true",
                    help="also each router's goodput at attainment 0.99 (slow)")
    ap.add_argument("--engine", type=json.loads, default=None, metavar="JSON",
                    help='every node\'s engine settings, e.g. \'{"long_prefill_token_threshold": '
                         '1024}\' (default: vLLM\'s)')
    args = ap.parse_args()
    loads = [float(x) for x in args.loads.split(",") if x]
    for case in (int(c) for c in args.cases.split(",")):
        base = parse_scenario(scenario(case, None, args.duration, args.seed, args.engine))
        bound = fleet_bound(base).bound
        groups = ", ".join(f"{g['count']} {g['gpu']}" for g in CASES[case][0])
        print(f"case {case}: {groups}; bound {bound:.2f} req/s", flush=True)
        for load in loads:
            t0 = time.time()
            doc = simulate(parse_scenario(scenario(case, load * bound, args.duration, args.seed,
                                                   args.engine)), CHOICES)
            cells = [f"{c.label} {r['slo_attainment']:.3f} ({r['ttft_s']['p99']:.1f} / "
                     f"{r['tpot_s']['p99']:.3f} s)"
                     for c in CHOICES for r in [doc["results"][c.label]]]
            print(f"  load {load:.2f}: attainment (TTFT / TPOT p99)  " + "  ".join(cells)
                  + f"  [{time.time() - t0:.0f} s]", flush=True)
        if args.goodput:
            capacity = fleet_capacity(base)
            cells = []
            for c in CHOICES:
                g = find_goodput(base, c, capacity, bound, 0.99)
                cells.append(f"{c.label} {g:.2f} ({g / bound:.2f} of the bound)")
            print("  goodput at 0.99: " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
