"""Real-trace shapes on mixed fleets (issue 42): attainment, tails, false detections.

Each production trace shape of :mod:`tailguard.traffic.shapes` (Mooncake's
conversation trace, Azure 2023 code and conversation, BurstGPT; generated to
their published statistics, cited there) is written in its own file format,
read back through the simulator's trace reader, and replayed on a mixed fleet
at 0.6, 0.8 and 1.2 of the fleet's capacity bound (``arrival: {process:
trace, load: X}``: the trace's rate scaled, its bursts kept), with and without
one node of the strongest class throttled to half speed for the middle third.
For each policy it prints attainment, TTFT and TPOT p99, the detector's
degradations and quarantines of healthy nodes ("false") and the throttled
node's time to detection.

    python benchmarks/traces.py [--shapes mooncake-conv,azure-code,...]
                                [--loads 0.6,0.8,1.2] [--policies tailguard,least_request]
                                [--duration 900] [--seed 1] [--json out.json]
                                [--fleet H100-SXM:1,A100-80GB:4,L4:4]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from tailguard.sim.cluster import RunRecord
from tailguard.sim.fleet_bound import fleet_bound
from tailguard.sim.run import simulate
from tailguard.sim.scenario import PolicyChoice, Scenario, parse_scenario
from tailguard.traffic.shapes import SHAPES, write_shape

# Each shape's fleet and SLO: the for the Mooncake and Azure traces.
SETUPS: dict[str, tuple[list[dict[str, Any]], dict[str, float]]] = {
    "mooncake-conv": ([{"gpu": "H100-SXM", "count": 4}, {"gpu": "A100-80GB", "count": 4},
                       {"gpu": "L4", "count": 4}], {"ttft_s": 5.0, "tpot_s": 0.15}),
    "azure-code": ([{"gpu": "H100-SXM", "count": 1}, {"gpu": "A100-80GB", "count": 2},
                    {"gpu": "L4", "count": 3}], {"ttft_s": 2.0, "tpot_s": 0.1}),
    "azure-conv": ([{"gpu": "H100-SXM", "count": 1}, {"gpu": "A100-80GB", "count": 2},
                    {"gpu": "L4", "count": 3}], {"ttft_s": 2.0, "tpot_s": 0.1}),
    "burstgpt": ([{"gpu": "H100-SXM", "count": 2}, {"gpu": "A100-80GB", "count": 2},
                  {"gpu": "L4", "count": 4}], {"ttft_s": 2.0, "tpot_s": 0.1}),
}
SUFFIX = {"azure": "csv", "burstgpt": "csv", "mooncake": "jsonl", "tailguard": "jsonl"}


def scenario(shape: str, trace: Path, load: float, policies: list[str], duration: float,
             seed: int, throttle: bool) -> Scenario:
    fleet, slo = SETUPS[shape]
    victim = f"{fleet[0]['gpu']}#0"
    raw = {
        "name": f"{shape}-{load}", "seed": seed, "model": "llama-3.1-8b", "slo": slo,
        "fleet": [dict(g, speed_spread=0.1) for g in fleet],
        "workload": {"duration_s": duration, "warmup_s": 60,
                     "arrival": {"process": "trace", "path": str(trace), "load": load}},
        "faults": [{"node": victim, "kind": "throttle", "factor": 0.5, "at_s": duration / 3,
                    "duration_s": duration / 3}] if throttle else [],
        "policies": policies,
    }
    return parse_scenario(raw)


def run(shape: str, trace: Path, load: float, policies: list[str], duration: float, seed: int,
        throttle: bool) -> dict[str, Any]:
    scn = scenario(shape, trace, load, policies, duration, seed, throttle)
    records: dict[str, RunRecord] = {}
    doc = simulate(scn, [PolicyChoice(p) for p in policies], records=records)
    out: dict[str, Any] = {"bound": doc["capacity_bound_rps"], "results": {}}
    for name, r in doc["results"].items():
        rep = r.get("outliers") or {}
        detect = [d["detected_s"] for d in rep.get("time_to_detect", [])
                  if d.get("detected_s") is not None]
        out["results"][name] = {
            "attainment": r["slo_attainment"], "ttft_p99": r["ttft_s"]["p99"],
            "tpot_p99": r["tpot_s"]["p99"], "false": rep.get("false_detections", 0),
            "false_quarantines": rep.get("false_quarantines", 0),
            "detected_s": detect[0] if detect else None, "requests": r["requests"],
            "idle_s": idle_after_fault(scn, records[name])}
    return out


def idle_after_fault(scn: Scenario, rec: RunRecord) -> float | None:
    """Seconds from the fault to the first request its node was given: the bursty
    traces have silent minutes, and no detector sees a throttle before the node
    has work (the time to detection counts from the fault)."""
    if not scn.faults:
        return None
    fault = scn.faults[0]
    if fault.node not in rec.node_ids:
        return None
    victim = rec.node_ids.index(fault.node)
    first = min((a for a, n in zip(rec.arrival, rec.node, strict=True)
                 if n == victim and a >= fault.at_s), default=None)
    return None if first is None else first - fault.at_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SETUPS))
    ap.add_argument("--loads", default="0.6,0.8,1.2")
    ap.add_argument("--policies", default="tailguard,least_request")
    ap.add_argument("--duration", type=float, default=900.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--fleet", help="every shape on this fleet instead of its own, as "
                    "GPU:COUNT[:TP],... (e.g. H100-SXM:1,A100-80GB:4,L4:4; the first group's "
                    "first node is the one throttled)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.fleet:
        groups = [part.split(":") for part in args.fleet.split(",")]
        fleet = [{"gpu": g[0], "count": int(g[1]), **({"tp": int(g[2])} if len(g) > 2 else {})}
                 for g in groups]
        for shape, (_, slo) in SETUPS.items():
            SETUPS[shape] = (fleet, slo)
    policies = args.policies.split(",")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        loads = [float(x) for x in args.loads.split(",")]
        for shape in args.shapes.split(","):
            spec = SHAPES[shape]
            trace = Path(tmp) / f"{shape}.{SUFFIX[spec.fmt]}"
            # The fleet's bound on the shape's lengths, then a trace long enough to
            # span the run at the highest load once its rate is scaled to it.
            write_shape(trace, spec.generate(3600.0, seed=args.seed), spec.fmt)
            bound = fleet_bound(scenario(shape, trace, 1.0, policies, args.duration, args.seed,
                                         False)).bound
            span = args.duration * max(loads) * bound / spec.rate * 1.3
            write_shape(trace, spec.generate(max(span, args.duration), seed=args.seed), spec.fmt)
            for load in loads:
                for throttle in (False, True):
                    t0 = time.time()
                    res = run(shape, trace, load, policies, args.duration, args.seed, throttle)
                    for pol, r in res["results"].items():
                        row = {"shape": shape, "load": load, "throttle": throttle,
                               "policy": pol, "bound_rps": res["bound"], **r}
                        rows.append(row)
                        det = "-" if r["detected_s"] is None else f"{r['detected_s']:.0f} s"
                        if r["idle_s"] is not None:
                            det += f" (node idle {r['idle_s']:.0f} s)"
                        print(f"{shape:14s} load {load:.1f} {'throttle' if throttle else 'healthy ':8s}"
                              f" {pol:14s} bound {res['bound']:6.2f} req/s  {r['requests']:6d} req"
                              f"  att {r['attainment']:.3f}"
                              f"  TTFT p99 {r['ttft_p99']:7.2f} s  TPOT p99 {r['tpot_p99']:.3f} s"
                              f"  false {r['false']:3d} (quarantines {r['false_quarantines']})"
                              f"  detected {det}  ({time.time() - t0:.0f} s)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
