"""How fast the simulator runs: a one-hour trace over 64 nodes, one policy.

Goal (issue 2): >= 200,000 requests over 64 nodes in one simulated hour in
<= 60 s on a 2-core machine. Prints what it measured; asserts nothing.

    python benchmarks/sim_speed.py [--policy tailguard] [--requests 200000]
"""

from __future__ import annotations

import argparse
import time

from tailguard.sim.capacity import fleet_capacity
from tailguard.sim.run import make_requests, run_policy
from tailguard.sim.scenario import PolicyChoice, parse_scenario

FLEETS: dict[str, list[dict[str, object]]] = {
    # 64 modern nodes: 200k requests an hour is light work for them (many idle gaps).
    "big": [
        {"gpu": "H100-SXM", "count": 16},
        {"gpu": "A100-80GB", "count": 24},
        {"gpu": "L40S", "count": 8},
        {"gpu": "L4", "count": 16},
    ],
    # 64 mostly weak nodes: the same requests keep every node busy and batched.
    "loaded": [
        {"gpu": "H100-SXM", "count": 2},
        {"gpu": "A100-80GB", "count": 2},
        {"gpu": "L4", "count": 60},
    ],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--policy", default="tailguard")
    ap.add_argument("--requests", type=int, default=200_000)
    ap.add_argument("--duration", type=float, default=3600.0)
    ap.add_argument("--fleet", choices=sorted(FLEETS), default="big")
    args = ap.parse_args()
    rate = args.requests / args.duration
    scn = parse_scenario({
        "name": "sim-speed", "seed": 1, "model": "llama-3.1-8b",
        "slo": {"ttft_s": 2.0, "tpot_s": 0.1}, "network_rtt_s": 0.001, "fleet": FLEETS[args.fleet],
        "workload": {"duration_s": args.duration, "warmup_s": 60,
                     "arrival": {"process": "poisson", "rate": rate},
                     "input_tokens": {"dist": "azure-conv"},
                     "output_tokens": {"dist": "azure-conv"}},
    })
    t0 = time.perf_counter()
    capacity = fleet_capacity(scn)
    t1 = time.perf_counter()
    reqs = make_requests(scn, rate)
    t2 = time.perf_counter()
    res = run_policy(scn, PolicyChoice(args.policy), reqs, capacity, rate)
    t3 = time.perf_counter()
    nodes = sum(int(g["count"]) for g in FLEETS[args.fleet])
    print(f"fleet: {nodes} nodes, capacity bound {sum(capacity.values()):.1f} req/s, "
          f"offered {rate:.1f} req/s ({rate / sum(capacity.values()):.2f} of the bound)")
    print(f"requests: {len(reqs)} over {args.duration:.0f} simulated s, policy {args.policy}")
    print(f"capacity search: {t1 - t0:.2f} s   workload: {t2 - t1:.2f} s   "
          f"simulation: {t3 - t2:.2f} s   ({len(reqs) / (t3 - t2):,.0f} requests/s)")
    print(f"total: {t3 - t0:.2f} s   SLO attainment {res['slo_attainment']:.4f}, "
          f"TTFT p99 {res['ttft_s']['p99']:.3f} s")
    try:  # (an older tree, run for comparison, may have no compiled modules at all)
        from tailguard import _compiled
        compiled = _compiled.loaded()
    except (ImportError, AttributeError):
        return
    print(f"hot paths compiled: {len(compiled)} of {len(_compiled.MODULES)} modules"
          + ("" if compiled else " (make compile)"))


if __name__ == "__main__":
    main()
