"""One GPU of a TP replica throttled, in the simulator: the replica's pace, detection, the cause."""

from __future__ import annotations

from typing import Any

import pytest

from tailguard.config.faults import FaultSpec
from tailguard.errors import ConfigError
from tailguard.sim.nodes import SimNode, apply_fault
from tailguard.sim.run import simulate
from tailguard.sim.scenario import PolicyChoice, parse_scenario


def scenario(faults: list[dict[str, Any]], duration: float = 160.0,
             **extra: Any) -> dict[str, Any]:
    return {
        "name": "tp", "seed": 3, "model": "llama-3.1-70b", "slo": {"ttft_s": 2.0, "tpot_s": 0.1},
        "fleet": [{"gpu": "A100-80GB", "count": 4, "tp": 4, "speed_spread": 0.05},
                  {"gpu": "H100-SXM", "count": 1, "tp": 4}],
        "workload": {"duration_s": duration, "warmup_s": 30,
                     "arrival": {"process": "poisson", "load": 0.6},
                     "input_tokens": {"dist": "azure-conv"},
                     "output_tokens": {"dist": "azure-conv"}},
        "faults": faults, **extra,
    }


def run(raw: dict[str, Any]) -> dict[str, Any]:
    out = simulate(parse_scenario(raw), [PolicyChoice("tailguard")])
    res: dict[str, Any] = out["results"]["tailguard"]
    return res


def test_a_replica_steps_at_its_slowest_ranks_pace() -> None:
    plan = parse_scenario(scenario([])).nodes()[0]
    ns = SimNode(0, plan, step_by_step=False)
    base = ns.speed

    def fault(**kw: Any) -> FaultSpec:
        return FaultSpec("throttle", 0.0, node=plan.id, **kw)

    def step(batch: int) -> float:
        return ns.engine.perf.step_time(batch, batch * 1024.0) / ns.speed

    healthy = {b: step(b) for b in (1, 64)}
    half, slower = fault(factor=0.5, gpu_index=2), fault(factor=0.8, gpu_index=0)
    apply_fault(half, False, ns, 0.0, lambda *_: None, lambda *_: None)
    # TP-4 (Llama-3.1-70B on A100s, 31.6 ms a step at batch 1) with one GPU at 50%:
    # every step waits for it, so its GPU-side work doubles (weights 23.1 ms, kernel
    # launches 2.4 ms) while the host's 2 ms and the all-reduces' 4 ms of link
    # latency do not: 57.1 ms, 1.81x (the same at batch 64, KV reads included).
    one_rank = {b: step(b) / healthy[b] for b in (1, 64)}
    assert one_rank[1] == pytest.approx(1.81, abs=0.01)
    assert one_rank[64] == pytest.approx(1.81, abs=0.01)
    apply_fault(slower, False, ns, 0.0, lambda *_: None, lambda *_: None)
    assert step(1) / healthy[1] == pytest.approx(one_rank[1])  # the slowest rank only
    whole = fault(factor=0.5)
    apply_fault(whole, False, ns, 0.0, lambda *_: None, lambda *_: None)
    # a replica-wide cause on top multiplies
    assert step(1) / healthy[1] == pytest.approx(2 * one_rank[1])
    assert ns.speed == pytest.approx(0.5 * base)
    assert ns.gpu_cause() == ("gpu_throttle", "GPU 2 of 4: throttled to 50% of its clock "
                                              "(simulated)")
    for f in (half, whole):
        apply_fault(f, True, ns, 1.0, lambda *_: None, lambda *_: None)
    assert step(1) / healthy[1] == pytest.approx(1.20, abs=0.01)  # GPU 0 at 80% still
    apply_fault(slower, True, ns, 1.0, lambda *_: None, lambda *_: None)
    assert step(1) == pytest.approx(healthy[1]) and ns.gpu_cause()[0] == "gpus_healthy"


def test_a_throttled_gpu_slows_only_its_pipeline_stage() -> None:
    """PP-2 of TP-2 A100 stages: GPU 3 (the second stage's) at 50% doubles that stage's
    work only; the first stage keeps its pace, so the replica slows by less than a
    whole-replica throttle would, and more than nothing: the busier stage sets it."""
    raw = scenario([])
    raw["fleet"] = [{"gpu": "A100-80GB", "count": 1, "tp": 2, "pp": 2, "split": "even"}]
    plan = parse_scenario(raw).nodes()[0]
    ns = SimNode(0, plan, step_by_step=False)
    ctx = 64 * 1024.0
    healthy = ns.engine.perf.step_time(64, ctx)
    apply_fault(FaultSpec("throttle", 0.0, node=plan.id, factor=0.5, gpu_index=3), False, ns, 0.0,
                lambda *_: None, lambda *_: None)
    slowed = ns.engine.perf.step_time(64, ctx)
    assert 1.6 < slowed / healthy < 2.0
    assert ns.gpu_cause()[1].startswith("GPU 3 of 4")


def test_gpu_index_is_checked() -> None:
    with pytest.raises(ConfigError, match=r"faults\[0\]\.gpu_index"):
        parse_scenario(scenario([{"node": "A100-80GB#0", "kind": "throttle", "factor": 0.5,
                                  "gpu_index": 4}]))  # a TP-4 replica has GPUs 0..3
    with pytest.raises(ConfigError, match="gpu_index: does not apply to a stall"):
        parse_scenario(scenario([{"node": "A100-80GB#0", "kind": "stall", "gpu_index": 1}]))
    with pytest.raises(ConfigError, match="gpu_telemetry"):
        parse_scenario(scenario([], gpu_telemetry="yes"))


def test_a_throttled_gpu_is_caught_named_and_costs_no_more_than_a_whole_replica_throttle() -> None:
    one_gpu = [{"node": "A100-80GB#1", "kind": "throttle", "factor": 0.5, "gpu_index": 3,
                "at_s": 60, "duration_s": 80}]
    res = run(scenario(one_gpu, gpu_telemetry=True))
    det = res["outliers"]["time_to_detect"][0]
    # Each stream's decode is judged in one-second pieces as it runs (as live), a
    # node's pieces of one second as one sample: the issue asks for 15 s; measured
    # 3 s on seeds 1-6 (7-20 s judging whole answers)
    assert det["state"] in ("degraded", "quarantined") and det["detected_s"] <= 15.0
    assert res["outliers"]["false_detections"] == 0
    slow = [e for e in res["events"] if e["state"] in ("degraded", "quarantined")]
    assert slow and all(e["node"] == "A100-80GB#1" for e in slow)
    assert slow[0]["cause"] == "gpu_throttle"
    assert "GPU 3 of 4: throttled to 50%" in slow[0]["reason"]
    assert slow[0]["advice"].startswith("GPU 3 of 4 is throttling and holds the whole replica")
    # telemetry off: the same detection, no cause
    plain = run(scenario(one_gpu))
    assert all("cause" not in e for e in plain["events"])
    whole = run(scenario([{**one_gpu[0], "gpu_index": None}]))
    healthy = run(scenario([]))
    def p99(r: dict[str, Any]) -> float:
        return float(r["ttft_s"]["p99"])

    # One GPU at half speed (1.81x a step) costs about what the whole replica at half
    # speed (2x) does: P99 over the no-fault run 1.128 against 1.123 here; over seeds
    # 1, 2, 4: 1.076/1.038, 0.995/0.986, 0.992/1.003 (the milder fault is caught a
    # little later and weighed down a little less).
    assert p99(res) / p99(healthy) <= p99(whole) / p99(healthy) * 1.05
