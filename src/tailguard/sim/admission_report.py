"""The simulator's report on concurrency limits and the admission queue.

Adds to a policy's result (requests that arrived in the measured window):

* ``shed``: requests answered 429 by the gateway (queue full, displaced,
  predicted wait past the deadline, expired in the queue);
* ``queue_s``: percentiles of the time admitted requests waited in the gateway
  queue (0 for those dispatched at once), like ``ttft_s``;
* ``limits``: each GPU class's final per-node limits (min, mean, max);
* ``per_priority``: requests, shed and SLO attainment per priority class,
  when the workload has ``priorities``.

A shed request counts as a request that missed the SLO: goodput and
attainment are not flattered by refusing work.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tailguard.core.admission import PRIORITIES, PRIORITY_NAMES
from tailguard.core.policies import Slo
from tailguard.sim.cluster import OK, SHED, RunRecord
from tailguard.sim.results import summary


def draw_priorities(shares: Mapping[str, float] | None, n: int, seed: int) -> list[int] | None:
    """One priority per request (0 high, 1 normal, 2 low), from its own random stream."""
    if not shares:
        return None
    names = [k for k in PRIORITY_NAMES if shares.get(k, 0.0) > 0]
    weights = [shares[k] for k in names]
    rng = random.Random(f"{seed}:priority")
    return [PRIORITIES[k] for k in rng.choices(names, weights, k=n)]


def admission_report(rec: RunRecord, *, slo: Slo, warmup_s: float, duration_s: float,
                     gpu_of: Mapping[str, str]) -> dict[str, Any]:
    arrival = np.asarray(rec.arrival, dtype=float)
    window = (arrival >= warmup_s) & (arrival < duration_s)
    status = np.asarray(rec.status, dtype=np.int8)[window]
    out: dict[str, Any] = {"shed": int((status == SHED).sum())}
    if not rec.queue_s:
        return out
    queued = np.asarray(rec.queue_s, dtype=float)[window]
    out["queue_s"] = summary(queued[status != SHED])
    by_gpu: dict[str, list[int]] = {}
    for nid, lim in rec.limits.items():
        by_gpu.setdefault(gpu_of[nid], []).append(lim)
    out["limits"] = {g: {"min": min(v), "mean": round(sum(v) / len(v), 3), "max": max(v)}
                     for g, v in sorted(by_gpu.items())}
    if rec.priority and len(set(rec.priority)) > 1:
        prio = np.asarray(rec.priority, dtype=np.int8)[window]
        meets = _meets(rec, slo)[window]
        out["per_priority"] = {
            name: {"requests": int((prio == p).sum()),
                   "shed": int(((prio == p) & (status == SHED)).sum()),
                   "slo_attainment": round(float(meets[prio == p].mean()), 6)
                   if (prio == p).any() else 0.0}
            for name, p in PRIORITIES.items()
        }
    return out


def _meets(rec: RunRecord, slo: Slo) -> np.ndarray[Any, Any]:
    arr = np.asarray(rec.arrival, dtype=float)
    first = np.asarray(rec.first, dtype=float)
    end = np.asarray(rec.end, dtype=float)
    out = np.asarray(rec.output, dtype=float)
    tpot = np.where(out > 1, (end - first) / np.maximum(out - 1, 1), 0.0)
    ok = np.asarray(rec.status, dtype=np.int8) == OK
    result: np.ndarray[Any, Any] = ok & (first - arr <= slo.ttft_s) & (tpot <= slo.tpot_s)
    return result


__all__: Sequence[str] = ["admission_report", "draw_priorities"]
