"""Load sweeps: the same scenario at several offered loads, every policy at each.

``tailguard sim SCENARIO --sweep 0.5:1.2:0.1`` runs the scenario at 50%,
60%, ... 120% of the fleet's capacity bound (see ``load`` in the README) and
reports, per policy and load, the SLO attainment, goodput and tail
latencies: the curve that shows where each policy stops keeping the SLO. At
each load every policy sees the same requests (the simulator's usual common
random numbers); the loads differ only in the arrival rate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from tailguard.errors import ConfigError
from tailguard.sim.run import Progress, RunOptions, simulate
from tailguard.sim.scenario import PolicyChoice, Scenario

MAX_POINTS = 50


def parse_sweep(text: str, where: str = "--sweep") -> list[float]:
    """``"0.5:1.2:0.1"`` -> ``[0.5, 0.6, ..., 1.2]`` (start, stop inclusive, step)."""
    parts = text.split(":")
    try:
        start, stop, step = (float(p) for p in parts)
    except ValueError:
        raise ConfigError(where, f"expected START:STOP:STEP loads, e.g. 0.5:1.2:0.1, "
                                 f"got {text!r}") from None
    if not (start > 0 and stop >= start and step > 0) or not all(
            math.isfinite(v) for v in (start, stop, step)):
        raise ConfigError(where, "needs 0 < START <= STOP and STEP > 0")
    # Rounded so that 0.5:1.2:0.1 ends at 1.2 despite binary fractions.
    n = math.floor((stop - start) / step + 1e-9) + 1
    if n > MAX_POINTS:
        raise ConfigError(where, f"{n} points; at most {MAX_POINTS}")
    return [round(start + i * step, 9) for i in range(n)]


def run_sweep(scn: Scenario, loads: Sequence[float],
              policies: Sequence[PolicyChoice] | None = None,
              opts: RunOptions | None = None,
              progress: Progress | None = None) -> list[dict[str, Any]]:
    """One entry per load: ``{"load", "offered_rps", "results": {policy: summary}}``."""
    if scn.workload.arrival.process == "trace":
        raise ConfigError("--sweep", "a trace sets its own arrival times; sweep a "
                                     "poisson or gamma workload")
    opts = opts or RunOptions()
    out: list[dict[str, Any]] = []
    for load in loads:
        doc = simulate(scn, policies, replace(opts, load=load, rate=None, find_goodput=False),
                       progress)
        results = {}
        offered = 0.0
        for name, r in doc["results"].items():
            offered = r["offered_rps"]
            results[name] = {
                "slo_attainment": r["slo_attainment"],
                "goodput_rps": r["goodput_rps"],
                "ttft_p99_s": r["ttft_s"]["p99"],
                "tpot_p99_s": r["tpot_s"]["p99"],
                "completed": r["completed"],
            }
        out.append({"load": load, "offered_rps": offered, "results": results})
    return out


__all__ = ["parse_sweep", "run_sweep"]
