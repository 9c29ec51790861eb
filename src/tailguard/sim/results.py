"""Turn a run's per-request arrays into the result shape of ``tailguard sim --json``.

Statistics cover the requests that *arrived* in the measured window
``[warmup_s, duration_s)``. A request meets the SLO when it completed, its
TTFT is within ``slo.ttft_s`` and its TPOT (``(end - first) / (tokens - 1)``,
0 for one-token answers) within ``slo.tpot_s``; failed and unfinished requests
miss it. Goodput is SLO-meeting requests per second of the window
(DistServe's definition). A request still without a first token when the run
stopped enters the TTFT statistics with the time it had waited (a lower
bound), so an overloaded policy cannot hide its queue by never answering.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from tailguard.core.policies import Slo
from tailguard.sim.cluster import OK, UNFINISHED, RunRecord


def summary(values: np.ndarray[Any, Any]) -> dict[str, float]:
    if values.size == 0:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {
        "mean": round(float(values.mean()), 6),
        "p50": round(float(p50), 6),
        "p90": round(float(p90), 6),
        "p99": round(float(p99), 6),
        "max": round(float(values.max()), 6),
    }


def compute_result(
    rec: RunRecord,
    *,
    slo: Slo,
    warmup_s: float,
    duration_s: float,
    offered_rps: float,
    gpu_of: Mapping[str, str],
    capacity_by_gpu: Mapping[str, float],
) -> dict[str, Any]:
    arrival = np.asarray(rec.arrival, dtype=float)
    window = (arrival >= warmup_s) & (arrival < duration_s)
    status = np.asarray(rec.status, dtype=np.int8)[window]
    first = np.asarray(rec.first, dtype=float)[window]
    end = np.asarray(rec.end, dtype=float)[window]
    arr = arrival[window]
    out = np.asarray(rec.output, dtype=float)[window]
    node = np.asarray(rec.node, dtype=np.int32)[window]
    span = max(duration_s - warmup_s, 1e-9)

    ok = status == OK
    has_first = first >= 0.0
    ttft_all = np.where(has_first, first - arr, rec.end_time - arr)
    ttft_all = np.where((status == UNFINISHED) | has_first, ttft_all, np.nan)
    ttft = ttft_all[~np.isnan(ttft_all)]
    tpot = np.where(out > 1, (end - first) / np.maximum(out - 1, 1), 0.0)
    e2e = end - arr
    meets = ok & (first - arr <= slo.ttft_s) & (tpot <= slo.tpot_s)

    requests = int(window.sum())
    completed = int(ok.sum())
    per_gpu: dict[str, dict[str, float]] = {}
    classes: dict[str, list[int]] = {}
    for i, nid in enumerate(rec.node_ids):
        classes.setdefault(gpu_of[nid], []).append(i)
    for gpu, idxs in classes.items():
        mask = np.isin(node, idxs)
        done = mask & ok
        cap = capacity_by_gpu.get(gpu, 0.0) * len(idxs)
        served_rps = float(done.sum()) / span
        per_gpu[gpu] = {
            "nodes": len(idxs),
            "share": round(float(mask.sum()) / requests, 6) if requests else 0.0,
            "utilization": round(served_rps / cap, 6) if cap > 0 else 0.0,
            "ttft_p99_s": round(float(np.percentile((first - arr)[done], 99)), 6)
            if done.any() else 0.0,
            "tpot_p99_s": round(float(np.percentile(tpot[done], 99)), 6) if done.any() else 0.0,
            "slo_attainment": round(float(meets[mask].mean()), 6) if mask.any() else 0.0,
        }
    result: dict[str, Any] = {
        "offered_rps": round(offered_rps, 6),
        "requests": requests,
        "completed": completed,
        "failed": requests - completed,
        "unfinished": int((status == UNFINISHED).sum()),
        "retries": rec.retries,
        "throughput_rps": round(completed / span, 6),
        "output_tokens_per_s": round(float(out[ok].sum()) / span, 6),
        "ttft_s": summary(ttft),
        "tpot_s": summary(tpot[ok]),
        "e2e_s": summary(e2e[ok]),
        "slo_attainment": round(float(meets.mean()), 6) if requests else 0.0,
        "goodput_rps": round(float(meets.sum()) / span, 6),
        "per_gpu": dict(sorted(per_gpu.items())),
        "events": [
            {"t_s": round(e.t, 3), "node": e.node, "state": e.state, "reason": e.reason,
             **({"cause": e.cause} if e.cause else {}),
             **({"advice": e.advice} if e.advice else {})}
            for e in rec.events
        ],
    }
    if rec.cached:
        result["prefix"] = prefix_stats(rec, window, ok, first - arr)
    return result


def prefix_stats(rec: RunRecord, window: np.ndarray[Any, Any], ok: np.ndarray[Any, Any],
                 ttft: np.ndarray[Any, Any]) -> dict[str, Any]:
    """Prefix-cache use of the completed requests: hit rate (cached prompt tokens
    over prompt tokens), prefill tokens saved, and TTFT of those that hit and
    those that did not."""
    cached = np.asarray(rec.cached, dtype=float)[window][ok]
    prompt = np.asarray(rec.prompt, dtype=float)[window][ok]
    t = ttft[ok]
    hit = cached > 0
    total = float(prompt.sum())
    return {
        "hit_rate": round(float(cached.sum()) / total, 6) if total else 0.0,
        "requests_hit": round(float(hit.mean()), 6) if hit.size else 0.0,
        "prefill_tokens_saved": int(cached.sum()),
        "prefill_tokens": int(total - cached.sum()),
        "ttft_cached_s": summary(t[hit]),
        "ttft_uncached_s": summary(t[~hit]),
    }


def attainment(rec: RunRecord, slo: Slo, start_s: float) -> float:
    """SLO attainment of the requests that arrived at or after ``start_s``."""
    arrival = np.asarray(rec.arrival, dtype=float)
    window = arrival >= start_s
    if not window.any():
        return 0.0
    status = np.asarray(rec.status, dtype=np.int8)[window]
    first = np.asarray(rec.first, dtype=float)[window]
    end = np.asarray(rec.end, dtype=float)[window]
    out = np.asarray(rec.output, dtype=float)[window]
    arr = arrival[window]
    tpot = np.where(out > 1, (end - first) / np.maximum(out - 1, 1), 0.0)
    meets = (status == OK) & (first - arr <= slo.ttft_s) & (tpot <= slo.tpot_s)
    return float(meets.mean())
