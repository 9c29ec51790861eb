"""Straggler detection and quarantine (issue 5), measured on generated fleets.

Named runs (each prints one line per case and a verdict against the issue's
target; nothing here is tuned to the shipped scenarios: fleets, seeds and the
faulted node are generated from ``--seed``):

* ``throttle-detect``: one random node of a random mixed fleet throttled to
  40% at t=120 s (odd cases: any node; even cases: an H100/A100); time until
  it is degraded or quarantined (target <= 15 s).
* ``healthy-hour``: one simulated hour at load 0.8 on a healthy H100/A100/L4/T4
  fleet with +-10% card-to-card spread; quarantines and degradations
  (target: zero).
* ``incident``: the throttle incident's P99 TTFT against the same run without
  the fault, with detection on and off (target: on <= 1.25 x no-fault; off
  measurably worse), and an *oracle*: the same fleet, requests and offered rate
  where the victim runs at the fault's speed from t=0 and is the only card of
  its own GPU class (a copy of its GPU under ``<gpu>-oracle``), so the router
  prices it by its own learned slowdowns from the start, with detection off:
  the best the policy can do knowing the fault. P99s are over the whole
  measured window (60-420 s; the fault covers 120-360 s) and, as "window",
  over the requests that arrived during the fault. When detection-on misses
  the target, the oracle fleet is also run with a TTFT-first router
  (``ttft_weight`` 1000: TPOT only has to keep its SLO): if even that stays
  above 1.25x, the case is a capacity limit (the fleet runs at ~94% of what is
  left), not a detection or learning lag.
* ``stalls``: half of the H100/A100 nodes of a compact fleet pause 2 s every 10 s
  (staggered); P99 and P99.9 TTFT with hedging off and on (target: the P99.9,
  where the requests a stall holds sit once the router sees it, >= 2x lower for
  <= 5% extra requests).

    python benchmarks/stragglers.py [--runs throttle-detect,healthy-hour,incident,stalls]
                                    [--seed 1] [--cases 4] [--only 1,4] [--hour-s 3600]
                                    [--engine-priority -1]  (migration)
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from typing import Any

import numpy as np

from tailguard.core.hardware import DEFAULT_CATALOG
from tailguard.core.policies.tailguard_options import TailguardOptions
from tailguard.sim.cluster import RunRecord
from tailguard.sim.run import simulate
from tailguard.sim.scenario import PolicyChoice, parse_scenario

GPUS = ("H100-SXM", "A100-80GB", "L4", "T4")


def fleet(rng: random.Random, spread: float = 0.1) -> list[dict[str, Any]]:
    """A mixed fleet with every class present, 2-6 nodes each."""
    return [{"gpu": g, "count": rng.randint(2, 6), "speed_spread": spread} for g in GPUS]


def scenario(seed: int, groups: list[dict[str, Any]], duration: float, faults: list[Any],
             outliers: bool = True, load: float = 0.8, hedging: bool = False) -> dict[str, Any]:
    return {
        "name": f"gen-{seed}", "seed": seed, "model": "llama-3.2-3b",
        "slo": {"ttft_s": 2.0, "tpot_s": 0.1}, "network_rtt_s": 0.001, "fleet": groups,
        "workload": {"duration_s": duration, "warmup_s": 60,
                     "arrival": {"process": "poisson", "load": load},
                     "input_tokens": {"dist": "azure-conv"},
                     "output_tokens": {"dist": "azure-conv"}},
        "faults": faults, "outliers": {"enabled": outliers}, "hedging": {"enabled": hedging},
    }


def node_ids(groups: list[dict[str, Any]]) -> list[str]:
    return [f"{g['gpu']}#{i}" for g in groups for i in range(int(g["count"]))]


def run(raw: dict[str, Any], window: tuple[float, float] | None = None,
        options: TailguardOptions | None = None,
        records: dict[str, RunRecord] | None = None) -> dict[str, Any]:
    """The tailguard policy's result (with policy ``options``); with ``window``,
    also the TTFT P99 and P99.9 of the requests that arrived in it
    (``window_ttft_p99_s``, ``window_ttft_p999_s``) and how many of them waited
    over a second for their first token (``window_over_1s``). ``records``: gets the
    per-request arrays, under "tailguard"."""
    records = {} if records is None else records
    choice = PolicyChoice("tailguard", options)
    out = simulate(parse_scenario(raw), [choice], records=records)
    res: dict[str, Any] = out["results"][choice.label]
    if window is not None:
        rec = records[choice.label]
        arr = np.asarray(rec.arrival)
        first = np.asarray(rec.first)
        sel = (arr >= window[0]) & (arr < window[1])
        # As in the result: a request still without a first token counts its wait so far.
        ttft = np.where(first >= 0.0, first - arr, rec.end_time - arr)[sel]
        res["window_ttft_p99_s"] = float(np.percentile(ttft, 99)) if ttft.size else 0.0
        res["window_ttft_p999_s"] = float(np.percentile(ttft, 99.9)) if ttft.size else 0.0
        res["window_over_1s"] = int((ttft > 1.0).sum())
    return res


def oracle_fleet(groups: list[dict[str, Any]], victim: str) -> tuple[list[dict[str, Any]], str]:
    """The fleet with ``victim`` as the only card of its own GPU class (same specs).

    The group is split in place (the nodes keep their order, so every card keeps
    the speed the seed draws for it); the victim's copy of its GPU gets the name
    ``<gpu>-oracle``. Returns the new groups and the victim's new node id.
    """
    gpu, index = victim.split("#")
    out: list[dict[str, Any]] = []
    for g in groups:
        if g["gpu"] != gpu:
            out.append(g)
            continue
        i = int(index)
        before, after = i, int(g["count"]) - i - 1
        if before:
            out.append({**g, "count": before})
        out.append({**g, "gpu": f"{gpu}-oracle", "count": 1})
        if after:
            out.append({**g, "count": after})
    return out, f"{gpu}-oracle#0"


def oracle_catalog(gpu_name: str) -> dict[str, Any]:
    """A catalog entry that copies ``gpu_name``'s specs under ``<gpu>-oracle``."""
    g = DEFAULT_CATALOG.gpu(gpu_name)
    return {"gpus": [{"name": f"{g.name}-oracle", "tflops": g.tflops,
                      "mem_bw_gbps": g.mem_bw_gbps, "mem_gb": g.mem_gb, "tdp_w": g.tdp_w,
                      "price_per_hour": g.price_per_hour,
                      "interconnect_gbps": g.interconnect_gbps}]}


