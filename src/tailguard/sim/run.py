"""Run a scenario: resolve the rate, generate the workload, simulate each policy.

Every policy sees the same requests (same arrival times and lengths, drawn from
the scenario seed), so differences between policies are the policies'.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tailguard.core.limits import LimitConfig
from tailguard.errors import ConfigError
from tailguard.sim.admission_report import admission_report, draw_priorities
from tailguard.sim.cluster import RunRecord, run_cluster
from tailguard.sim.fleet_bound import fleet_bound
from tailguard.sim.pd_report import pd_report
from tailguard.sim.results import compute_result
from tailguard.sim.scenario import PolicyChoice, Scenario
from tailguard.sim.stragglers import outlier_report
from tailguard.traffic.workload import Requests, generate

Progress = Callable[[str, float, float], None]  # (label, sim time, horizon)


@dataclass(frozen=True, slots=True)
class RunOptions:
    rate: float | None = None  # overrides the scenario's arrival rate or load
    load: float | None = None
    duration_s: float | None = None
    seed: int | None = None
    find_goodput: bool = False
    attainment: float | None = None  # target for --find-goodput (default: the SLO's)
    drain_s: float | None = None  # how long after the last arrival to let requests finish


def with_options(scn: Scenario, opts: RunOptions) -> Scenario:
    if opts.seed is not None:
        scn = replace(scn, seed=opts.seed)
    wl = scn.workload
    if opts.duration_s is not None:
        if opts.duration_s <= 0:
            raise ConfigError("--duration", "must be > 0")
        wl = replace(wl, duration_s=opts.duration_s, warmup_s=min(wl.warmup_s, opts.duration_s / 4))
    if opts.rate is not None or opts.load is not None:
        value = opts.rate if opts.rate is not None else opts.load
        if value is None or value <= 0:
            raise ConfigError("--rate" if opts.rate is not None else "--load", "must be > 0")
        if wl.arrival.process == "trace" and opts.rate is not None:
            raise ConfigError("--rate", "a trace sets its own arrival times")
        wl = replace(wl, arrival=replace(wl.arrival, rate=opts.rate, load=opts.load))
    return replace(scn, workload=wl)


def offered_rate(scn: Scenario, capacity_bound: float) -> float | None:
    arr = scn.workload.arrival
    if arr.rate is not None:
        return arr.rate
    if arr.load is not None:
        return arr.load * capacity_bound
    return None


def make_requests(scn: Scenario, rate: float | None) -> Requests:
    return generate(scn.workload, rate, random.Random(f"{scn.seed}:workload"))


def run_policy(
    scn: Scenario,
    choice: PolicyChoice,
    reqs: Requests,
    capacity: dict[str, float],
    offered: float,
    drain_s: float | None = None,
    progress: Progress | None = None,
    records: dict[str, RunRecord] | None = None,
) -> dict[str, Any]:
    plans = scn.nodes()
    wl = scn.workload
    drain = drain_s if drain_s is not None else max(120.0, 0.5 * wl.duration_s)
    last = reqs.arrival_s[-1] if len(reqs) else 0.0
    horizon = max(wl.duration_s, last) + drain
    cb = None
    if progress is not None:
        def cb(t: float) -> None:
            progress(choice.label, t, wl.duration_s)
    rec = run_cluster(
        plans, scn.model, reqs.arrival_s, reqs.input_tokens, reqs.output_tokens,
        policy=choice.name, policy_options=choice.options, slo=scn.slo, seed=scn.seed,
        network_rtt_s=scn.network_rtt_s, faults=scn.faults, horizon_s=horizon, progress=cb,
        outliers=scn.outliers, hedging=scn.hedging, migration=scn.migration,
        limits=planned_limits(scn, reqs), admission=scn.admission,
        priorities=draw_priorities(wl.priorities, len(reqs), scn.seed),
        gpu_telemetry=scn.gpu_telemetry, blocks=reqs.blocks, block_tokens=reqs.block_tokens,
        sessions=reqs.session, kv_link=scn.kv_link, kv_pairs=scn.kv_pairs,
    )
    if records is not None:  # the per-request arrays, for reports (sim/report.py)
        records[choice.label] = rec
    gpu_of = {p.id: p.perf.gpu.name for p in plans}
    by_gpu: dict[str, float] = {}
    for p in plans:
        by_gpu.setdefault(p.perf.gpu.name, capacity[p.id])
    res = compute_result(rec, slo=scn.slo, warmup_s=wl.warmup_s, duration_s=wl.duration_s,
                         offered_rps=offered, gpu_of=gpu_of, capacity_by_gpu=by_gpu)
    res.update(admission_report(rec, slo=scn.slo, warmup_s=wl.warmup_s,
                                duration_s=wl.duration_s, gpu_of=gpu_of))
    if rec.outliers:
        res["outliers"] = outlier_report(rec.events, scn.faults, rec.end_time,
                                         rec.outliers["time_in_states"],
                                         rec.outliers["detected"], rec.outliers["enforced"],
                                         rec.outliers["stalls"])
    res.update(pd_report(rec, wl.warmup_s, gpu_of))
    res["hedges"] = rec.hedges
    if rec.moves:  # streams moved mid-answer (a run without any keeps its old result)
        res["migrations"] = migration_report(rec, wl.warmup_s)
    if scn.hedging.enabled:  # the share is over every request of the run, warm-up included
        res["hedge_wins"] = rec.hedge_wins
        res["hedge_share"] = round(rec.hedges / max(1, len(rec.arrival)), 6)
    return res


def migration_report(rec: RunRecord, warmup_s: float) -> dict[str, object]:
    """Moves by cause, the prompt tokens they made engines compute again (as a share
    of all prompts), and the longest inter-token gap per request after the warm-up
    (p99, p99.9 and max; a failed stream counts as inf, shown as null)."""
    gaps = sorted(g for g, t in zip(rec.gaps, rec.arrival, strict=True)
                  if t >= warmup_s and not math.isnan(g))

    def q(p: float) -> float | None:
        if not gaps:
            return None
        g = gaps[min(len(gaps) - 1, math.ceil(p * len(gaps)) - 1)]
        return round(g, 6) if math.isfinite(g) else None

    return {"moves": dict(sorted(rec.moves.items())),
            "extra_prefill_share": round(rec.move_prefill_tokens / max(1, sum(rec.prompt)), 6),
            "failed_streams": sum(1 for g in gaps if math.isinf(g)),
            "longest_gap_s": {"p99": q(0.99), "p999": q(0.999), "max": q(1.0)}}


def planned_limits(scn: Scenario, reqs: Requests) -> LimitConfig | None:
    """The scenario's limits, planned at the workload's mean lengths unless it names them."""
    cfg = scn.limits
    if cfg is None and scn.admission is not None:
        cfg = LimitConfig(kind="fixed")
    if cfg is None or not len(reqs):
        return cfg
    if cfg.input_tokens is None:
        cfg = replace(cfg, input_tokens=sum(reqs.input_tokens) / len(reqs))
    if cfg.output_tokens is None:
        cfg = replace(cfg, output_tokens=sum(reqs.output_tokens) / len(reqs))
    return cfg


def find_goodput(
    scn: Scenario, choice: PolicyChoice, capacity: dict[str, float], bound: float, target: float,
    progress: Progress | None = None, iterations: int = 7,
) -> float:
    """Highest offered rate (req/s) whose SLO attainment reaches ``target`` (bisection)."""

    def ok(rate: float) -> bool:
        s = replace(scn, workload=replace(scn.workload, arrival=replace(
            scn.workload.arrival, rate=rate, load=None)))
        res = run_policy(s, choice, make_requests(s, rate), capacity, rate, progress=progress)
        return bool(res["slo_attainment"] >= target)

    lo, hi = 0.0, bound
    while ok(hi):
        lo, hi = hi, hi * 1.5
    if lo == 0.0:
        lo = hi / 4
        while not ok(lo) and lo > bound * 1e-3:
            hi, lo = lo, lo / 2
    for _ in range(iterations):
        mid = (lo + hi) / 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


def simulate(
    scn: Scenario,
    policies: Sequence[PolicyChoice] | None = None,
    opts: RunOptions = RunOptions(),
    progress: Progress | None = None,
    records: dict[str, RunRecord] | None = None,
) -> dict[str, Any]:
    """Run every policy on the scenario; return the ``--json`` document.

    ``records``, when given, receives each policy's :class:`RunRecord` by label.
    """
    scn = with_options(scn, opts)
    # The split bound only where it is used: a workload that gives its rate reports
    # the sum of its nodes' capacities.
    fc = fleet_bound(scn, split=scn.workload.arrival.load is not None or opts.find_goodput)
    capacity, bound = fc.nodes, fc.bound
    rate = offered_rate(scn, bound)
    if rate is not None and rate <= 0:
        raise ConfigError("workload.arrival", "the fleet has no SLO capacity for this workload")
    reqs = make_requests(scn, rate)
    offered = rate if rate is not None else len(reqs) / max(scn.workload.duration_s, 1e-9)
    warnings = []
    if scn.workload.arrival.load is not None and any(g.role != "both" for g in scn.fleet):
        warnings.append("the `load:` bound rates every node serving both phases; with "
                        "prefill/decode roles it is only a scale, not the fleet's capacity "
                        "(give `rate:`, or --find-goodput measures it)")
    zero = sorted({nid.split("#")[0] for nid, cap in capacity.items() if cap <= 0.0})
    if zero and fc.bands is None and scn.workload.arrival.load is not None:
        warnings.append(f"{', '.join(zero)}: SLO capacity 0 for this workload (too many of its "
                        "requests miss the SLO there even alone: `tailguard capacity` says "
                        "why), so the `load:` bound understates the fleet")
    if fc.missed > 1.0 - scn.slo.attainment and scn.workload.arrival.load is not None:
        warnings.append(f"{fc.missed:.1%} of the requests miss the SLO on every node even alone, "
                        f"more than attainment {scn.slo.attainment} allows: the `load:` bound "
                        "is the rate at which the rest meet it")
    results: dict[str, Any] = {}
    for choice in policies or scn.policies:
        res = run_policy(scn, choice, reqs, capacity, offered, opts.drain_s, progress, records)
        if opts.find_goodput:
            target = opts.attainment if opts.attainment is not None else scn.slo.attainment
            res["max_goodput_rps"] = round(
                find_goodput(scn, choice, capacity, bound, target, progress), 6)
        results[choice.label] = res
    return {
        "scenario": scn.name,
        "seed": scn.seed,
        "model": scn.model,
        "slo": {"ttft_s": scn.slo.ttft_s, "tpot_s": scn.slo.tpot_s,
                "attainment": scn.slo.attainment},
        "capacity_bound_rps": round(bound, 6),
        "node_capacity_rps": {k: round(v, 6) for k, v in capacity.items()},
        **({"capacity_bands": {name: {"prompt_tokens": [b.prompt_min, b.prompt_max],
                                      "share": round(b.share, 4), "binds": b.binds}
                               for name, b in fc.bands.items()}} if fc.bands else {}),
        "results": results,
        **({"warnings": warnings} if warnings else {}),
    }
