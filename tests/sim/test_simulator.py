"""The simulator end to end: determinism, conservation, faults, policy claims on small runs."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from tailguard.cli import main
from tailguard.core.policies import Slo
from tailguard.sim.cluster import FAILED_STATUS, OK, UNFINISHED, run_cluster
from tailguard.sim.run import RunOptions, simulate
from tailguard.sim.scenario import load_scenario, parse_scenario

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = sorted((ROOT / "scenarios").glob("*.yaml"))


def small(fleet: list[dict[str, Any]], load: float = 0.8, duration: float = 120.0,
          faults: list[dict[str, Any]] | None = None, seed: int = 1) -> dict[str, Any]:
    return {
        "name": "small", "seed": seed, "model": "llama-3.1-8b",
        "slo": {"ttft_s": 2.0, "tpot_s": 0.1}, "network_rtt_s": 0.001, "fleet": fleet,
        "workload": {"duration_s": duration, "warmup_s": 20,
                     "arrival": {"process": "poisson", "load": load},
                     "input_tokens": {"dist": "azure-conv"},
                     "output_tokens": {"dist": "azure-conv"}},
        "faults": faults or [],
    }


MIXED = [{"gpu": "H100-SXM", "count": 1}, {"gpu": "A100-80GB", "count": 2},
         {"gpu": "L4", "count": 3}]


def test_same_seed_gives_byte_identical_json(tmp_path: Path) -> None:
    scenario = tmp_path / "s.yaml"
    scenario.write_text(json.dumps(small(MIXED, duration=60)))
    outs = []
    for i in range(2):
        out = tmp_path / f"r{i}.json"
        assert main(["sim", str(scenario), "--policies", "tailguard,p2c", "--json", str(out),
                     "--quiet"]) == 0
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
    doc = json.loads(outs[0])
    assert doc["capacity_bound_rps"] > 0
    res = doc["results"]["tailguard"]
    for key in ("offered_rps", "requests", "completed", "failed", "throughput_rps",
                "output_tokens_per_s", "ttft_s", "tpot_s", "e2e_s", "slo_attainment",
                "goodput_rps", "per_gpu"):
        assert key in res
    assert set(res["per_gpu"]) == {"H100-SXM", "A100-80GB", "L4"}
    assert set(res["ttft_s"]) == {"mean", "p50", "p90", "p99", "max"}


def test_different_seed_differs() -> None:
    a = simulate(parse_scenario(small(MIXED, duration=40, seed=1)), opts=RunOptions())
    b = simulate(parse_scenario(small(MIXED, duration=40, seed=2)), opts=RunOptions())
    assert a["results"] != b["results"]


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n=st.integers(1, 120),
    policy=st.sampled_from(["round_robin", "least_request", "p2c", "peak_ewma", "seed_weighted",
                            "tailguard", "random"]),
    crash=st.booleans(),
)
def test_every_arrival_ends_exactly_once(seed: int, n: int, policy: str, crash: bool) -> None:
    scn = parse_scenario(small([{"gpu": "A100-80GB", "count": 2}, {"gpu": "L4", "count": 1}],
                               faults=[{"node": "L4#0", "kind": "crash", "at_s": 2.0}]
                               if crash else None))
    rng = random.Random(seed)
    arrivals = sorted(rng.uniform(0, 10) for _ in range(n))
    prompts = [rng.randint(1, 3000) for _ in range(n)]
    outputs = [rng.randint(1, 300) for _ in range(n)]
    rec = run_cluster(scn.nodes(), scn.model, arrivals, prompts, outputs, policy=policy,
                      slo=Slo(), seed=seed, faults=scn.faults)
    assert all(s in (OK, FAILED_STATUS) for s in rec.status)  # nothing left unfinished
    assert all(e >= a for e, a in zip(rec.end, rec.arrival, strict=True))
    for i in range(n):
        if rec.status[i] == OK:
            assert rec.arrival[i] <= rec.first[i] <= rec.end[i]
    if not crash:
        assert rec.status.count(OK) == n


def test_crash_fails_in_flight_and_retries_before_first_token() -> None:
    scn = parse_scenario(small([{"gpu": "A100-80GB", "count": 2}], duration=60,
                               faults=[{"node": "A100-80GB#0", "kind": "crash", "at_s": 30}]))
    doc = simulate(scn, opts=RunOptions())
    res = doc["results"]["tailguard"]
    assert res["retries"] > 0
    assert res["completed"] > 0.9 * res["requests"]


def test_horizon_leaves_requests_unfinished() -> None:
    scn = parse_scenario(small([{"gpu": "L4", "count": 1}]))
    rec = run_cluster(scn.nodes(), scn.model, [0.0] * 50, [2000] * 50, [500] * 50,
                      policy="round_robin", slo=Slo(), seed=0, horizon_s=5.0)
    assert UNFINISHED in rec.status


def test_throttle_slows_the_node() -> None:
    def tpot(faults: list[dict[str, Any]] | None) -> float:
        scn = parse_scenario(small([{"gpu": "A100-80GB", "count": 1}], load=0.5, duration=80,
                                   faults=faults))
        return float(simulate(scn, opts=RunOptions())["results"]["tailguard"]["tpot_s"]["p50"])

    base = tpot(None)
    slow = tpot([{"node": "A100-80GB#0", "kind": "throttle", "factor": 0.5, "at_s": 0}])
    assert slow > 1.6 * base


def test_tailguard_beats_baselines_on_a_mixed_fleet() -> None:
    scn = parse_scenario(small(MIXED, duration=240))
    doc = simulate(scn, [*parse_policies_names("round_robin,least_request,tailguard")])
    r = doc["results"]
    tg = r["tailguard"]
    assert tg["slo_attainment"] >= 0.99
    assert tg["ttft_s"]["p99"] * 5 <= r["round_robin"]["ttft_s"]["p99"]
    assert tg["ttft_s"]["p99"] * 1.5 <= r["least_request"]["ttft_s"]["p99"]


def parse_policies_names(names: str) -> Any:
    from tailguard.sim.scenario import parse_policies

    return parse_policies(names)


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_shipped_scenarios_run(path: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    assert main(["sim", str(path), "--duration", "60", "--json", str(out), "--quiet"]) == 0
    doc = json.loads(out.read_text())
    scn = load_scenario(path)
    assert list(doc["results"]) == [p.label for p in scn.policies]
    assert doc["results"]["tailguard"]["completed"] > 0


def test_bad_scenario_exits_2_with_one_line(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(json.dumps(small([{"gpu": "Z80", "count": 1}])))
    assert main(["sim", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "fleet[0].gpu" in err and "H100-SXM" in err
    assert "Traceback" not in err