def throttle_detect(seed: int, cases: int) -> list[dict[str, Any]]:
    rows = []
    for c in range(cases):
        rng = random.Random(f"{seed}:throttle:{c}")
        groups = fleet(rng)
        # Every other case draws from all nodes (an idle class's throttle can be
        # neither seen nor felt), the others from the H100/A100s that carry traffic.
        pool = node_ids(groups) if c % 2 else [
            n for n in node_ids(groups) if not n.startswith(("L4", "T4"))]
        victim = rng.choice(pool)
        res = run(scenario(seed * 100 + c, groups, 300,
                           [{"node": victim, "kind": "throttle", "factor": 0.4, "at_s": 120}]))
        det = res["outliers"]["time_to_detect"][0]
        # A class the router leaves idle (fast cards suffice) gives no samples: its
        # throttle can be neither seen nor felt.
        share = res["per_gpu"][victim.split("#")[0]]["share"]
        rows.append({"case": c, "victim": victim, "detected_s": det["detected_s"],
                     "state": det["state"], "false": res["outliers"]["false_detections"],
                     "class_share": share})
        ok = det["detected_s"] is not None and det["detected_s"] <= 15.0
        verdict = "OK" if ok else ("n/a: class idle" if share < 0.01 else "MISS")
        print(f"throttle-detect case {c}: {victim} (class share {share:.3f}) -> {det['state']} "
              f"after {det['detected_s']} s; false detections {rows[-1]['false']}  {verdict}",
              flush=True)
    return rows


def healthy_hour(seed: int, hour_s: float) -> dict[str, Any]:
    groups = [{"gpu": g, "count": c, "speed_spread": 0.1}
              for g, c in zip(GPUS, (2, 3, 5, 4), strict=True)]
    t0 = time.perf_counter()
    records: dict[str, RunRecord] = {}
    res = run(scenario(seed, groups, hour_s, []), records=records)
    wall = time.perf_counter() - t0
    ev = [e for e in res["events"] if e["state"] in ("degraded", "quarantined")]
    rec = records["tailguard"]
    moves = sum(rec.moves.values())
    gaps = np.asarray([g for g in rec.gaps if math.isfinite(g)])
    over = {f">{t:g}s": int((gaps > t).sum()) for t in (0.25, 0.5, 1.0)}
    print(f"healthy-hour: {hour_s:g} simulated s, {res['requests']} requests, "
          f"{len(ev)} degradations/quarantines, {moves} migrations, TTFT p99 "
          f"{res['ttft_s']['p99']:.3f} s; streams whose longest gap was {over} "
          f"({wall:.0f} s wall)  {'OK' if not ev and not moves else 'FAIL'}", flush=True)
    return {"requests": res["requests"], "bad_events": ev, "ttft_p99_s": res["ttft_s"]["p99"],
            "migrations": moves, "longest_gaps_over": over, "wall_s": round(wall, 1)}


