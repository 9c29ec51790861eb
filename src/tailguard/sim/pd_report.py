"""Per-phase figures of a disaggregated run: where prompts were computed, what
their KV transfers took, and the TPOT of answers whose prompt came from
elsewhere against those computed beside their decode."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from tailguard.sim.cluster import OK, RunRecord
from tailguard.sim.results import summary


def pd_report(rec: RunRecord, warmup_s: float, gpu_of: Mapping[str, str]) -> dict[str, Any]:
    """The ``disaggregation`` block of a run's result (empty without roles)."""
    if not rec.kv_s:
        return {}
    remote_kv: list[float] = []
    prefill_s: list[float] = []  # arrival to hand-off: the prefill leg, its queue included
    tpot: dict[str, list[float]] = {"remote": [], "local": []}
    by_class: dict[str, int] = {}
    served = 0
    for i, a in enumerate(rec.arrival):
        if a < warmup_s or rec.status[i] != OK:
            continue
        served += 1
        p = rec.prefill_node[i]
        where = "remote" if p >= 0 else "local"
        if p >= 0:
            remote_kv.append(rec.kv_s[i])
            prefill_s.append(rec.handoff[i] - a)
            cls = gpu_of[rec.node_ids[p]]
            by_class[cls] = by_class.get(cls, 0) + 1
        if rec.output[i] > 1 and rec.first[i] >= 0.0:
            tpot[where].append((rec.end[i] - rec.first[i]) / (rec.output[i] - 1))
    n = max(served, 1)
    return {"disaggregation": {
        "remote_share": round(len(remote_kv) / n, 4),
        "prefill_share_by_gpu": {k: round(v / n, 4) for k, v in sorted(by_class.items())},
        "prefill_leg_s": summary(np.array(prefill_s)),
        "kv_transfer_s": summary(np.array(remote_kv)),
        "tpot_p99_s": {k: summary(np.array(v))["p99"] for k, v in tpot.items()},
    }}
