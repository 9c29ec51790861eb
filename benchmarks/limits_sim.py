"""Concurrency limits and the admission queue in the simulator, on generated mixed fleets.

For each fleet (drawn here, not a shipped scenario) and load, runs the same
requests through the ``tailguard`` policy without limits and with
``limits: {kind: gradient}`` + ``admission: {}``, and prints goodput, the
per-GPU-class P99 TPOT of admitted requests against the SLO, shedding, and
(with priorities) each class's attainment. Asserts nothing.

    python benchmarks/limits_sim.py [--loads 0.8,1.3] [--duration 300] [--kinds gradient,aimd]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from tailguard.core.hardware import DEFAULT_CATALOG
from tailguard.planner.plan import plan_groups
from tailguard.sim.admission_report import admission_report
from tailguard.sim.cluster import RunRecord
from tailguard.sim.results import compute_result
from tailguard.sim.run import simulate
from tailguard.sim.scenario import PolicyChoice, parse_scenario

FLEETS: dict[str, list[dict[str, Any]]] = {
    "mixed-a": [{"gpu": "H100-SXM", "count": 2}, {"gpu": "A100-80GB", "count": 3},
                {"gpu": "L4", "count": 6}],
    "mixed-b": [{"gpu": "H100-SXM", "count": 1}, {"gpu": "A100-40GB", "count": 4},
                {"gpu": "L40S", "count": 2}, {"gpu": "A10", "count": 4}],
}


def scenario(fleet: str, load: float, duration: float, kind: str | None,
             priorities: bool, seed: int, limit_opts: dict[str, Any],
             planned_engines: bool = False) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "name": f"{fleet}-{load}", "seed": seed, "model": "llama-3.1-8b",
        "slo": {"ttft_s": 1.0, "tpot_s": 0.1}, "network_rtt_s": 0.001,
        "fleet": [dict(g) for g in FLEETS[fleet]],
        "workload": {"duration_s": duration, "warmup_s": min(60.0, duration / 5),
                     "arrival": {"process": "poisson", "load": load},
                     "input_tokens": {"dist": "azure-conv"},
                     "output_tokens": {"dist": "azure-conv"}},
    }
    if planned_engines:
        # The plan's chunked-prefill budget per GPU type (`tailguard plan`),
        # for both runs: a weak GPU's steps must not carry 2048-token chunks.
        model = DEFAULT_CATALOG.model("llama-3.1-8b")
        groups = [(DEFAULT_CATALOG.gpu(g["gpu"]), 1, g["count"]) for g in FLEETS[fleet]]
        for g, p in zip(raw["fleet"], plan_groups(groups, model, 0.1, 1155.0, 211.0),
                        strict=True):
            g["engine"] = {"max_num_batched_tokens": p.max_num_batched_tokens}
    if priorities:
        raw["workload"]["priorities"] = {"high": 0.2, "normal": 0.6, "low": 0.2}
    if kind is not None:
        raw["limits"] = {"kind": kind, **limit_opts}
        raw["admission"] = {"queue_max": 512}
    return raw


def whole_run(rec: RunRecord, scn: Any, res: dict[str, Any]) -> dict[str, Any]:
    """Goodput, attainment and per-priority attainment from t = 0 (no warm-up exclusion)."""
    gpu_of = {p.id: p.perf.gpu.name for p in scn.nodes()}
    dur = scn.workload.duration_s
    full = compute_result(rec, slo=scn.slo, warmup_s=0.0, duration_s=dur,
                          offered_rps=res["offered_rps"], gpu_of=gpu_of, capacity_by_gpu={})
    adm = admission_report(rec, slo=scn.slo, warmup_s=0.0, duration_s=dur, gpu_of=gpu_of)
    out = {"goodput_rps": full["goodput_rps"], "slo_attainment": full["slo_attainment"]}
    if "per_priority" in adm:
        out["per_priority"] = {k: v["slo_attainment"] for k, v in adm["per_priority"].items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--fleets", default="mixed-a,mixed-b")
    ap.add_argument("--loads", default="0.8,1.3")
    ap.add_argument("--kinds", default="gradient")
    ap.add_argument("--duration", type=float, default=300.0)
    ap.add_argument("--priorities", action="store_true")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--limit-opts", default="{}", help='extra limits keys as JSON')
    ap.add_argument("--planned-engines", action="store_true",
                    help="give each GPU type the plan's chunked-prefill token budget")
    ap.add_argument("--json")
    args = ap.parse_args()
    out: list[dict[str, Any]] = []
    for fleet in args.fleets.split(","):
        for load in (float(x) for x in args.loads.split(",")):
            row: dict[str, Any] = {"fleet": fleet, "load": load}
            for kind in [None, *args.kinds.split(",")]:
                t0 = time.perf_counter()
                scn = parse_scenario(scenario(fleet, load, args.duration, kind, args.priorities,
                                              args.seed, json.loads(args.limit_opts),
                                              args.planned_engines))
                records: dict[str, RunRecord] = {}
                doc = simulate(scn, [PolicyChoice("tailguard")], records=records)
                res = doc["results"]["tailguard"]
                res["whole_run"] = whole_run(records["tailguard"], scn, res)
                slo_tpot = doc["slo"]["tpot_s"]
                label = kind or "none"
                row[label] = res
                tpot = {g: round(v["tpot_p99_s"] / slo_tpot, 3) for g, v in res["per_gpu"].items()}
                print(f"{fleet} load {load} limits {label:8s} goodput {res['goodput_rps']:7.2f} "
                      f"att {res['slo_attainment']:.3f} shed {res.get('shed', 0):5d} "
                      f"ttft p99 {res['ttft_s']['p99']:7.2f} tpot p99/SLO by class {tpot} "
                      f"({time.perf_counter() - t0:.1f} s)", flush=True)
                if "limits" in res:
                    print("    final limits:", res["limits"], " queue_s p99:",
                          res["queue_s"]["p99"])
                if "per_priority" in res:
                    print("    per priority:", res["per_priority"])
                whole = res["whole_run"]
                print(f"    whole run (no warm-up exclusion): goodput {whole['goodput_rps']:.2f}"
                      f" att {whole['slo_attainment']:.3f}"
                      + (f" per priority {whole['per_priority']}" if "per_priority" in whole
                         else ""))
            base = row["none"]["goodput_rps"]
            for kind in args.kinds.split(","):
                ratio = row[kind]["goodput_rps"] / base if base else float("inf")
                print(f"  => {kind}: goodput x{ratio:.2f} vs no limits")
            out.append(row)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