FAULT_AT_S, FAULT_FOR_S, INCIDENT_S = 120.0, 240.0, 420.0
# ttft_weight of the "TTFT first" oracle router: 1,000 s of decode per second of
# TTFT, i.e. 1 ms of TTFT outweighs 5 ms per token over a 200-token answer.
TTFT_FIRST = 1000.0


def incident(seed: int, cases: int, only: set[int] | None = None) -> list[dict[str, Any]]:
    rows = []
    window = (FAULT_AT_S, FAULT_AT_S + FAULT_FOR_S)
    for c in range(cases):
        rng = random.Random(f"{seed}:incident:{c}")
        groups = fleet(rng)
        # The victim is a fast card: a throttled T4 hardly matters to a fleet's tail.
        victim = rng.choice([n for n in node_ids(groups) if not n.startswith(("L4", "T4"))])
        if only is not None and c not in only:
            continue
        fault = [{"node": victim, "kind": "throttle", "factor": 0.4, "at_s": FAULT_AT_S,
                  "duration_s": FAULT_FOR_S}]
        s = seed * 100 + c
        base = run(scenario(s, groups, INCIDENT_S, []), window)
        on = run(scenario(s, groups, INCIDENT_S, fault), window)
        off = run(scenario(s, groups, INCIDENT_S, fault, outliers=False), window)
        # Oracle: the victim is slow from t=0 (same throttle, no end) and is the only
        # card of its own GPU class, so the router prices it by its own learned
        # slowdown from the start, with no detector in between. Same offered rate
        # (the copied class has the same nominal capacity) and the same requests.
        ogroups, ovictim = oracle_fleet(groups, victim)
        oraw = scenario(s, ogroups, INCIDENT_S, [{"node": ovictim, "kind": "throttle",
                                                  "factor": 0.4, "at_s": 0.0}], outliers=False)
        oraw["catalog"] = oracle_catalog(victim.split("#")[0])
        oracle = run(oraw, window)
        assert oracle["offered_rps"] == base["offered_rps"], "oracle must see the same load"
        runs = [("no_fault", base), ("detection_on", on), ("detection_off", off),
                ("oracle", oracle)]
        b, bw = base["ttft_s"]["p99"], base["window_ttft_p99_s"]
        missed = on["ttft_s"]["p99"] > 1.25 * b
        if missed:
            # How low can routing take it at all? The oracle fleet again, with a router
            # that puts TTFT first: a millisecond of TTFT outweighs any decode saving
            # (TPOT only has to keep its SLO).
            runs.append(("oracle_ttft_first", run(oraw, window, TailguardOptions(ttft_weight=TTFT_FIRST))))
        row: dict[str, Any] = {"case": c, "victim": victim}
        for name, res in runs:
            row[f"{name}_p99_s"] = res["ttft_s"]["p99"]
            row[f"{name}_window_p99_s"] = round(res["window_ttft_p99_s"], 6)
            row[f"{name}_tpot_p99_s"] = res["tpot_s"]["p99"]
        rows.append(row)
        parts = []
        for name, res in runs[1:]:
            p, pw = res["ttft_s"]["p99"], res["window_ttft_p99_s"]
            parts.append(f"{name.replace('detection_', '')} {p:.3f} s ({p / b:.2f}x; "
                         f"window {pw / bw:.2f}x)")
        verdict = "OK"
        if missed:
            best = min(r["ttft_s"]["p99"] for n, r in runs if n.startswith("oracle"))
            verdict = ("FAIL (capacity: the oracles are > 1.25x too)" if best > 1.25 * b
                       else "FAIL (the oracle reaches it)")
        print(f"incident case {c} ({victim}): TTFT p99 no fault {b:.3f} s "
              f"(window {bw:.3f} s), {', '.join(parts)}  {verdict}", flush=True)
    return rows


