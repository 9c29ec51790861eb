"""Shared-prefix workloads: sessions' hashed blocks, Mooncake traces, and a
simulated run that reports prefix-cache use."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest

from tailguard.errors import ConfigError
from tailguard.sim.run import simulate
from tailguard.sim.scenario import parse_scenario
from tailguard.traffic.sessions import Chain
from tailguard.traffic.workload import generate, parse_workload, read_trace

MSG = {"dist": "lognormal", "mu": 5.0, "sigma": 0.5, "max": 2000}
ANS = {"dist": "fixed", "value": 100}


def _workload(**prefix: object) -> dict[str, object]:
    return {"duration_s": 300, "arrival": {"process": "poisson", "rate": 8},
            "input_tokens": MSG, "output_tokens": ANS,
            "prefix": {"block_tokens": 64, "tenants": 3, "system_tokens": 700, **prefix}}


def test_chains_share_blocks_exactly_where_content_is_shared() -> None:
    a, b = Chain(64), Chain(64)
    a.add(-1, 700)  # the same system prompt
    b.add(-1, 700)
    a.add(1, 300)
    b.add(2, 300)
    assert a.hashes[:10] == b.hashes[:10]  # 700 // 64 = 10 whole blocks of system prompt
    assert a.hashes[10] != b.hashes[10]  # block 10 mixes the prompt's end with each message


def test_a_turn_resends_the_last_turns_prompt_and_answer() -> None:
    spec = parse_workload(_workload(agents=0.0, turns=6, think_s=5))
    reqs = generate(spec, None, random.Random(4))
    assert reqs.blocks is not None and reqs.session is not None
    by_session: dict[int, list[int]] = {}
    for i, s in enumerate(reqs.session):
        by_session.setdefault(s, []).append(i)
    multi = [ids for ids in by_session.values() if len(ids) > 1]
    assert len(multi) > 10
    for ids in multi[:20]:
        for prev, nxt in itertools.pairwise(ids):
            covered = (reqs.input_tokens[prev] + reqs.output_tokens[prev]) // 64
            assert reqs.blocks[nxt][:covered] == reqs.blocks[prev][:covered]
            assert reqs.input_tokens[nxt] > reqs.input_tokens[prev] + reqs.output_tokens[prev]
            assert reqs.arrival_s[nxt] >= reqs.arrival_s[prev]
    # Requests arrive at about the rate asked for (sessions at rate / turns).
    assert 0.8 * 8 < len(reqs) / 300 < 1.15 * 8


def test_prefix_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"workload\.prefix\.agents"):
        parse_workload(_workload(agents=1.5))
    with pytest.raises(ConfigError, match=r"workload\.prefix\.tenant"):
        parse_workload(_workload(tenant=3))
    with pytest.raises(ConfigError, match=r"workload\.prefix\.block_tokens"):
        parse_workload(_workload(block_tokens=0.5))


def test_mooncake_traces_are_read_with_their_hash_ids(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.jsonl"
    rows = [{"timestamp": 2000, "input_length": 1100, "output_length": 20, "hash_ids": [0, 1, 2]},
            {"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [0, 3]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    got = read_trace(path)
    assert got.arrival_s == [0.0, 2.0] and got.input_tokens == [600, 1100]
    assert got.blocks == [(0, 3), (0, 1, 2)] and got.block_tokens == 512
    spec = parse_workload({"duration_s": 10, "arrival": {"process": "trace", "path": str(path),
                                                          "time_scale": 0.5}})
    scaled = generate(spec, None, random.Random(0))
    assert scaled.arrival_s == [0.0, 1.0] and scaled.blocks == [(0, 3), (0, 1, 2)]
    (tmp_path / "bad.jsonl").write_text(json.dumps({**rows[0], "hash_ids": "x"}) + "\n")
    with pytest.raises(ConfigError, match="hash_ids"):
        read_trace(tmp_path / "bad.jsonl")
    with pytest.raises(ConfigError, match="prefix"):
        parse_workload({"duration_s": 10, "arrival": {"process": "trace", "path": str(path)},
                        "prefix": {}})


def test_a_simulated_run_reports_prefix_cache_use() -> None:
    raw = {"name": "p", "seed": 3, "model": "llama-3.1-8b", "slo": {"ttft_s": 2.0, "tpot_s": 0.1},
           "fleet": [{"gpu": "H100-SXM", "count": 1}, {"gpu": "L4", "count": 2}],
           "workload": {**_workload(), "duration_s": 120, "warmup_s": 20,
                        "arrival": {"process": "poisson", "load": 1.0}},
           "policies": ["tailguard", "cache_aware", "round_robin"]}
    res = simulate(parse_scenario(raw))["results"]
    for name in ("tailguard", "cache_aware", "round_robin"):
        pre = res[name]["prefix"]
        assert 0.0 < pre["hit_rate"] < 1.0
        assert pre["prefill_tokens_saved"] > 0
    # Affinity: both cache-aware routers hit far more than round robin, which spreads sessions.
    assert res["tailguard"]["prefix"]["hit_rate"] > 1.2 * res["round_robin"]["prefix"]["hit_rate"]
    assert res["tailguard"]["prefix"]["hit_rate"] >= 0.8 * res["cache_aware"]["prefix"]["hit_rate"]
    assert res["tailguard"]["ttft_s"]["p99"] < res["cache_aware"]["ttft_s"]["p99"]


def test_the_cli_and_the_report_show_prefix_cache_use(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from tailguard.cli import main

    scenario = tmp_path / "s.json"  # YAML's superset: JSON reads as a scenario too
    scenario.write_text(json.dumps({
        "name": "p", "seed": 3, "model": "llama-3.1-8b",
        "fleet": [{"gpu": "H100-SXM", "count": 1}, {"gpu": "L4", "count": 1}],
        "workload": {**_workload(), "duration_s": 40, "warmup_s": 10},
        "policies": ["tailguard", "cache_aware"]}))
    report = tmp_path / "r.html"
    assert main(["sim", str(scenario), "--report", str(report), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "prefix caches" in out and "hit rate" in out
    assert "Prefix caches" in report.read_text()


def test_a_node_that_cannot_prefill_the_prompts_in_time_has_no_capacity_at_once() -> None:
    import time

    from tailguard.sim.capacity import fleet_capacity

    raw = {"name": "c", "seed": 1, "model": "llama-3.1-8b", "slo": {"ttft_s": 1.0, "tpot_s": 0.1},
           "fleet": [{"gpu": "L4", "count": 1}, {"gpu": "H100-SXM", "count": 1}],
           "workload": {"duration_s": 60, "arrival": {"process": "poisson", "rate": 1},
                        "input_tokens": {"dist": "fixed", "value": 12000},
                        "output_tokens": {"dist": "fixed", "value": 20}}}
    t0 = time.perf_counter()
    cap = fleet_capacity(parse_scenario(raw))
    assert cap["L4#0"] == 0.0 and cap["H100-SXM#0"] > 0.0
    assert time.perf_counter() - t0 < 20.0
