"""Limits, the admission queue and priorities in the simulator."""

from __future__ import annotations

from typing import Any

import pytest

from tailguard.errors import ConfigError
from tailguard.sim.run import simulate
from tailguard.sim.scenario import PolicyChoice, parse_scenario


def raw(with_limits: bool, load: float = 1.4, **extra: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "name": "t", "seed": 3, "model": "llama-3.1-8b",
        "slo": {"ttft_s": 1.0, "tpot_s": 0.1},
        "fleet": [{"gpu": "A100-80GB", "count": 1}, {"gpu": "L4", "count": 2}],
        "workload": {"duration_s": 60, "warmup_s": 10,
                     "arrival": {"process": "poisson", "load": load},
                     "input_tokens": {"dist": "lognormal", "mu": 6.0, "sigma": 0.5},
                     "output_tokens": {"dist": "lognormal", "mu": 4.5, "sigma": 0.5},
                     "priorities": {"high": 0.2, "normal": 0.6, "low": 0.2}},
    }
    if with_limits:
        doc["limits"] = {"kind": "gradient"}
        doc["admission"] = {"queue_max": 256}
    doc.update(extra)
    return doc


def run(doc: dict[str, Any]) -> dict[str, Any]:
    res: dict[str, Any] = simulate(parse_scenario(doc), [PolicyChoice("tailguard")])
    return res["results"]["tailguard"]


def test_overload_with_limits_sheds_and_protects_high_priority() -> None:
    base = run(raw(False))
    lim = run(raw(True))
    assert "queue_s" not in base and base["shed"] == 0
    assert lim["shed"] > 0 and lim["queue_s"]["max"] <= 1.0 + 1e-9
    assert lim["goodput_rps"] > 1.5 * base["goodput_rps"]
    assert set(lim["limits"]) == {"A100-80GB", "L4"}
    assert lim["limits"]["L4"]["max"] < lim["limits"]["A100-80GB"]["min"]
    assert all(g["tpot_p99_s"] <= 1.1 * 0.1 for g in lim["per_gpu"].values())
    pri = lim["per_priority"]
    assert pri["high"]["slo_attainment"] >= 0.99 and pri["high"]["shed"] == 0
    assert pri["high"]["slo_attainment"] > pri["low"]["slo_attainment"]
    assert pri["low"]["shed"] > pri["high"]["shed"]
    assert run(raw(True)) == lim  # deterministic


def test_scenario_keys_are_validated() -> None:
    with pytest.raises(ConfigError, match=r"limits\.kind"):
        parse_scenario(raw(False, limits={"kind": "nope"}))
    with pytest.raises(ConfigError, match=r"admission\.queue_max"):
        parse_scenario(raw(False, admission={"queue_max": "many"}))
    doc = raw(False)
    doc["workload"]["priorities"] = {"urgent": 1.0}
    with pytest.raises(ConfigError, match=r"priorities"):
        parse_scenario(doc)


def test_normal_load_limits_cost_at_most_3_percent() -> None:
    base = run(raw(False, load=0.8))
    lim = run(raw(True, load=0.8))
    assert lim["goodput_rps"] >= 0.97 * base["goodput_rps"]
    assert lim["shed"] == 0


def test_weak_gpu_limit_rests_where_its_tail_meets_the_target() -> None:
    # The live benchmark's workload (700-token prompts, 16-96-token answers)
    # on engines with the plan's chunked-prefill budgets (`tailguard plan`,
    # SLO 0.1 s): the L4's no-load step is 75 ms, so its TPOT hardly moves
    # with the batch and only a gradient on the excess over that floor
    # brings its p99 to the 90 ms target (Gradient2's plain ratio let it
    # rest at a limit of 17-18, p99 0.94-0.96 x SLO).
    for seed in (3, 4, 5):
        doc = raw(True, load=3.0, seed=seed)
        doc["fleet"] = [{"gpu": "A100-80GB", "count": 1, "engine": {"max_num_batched_tokens": 1293}},
                        {"gpu": "L4", "count": 2, "engine": {"max_num_batched_tokens": 507}}]
        doc["workload"].update(duration_s=120, warmup_s=40,
                               input_tokens={"dist": "lognormal", "mu": 6.5, "sigma": 0.6,
                                             "max": 4096},
                               output_tokens={"dist": "uniform", "min": 16, "max": 96})
        doc["limits"] = {"kind": "gradient", "input_tokens": 700, "output_tokens": 56}
        res = run(doc)
        assert res["limits"]["L4"]["max"] <= 16
        assert res["per_gpu"]["L4"]["tpot_p99_s"] <= 0.94 * 0.1
        assert res["per_priority"]["high"]["slo_attainment"] >= 0.99