def stalls(seed: int, cases: int) -> list[dict[str, Any]]:
    rows = []
    for c in range(cases):
        rng = random.Random(f"{seed}:stalls:{c}")
        # Compact fleets, half of the fast nodes stalling: in a big fleet the router
        # dodges a stalled node after a few requests (its prompts pile up without a
        # first token), the stalls touch < 1% of requests and the P99 does not move.
        groups = [{"gpu": "H100-SXM", "count": rng.randint(1, 3), "speed_spread": 0.1},
                  {"gpu": "A100-80GB", "count": rng.randint(2, 4), "speed_spread": 0.1},
                  {"gpu": "L4", "count": 2, "speed_spread": 0.1}]
        fast = [n for n in node_ids(groups) if not n.startswith(("L4", "T4"))]
        victims = rng.sample(fast, max(2, len(fast) // 2))
        faults = [{"node": v, "kind": "stall", "at_s": 30 + 3 * i, "period_s": 10,
                   "seconds": 2.0} for i, v in enumerate(victims)]
        s = seed * 100 + c
        window = (60.0, 300.0)  # the measured requests (after the warm-up)
        base = run(scenario(s, groups, 300, [], load=0.7), window)
        off = run(scenario(s, groups, 300, faults, load=0.7), window)
        on = run(scenario(s, groups, 300, faults, load=0.7, hedging=True), window)
        b, p_off, p_on = base["ttft_s"]["p99"], off["ttft_s"]["p99"], on["ttft_s"]["p99"]
        q_off, q_on = off["window_ttft_p999_s"], on["window_ttft_p999_s"]
        extra = on["hedge_share"]
        rows.append({"case": c, "victims": victims, "p99_no_stall_s": b,
                     "p99_off_s": p_off, "p99_on_s": p_on,
                     "p999_no_stall_s": round(base["window_ttft_p999_s"], 6),
                     "p999_off_s": round(q_off, 6), "p999_on_s": round(q_on, 6),
                     "over_1s_off": off["window_over_1s"], "over_1s_on": on["window_over_1s"],
                     "hedges": on["hedges"], "hedge_wins": on["hedge_wins"],
                     "extra_share": round(extra, 4)})
        # The router stops sending to a stalled node once its oldest prompt is
        # overdue (Node.overdue_s), so a stall holds only the requests already
        # there when it began: a few per stall, under 1% of all, so they set the
        # P99.9 rather than the P99. Hedging is judged where they are.
        ok = q_off >= 2 * q_on and extra <= 0.05
        verdict = "OK" if ok else ("n/a: stalls do not set the P99.9"
                                   if q_off < 1.5 * base["window_ttft_p999_s"] else "FAIL")
        print(f"stalls case {c} ({', '.join(victims)}): TTFT p99 no stalls {b:.3f} s, "
              f"hedging off {p_off:.3f} s, on {p_on:.3f} s; p99.9 no stalls "
              f"{base['window_ttft_p999_s']:.3f} s, off {q_off:.3f} s, on {q_on:.3f} s "
              f"({q_off / q_on:.1f}x lower); waits over 1 s off {off['window_over_1s']}, "
              f"on {on['window_over_1s']}; hedges {on['hedges']} "
              f"({100 * extra:.1f}% extra, {on['hedge_wins']} won)  {verdict}",
              flush=True)
    return rows


def longest_gaps(rec: RunRecord, window: tuple[float, float]) -> np.ndarray:
    """The longest inter-token gap of each request that arrived in ``window`` and got a
    first token (inf: its stream failed)."""
    arr = np.asarray(rec.arrival)
    gaps = np.asarray(rec.gaps)
    sel = (arr >= window[0]) & (arr < window[1]) & ~np.isnan(gaps)
    return gaps[sel]


def quantile(values: np.ndarray, q: float) -> float:
    """The ``q`` quantile (nearest rank, so that failed streams' inf counts as inf)."""
    if not values.size:
        return 0.0
    ordered = np.sort(values)
    return float(ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)])


