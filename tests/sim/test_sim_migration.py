"""Mid-stream migration in the simulator (issue 45): the same exchange as live, on
engine-model stalls and crashes; each request's longest inter-token gap."""

from __future__ import annotations

import math
from typing import Any

from tailguard.sim.cluster import RunRecord
from tailguard.sim.run import simulate
from tailguard.sim.scenario import PolicyChoice, parse_scenario


def scenario(faults: list[dict[str, Any]], migration: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": "t", "seed": 3, "model": "llama-3.2-3b", "slo": {"ttft_s": 2.0, "tpot_s": 0.1},
        "fleet": [{"gpu": "H100-SXM", "count": 1}, {"gpu": "A100-80GB", "count": 3}],
        "workload": {"duration_s": 90, "warmup_s": 20,
                     "arrival": {"process": "poisson", "rate": 20.0},
                     "input_tokens": {"dist": "azure-conv"},
                     "output_tokens": {"dist": "azure-conv"}},
        "faults": faults, "migration": migration,
    }


def run(raw: dict[str, Any]) -> tuple[dict[str, Any], RunRecord]:
    records: dict[str, RunRecord] = {}
    out = simulate(parse_scenario(raw), [PolicyChoice("tailguard")], records=records)
    return out["results"]["tailguard"], records["tailguard"]


OFF = {"enabled": True, "on_failure": False, "on_stall": False, "on_node_state": False}
HANG = [{"node": "A100-80GB#1", "kind": "stall", "at_s": 40, "seconds": 10.0}]
CRASH = [{"node": "A100-80GB#1", "kind": "crash", "at_s": 40, "duration_s": 20}]


def test_a_hang_moves_its_streams_and_the_gaps_show_it() -> None:
    res_off, off = run(scenario(HANG, OFF))
    res_on, on = run(scenario(HANG, {}))
    assert not off.moves and "migrations" not in res_off
    stuck = [g for g in off.gaps if math.isfinite(g) and g > 9.0]
    assert stuck, "the hang held streams for its 10 s"
    assert on.moves.get("stall", 0) >= len(stuck) // 2
    report = res_on["migrations"]
    assert report["failed_streams"] == 0 and report["extra_prefill_share"] < 0.05
    # the longest gap any stream saw: the stall trigger plus a continuation's first token
    assert report["longest_gap_s"]["max"] < 3.0
    assert max(g for g in off.gaps if math.isfinite(g)) > 9.0
    # every request answered once, whatever moved
    assert res_on["completed"] == res_off["completed"]


def test_a_crash_moves_its_streams_instead_of_failing_them() -> None:
    res_off, off = run(scenario(CRASH, OFF))
    res_on, on = run(scenario(CRASH, {}))
    failed_off = sum(1 for g in off.gaps if math.isinf(g))
    assert failed_off >= 1 and res_off["failed"] >= failed_off
    assert on.moves.get("failure", 0) >= failed_off - 1
    assert res_on["migrations"]["failed_streams"] == 0
    assert res_on["failed"] < res_off["failed"]


def test_no_fault_no_move_and_the_same_run() -> None:
    res, rec = run(scenario([], {}))
    assert not rec.moves and "migrations" not in res
    assert all(g == 0.25 for g in rec.gaps if not math.isnan(g))  # none over the resolution
    assert run(scenario([], {}))[0] == res
