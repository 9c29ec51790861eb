"""The simulator's speed against a pinned older tree, side by side, so a slow drift shows.

Each change can be within noise of the tree just before it while many of them
together compound. This runs one fixed scenario (by default 64 nodes: 16 H100,
24 A100, 24 L4; one simulated hour of Poisson arrivals at 58 req/s, ~210k
requests; the ``tailguard`` policy) under the working tree and under a pinned
commit checked out in a git worktree, alternating the two, each in a fresh
process. It prints each run's simulation time (the capacity search and the
workload draw are timed apart), the medians and their ratio, and whether the two
trees' results agree (SLO attainment and TTFT p99; the full result's digest is
printed too). It asserts nothing.

    python benchmarks/sim_drift.py                      # against the pinned tree
    python benchmarks/sim_drift.py --base HEAD~5 --rounds 3 --duration 900
    python benchmarks/sim_drift.py --fleet big          # sim_speed.py's fleet

The pinned tree (``PINNED``) is the last one whose speed was recorded as a
reference (`benchmarks/README.md`, "sim_drift.py"). Needs git and the
repository's history. The working tree runs as installed, its hot paths
compiled (``make compile``); a worktree has no extensions, so the base always
runs from source: ``--base HEAD`` then times compiled against source on the
same code, and its digests say whether the two agree.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PINNED = "1b50ad9"
ROOT = Path(__file__).resolve().parent.parent

FLEETS: dict[str, list[dict[str, object]]] = {
    "issue": [
        {"gpu": "H100-SXM", "count": 16},
        {"gpu": "A100-80GB", "count": 24},
        {"gpu": "L4", "count": 24},
    ],
    "big": [  # sim_speed.py's default
        {"gpu": "H100-SXM", "count": 16},
        {"gpu": "A100-80GB", "count": 24},
        {"gpu": "L40S", "count": 8},
        {"gpu": "L4", "count": 16},
    ],
}

# Run in a child process against either tree: only APIs both trees have.
_CHILD = r"""
import hashlib, json, sys, time
from tailguard.sim.capacity import fleet_capacity
from tailguard.sim.run import make_requests, run_policy
from tailguard.sim.scenario import PolicyChoice, parse_scenario
spec = json.loads(sys.argv[1])
scn = parse_scenario(spec["scenario"])
t0 = time.perf_counter()
capacity = fleet_capacity(scn)
t1 = time.perf_counter()
reqs = make_requests(scn, spec["rate"])
t2 = time.perf_counter()
res = run_policy(scn, PolicyChoice(spec["policy"]), reqs, capacity, spec["rate"])
t3 = time.perf_counter()
print(json.dumps({
    "requests": len(reqs), "capacity_s": t1 - t0, "workload_s": t2 - t1, "sim_s": t3 - t2,
    "attainment": res["slo_attainment"], "ttft_p99": res["ttft_s"]["p99"],
    "digest": hashlib.sha1(json.dumps(res, sort_keys=True, default=str).encode()).hexdigest()[:12],
}))
"""


def scenario(fleet: str, rate: float, duration: float) -> dict[str, object]:
    return {
        "name": "sim-drift", "seed": 1, "model": "llama-3.1-8b",
        "slo": {"ttft_s": 2.0, "tpot_s": 0.1}, "network_rtt_s": 0.001, "fleet": FLEETS[fleet],
        "workload": {"duration_s": duration, "warmup_s": min(60.0, duration / 10),
                     "arrival": {"process": "poisson", "rate": rate},
                     "input_tokens": {"dist": "azure-conv"},
                     "output_tokens": {"dist": "azure-conv"}},
    }


def run_child(src: Path, spec: dict[str, object]) -> dict[str, object]:
    env = dict(os.environ, PYTHONPATH=str(src))
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(spec)], env=env,
                         capture_output=True, text=True, check=True, cwd=src.parent)
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default=PINNED, help=f"the older tree (default {PINNED})")
    ap.add_argument("--rounds", type=int, default=2, help="alternating pairs (default 2)")
    ap.add_argument("--rate", type=float, default=58.0, help="requests per second")
    ap.add_argument("--duration", type=float, default=3600.0, help="simulated seconds")
    ap.add_argument("--fleet", choices=sorted(FLEETS), default="issue")
    ap.add_argument("--policy", default="tailguard")
    args = ap.parse_args()
    spec = {"scenario": scenario(args.fleet, args.rate, args.duration), "rate": args.rate,
            "policy": args.policy}
    tmp = Path(tempfile.mkdtemp(prefix="sim-drift-"))
    base = tmp / "base"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base),
                    args.base], check=True, capture_output=True)
    trees = {"base": base / "src", "this": ROOT / "src"}
    times: dict[str, list[float]] = {"base": [], "this": []}
    results: dict[str, dict[str, object]] = {}
    try:
        for r in range(args.rounds):
            order = ("base", "this") if r % 2 == 0 else ("this", "base")
            for name in order:
                res = run_child(trees[name], spec)
                times[name].append(float(res["sim_s"]))  # type: ignore[arg-type]
                results[name] = res
                print(f"round {r + 1} {name:4s}: simulation {res['sim_s']:.2f} s, capacity "
                      f"search {res['capacity_s']:.2f} s, {res['requests']} requests, "
                      f"attainment {res['attainment']:.4f}, TTFT p99 {res['ttft_p99']:.4f} s, "
                      f"digest {res['digest']}", flush=True)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)],
                       check=False, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    mb, mt = statistics.median(times["base"]), statistics.median(times["this"])
    same = results["base"]["digest"] == results["this"]["digest"]
    print(f"\nbase {args.base}: median {mb:.2f} s; this tree: median {mt:.2f} s; "
          f"this/base {mt / mb:.2f}x; results "
          + ("identical (same digest)" if same else
             "differ (expected where behaviour changed since the base; compare with "
             "--base HEAD for a change meant to keep every decision)"))


if __name__ == "__main__":
    main()