def migration(seed: int, cases: int, engine_priority: int | None = None,
              only: set[int] | None = None) -> list[dict[str, Any]]:
    """Streams caught by a hang (10 s, twice per victim), a hung tensor-parallel rank
    (one GPU of a TP-2 replica at 0.2% of its speed for 60 s: each step of the
    replica waits for it, about 5-10 s) or a crash (60 s), with
    migration off and on: the P99.9 of the longest inter-token gap each client saw
    (inf: the stream failed), the worst finite one with migration on, and the extra
    prefill the continuations cost. ``engine_priority``: the continuations' engine priority (``migration.engine_priority``)."""
    rows = []
    window = (60.0, 300.0)
    for c in range(cases):
        if only is not None and c not in only:
            continue
        rng = random.Random(f"{seed}:migration:{c}")
        groups = [{"gpu": "H100-SXM", "count": rng.randint(1, 2), "tp": 2, "speed_spread": 0.1},
                  {"gpu": "A100-80GB", "count": rng.randint(2, 4), "speed_spread": 0.1},
                  {"gpu": "L4", "count": 2, "speed_spread": 0.1}]
        ids = node_ids(groups)
        fast = [n for n in ids if not n.startswith(("L4", "T4"))]
        victims = rng.sample(fast, 2)
        tp = [n for n in ids if n.startswith("H100")]
        kinds = {
            "hang": [{"node": v, "kind": "stall", "at_s": at, "seconds": 10.0}
                     for i, v in enumerate(victims) for at in (90 + 40 * i, 200 + 30 * i)],
            "rank": [{"node": tp[0], "kind": "throttle", "gpu_index": 1, "factor": 0.002,
                      "at_s": 120, "duration_s": 60}],
            "crash": [{"node": victims[0], "kind": "crash", "at_s": 120, "duration_s": 60}],
        }
        s = seed * 100 + c
        for kind, faults in kinds.items():
            out = {}
            for on in (False, True):
                raw = scenario(s, groups, 300, faults, load=0.7)
                raw["migration"] = {"enabled": True, "engine_priority": engine_priority} \
                    if on else {"enabled": False}
                records: dict[str, RunRecord] = {}
                if not on:  # the gaps are measured by the migration watch: keep it, moving none
                    raw["migration"] = {"enabled": True, "on_failure": False, "on_stall": False,
                                        "on_node_state": False}
                run(raw, records=records)
                rec = records["tailguard"]
                g = longest_gaps(rec, window)
                prompt = float(np.sum(rec.prompt))
                finite = g[np.isfinite(g)]
                out[on] = {"p999": quantile(g, 0.999), "p99": quantile(g, 0.99),
                           "max_finite": float(finite.max()) if finite.size else 0.0,
                           "failed": int(np.isinf(g).sum()), "moves": dict(rec.moves),
                           "extra_prefill": rec.move_prefill_tokens / prompt if prompt else 0.0}
            off_q, on_q = out[False]["p999"], out[True]["p999"]
            ratio = off_q / on_q if on_q > 0 else math.inf
            extra = out[True]["extra_prefill"]
            ok = ratio >= 5.0 and extra <= 0.02
            rows.append({"case": c, "kind": kind, "victims": victims if kind != "rank" else tp[:1],
                         "off": out[False], "on": out[True], "ratio": ratio})
            print(f"migration case {c} {kind:5s}: longest gap p99.9 off {off_q:.2f} s "
                  f"(p99 {out[False]['p99']:.2f}, {out[False]['failed']} failed streams), on "
                  f"{on_q:.2f} s (p99 {out[True]['p99']:.2f}, max {out[True]['max_finite']:.2f}, "
                  f"{out[True]['failed']} failed); "
                  f"{ratio:.1f}x lower; moves {out[True]['moves']}, extra prefill "
                  f"{100 * extra:.2f}%  {'OK' if ok else 'FAIL'}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", default="throttle-detect,healthy-hour,incident,stalls")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--cases", type=int, default=4)
    ap.add_argument("--hour-s", type=float, default=3600.0)
    ap.add_argument("--only",
                    help="comma-separated case numbers to run (incident, stalls, migration)")
    ap.add_argument("--engine-priority", type=int,
                    help="migration: the continuations' engine priority (e.g. -1)")
    ap.add_argument("--json")
    args = ap.parse_args()
    out: dict[str, Any] = {}
    runs = args.runs.split(",")
    only = {int(c) for c in args.only.split(",")} if args.only else None
    if "throttle-detect" in runs:
        out["throttle-detect"] = throttle_detect(args.seed, args.cases)
    if "healthy-hour" in runs:
        out["healthy-hour"] = healthy_hour(args.seed, args.hour_s)
    if "incident" in runs:
        out["incident"] = incident(args.seed, args.cases, only)
    if "stalls" in runs:
        out["stalls"] = stalls(args.seed, args.cases)
    if "migration" in runs:
        out["migration"] = migration(args.seed, args.cases, args.engine_priority, only)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
