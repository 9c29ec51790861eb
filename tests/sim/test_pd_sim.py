"""Disaggregated prefill and decode in the simulator: both legs on their engines,
the KV held on the prefill node until the decode node has it, transfers timed
by the pair's link, a prefill node crashing under load, and what P/D buys on
long prompts and costs nothing on short ones."""

from __future__ import annotations

import random
from typing import Any

import pytest

from tailguard.config.faults import FaultSpec
from tailguard.core.balancer import Balancer, PoolConfig
from tailguard.core.exchange import Exchange
from tailguard.core.hardware import DEFAULT_CATALOG, perf_model
from tailguard.core.kv_transfer import LINKS, Link
from tailguard.core.outliers import OutlierConfig
from tailguard.core.policies import Slo
from tailguard.engine import EngineConfig
from tailguard.sim.cluster import OK, ClusterSim, node_specs
from tailguard.sim.run import RunOptions, simulate
from tailguard.sim.scenario import NodePlan, PolicyChoice, parse_scenario

MODEL = "llama-3.1-8b"


def plans(roles: dict[str, str]) -> list[NodePlan]:
    out = []
    for gpu, count in (("H100-SXM", 2), ("A100-80GB", 3)):
        perf = perf_model(gpu, MODEL)
        out += [NodePlan(f"{gpu}#{i}", 0, perf, EngineConfig(), 1.0, roles.get(gpu, "both"))
                for i in range(count)]
    return out


def run(policy: str, roles: dict[str, str], n: int = 600, faults: tuple[FaultSpec, ...] = (),
        link: Link = LINKS["rdma-4x200"]) -> ClusterSim:
    rng = random.Random(4)
    t, arrivals, prompts, outputs = 0.0, [], [], []
    for _ in range(n):
        t += rng.expovariate(2.0)
        arrivals.append(t)
        prompts.append(min(60_000, int(rng.lognormvariate(8.8, 0.9))))
        outputs.append(max(2, int(rng.lognormvariate(5.0, 0.6))))
    ps = plans(roles)
    balancer = Balancer(node_specs(ps, MODEL),
                        [PoolConfig(MODEL, policy, slo=Slo(5.0, 0.05), kv_link=link)],
                        random.Random(1), outliers=OutlierConfig(enabled=bool(faults)))
    sim = ClusterSim(balancer, ps, MODEL, arrivals, prompts, outputs, seed=1,
                     network_rtt_s=0.001, faults=faults, step_by_step=False, limited=False,
                     priorities=None, exchange_type=Exchange)
    sim.run(1e9, 1.0, None)
    return sim


PD = {"H100-SXM": "prefill", "A100-80GB": "decode"}


@pytest.mark.parametrize("policy", ["tailguard", "round_robin", "dynamo"])
def test_every_request_is_served_and_every_held_kv_freed(policy: str) -> None:
    sim = run(policy, PD)
    rec = sim.rec
    assert rec.status.count(OK) == len(rec.arrival)
    remote = [i for i, p in enumerate(rec.prefill_node) if p >= 0]
    assert len(remote) > len(rec.arrival) // 2
    for i in remote:  # computed on an H100, decoded on an A100
        assert rec.node_ids[rec.prefill_node[i]].startswith("H100")
        assert rec.node_ids[rec.node[i]].startswith("A100")
    for ns in sim.nodes:
        assert ns.engine.num_held == 0 and ns.engine.kv_used_blocks == 0, ns.plan.id
        if ns.plan.role == "decode":
            assert ns.engine.prompt_tokens_total > 0
    for n in sim.balancer.nodes.values():
        assert (n.in_flight, n.prefill_backlog, n.decoding, n.awaiting_kv) == (0, 0, 0, 0), n.id
    assert sim.balancer.double_release == 0


def test_a_transfer_takes_the_pairs_link_time() -> None:
    link = Link(10.0, 0.004)
    sim = run("round_robin", PD, n=100, link=link)
    rec = sim.rec
    per_token = DEFAULT_CATALOG.model(MODEL).kv_bytes_per_token
    for i, p in enumerate(rec.prefill_node):
        assert p >= 0
        assert rec.kv_s[i] == pytest.approx(0.004 + rec.prompt[i] * per_token / 10e9)
        # The first token comes after the prefill, the transfer and a decode step.
        assert rec.first[i] - rec.arrival[i] > rec.kv_s[i]


def test_a_prefill_node_crash_loses_no_request() -> None:
    crash = FaultSpec(kind="crash", node="H100-SXM#0", at_s=60.0, duration_s=60.0)
    sim = run("tailguard", PD, faults=(crash,))
    rec = sim.rec
    assert rec.status.count(OK) == len(rec.arrival)  # retried on the other pair, or recomputed
    assert rec.retries > 0
    for ns in sim.nodes:
        assert ns.engine.num_held == 0 and ns.engine.kv_used_blocks == 0, ns.plan.id
    assert sim.balancer.double_release == 0


def scenario(roles: dict[str, str], prompts: dict[str, Any], rate: float) -> Any:
    return parse_scenario({
        "name": "pd", "seed": 2, "model": MODEL, "slo": {"ttft_s": 5.0, "tpot_s": 0.05},
        "network_rtt_s": 0.001,
        "fleet": [{"gpu": "H100-SXM", "count": 2, "role": roles.get("H100-SXM", "both")},
                  {"gpu": "A100-80GB", "count": 4, "role": roles.get("A100-80GB", "both")}],
        "workload": {"duration_s": 600, "warmup_s": 60,
                     "arrival": {"process": "poisson", "rate": rate},
                     "input_tokens": prompts,
                     "output_tokens": {"dist": "lognormal", "mu": 5.5, "sigma": 0.7,
                                       "min": 2, "max": 2000}}})


LONG = {"dist": "lognormal", "mu": 9.1, "sigma": 0.9, "min": 64, "max": 100_000}


def result(roles: dict[str, str], prompts: dict[str, Any], rate: float) -> dict[str, Any]:
    doc = simulate(scenario(roles, prompts, rate), [PolicyChoice("tailguard")],
                   RunOptions(rate=rate))
    r: dict[str, Any] = doc["results"]["tailguard"]
    return r


def test_long_prompts_decode_faster_on_a_split_fleet() -> None:
    colo, split = result({}, LONG, 2.5), result(PD, LONG, 2.5)
    assert split["tpot_s"]["p99"] < 0.8 * colo["tpot_s"]["p99"]
    assert split["slo_attainment"] >= colo["slo_attainment"] - 0.002
    pd = split["disaggregation"]
    assert pd["remote_share"] > 0.5 and set(pd["prefill_share_by_gpu"]) == {"H100-SXM"}
    assert 0.0 < pd["prefill_leg_s"]["p50"] < split["ttft_s"]["p99"]


def test_short_prompts_lose_nothing_where_the_prefill_nodes_also_decode() -> None:
    short = {"dist": "azure-conv"}
    colo, split = result({}, short, 3.0), result({"A100-80GB": "decode"}, short, 3.0)
    assert split["ttft_s"]["p99"] <= 1.05 * colo["ttft_s"]["p99"]
    assert split["slo_attainment"] >= colo["slo_attainment"] - 0.001
    assert split["disaggregation"]["remote_share"] < 0.2  # the bypass


def straggler_run(fault: dict[str, Any] | None) -> dict[str, Any]:
    """A mixed P/D fleet (H100 and L40S prefill, A100 and L40S decode) under long
    prompts, with one fault from 200 s to 400 s."""
    scn = parse_scenario({
        "name": "pd-faults", "seed": 7, "model": MODEL,
        "slo": {"ttft_s": 5.0, "tpot_s": 0.05}, "network_rtt_s": 0.001,
        "fleet": [{"gpu": "H100-SXM", "count": 2, "role": "prefill", "speed_spread": 0.1},
                  {"gpu": "L40S", "count": 2, "role": "prefill", "speed_spread": 0.1},
                  {"gpu": "A100-80GB", "count": 4, "role": "decode", "speed_spread": 0.1},
                  {"gpu": "L40S", "count": 2, "role": "decode", "speed_spread": 0.1}],
        "workload": {"duration_s": 600, "warmup_s": 60,
                     "arrival": {"process": "poisson", "rate": 2.5},
                     "input_tokens": LONG,
                     "output_tokens": {"dist": "lognormal", "mu": 5.5, "sigma": 0.7,
                                       "min": 2, "max": 2000}},
        "faults": [dict(fault, at_s=200, duration_s=200)] if fault else []})
    r: dict[str, Any] = simulate(scn, [PolicyChoice("tailguard")])["results"]["tailguard"]
    return r


@pytest.mark.parametrize(("fault", "named"), [
    ({"node": "H100-SXM#0", "kind": "throttle", "factor": 0.5}, "H100-SXM#0"),
    ({"node": "A100-80GB#0", "kind": "throttle", "factor": 0.5}, "A100-80GB#0"),
    ({"node": "A100-80GB#0", "kind": "kv_link", "factor": 0.1}, "->A100-80GB#0"),
])
def test_a_slow_prefill_node_decode_node_or_link_is_found_and_named(
        fault: dict[str, Any], named: str) -> None:
    r = straggler_run(fault)
    (hit,) = r["outliers"]["time_to_detect"]
    assert hit["detected_s"] is not None and hit["detected_s"] <= 15.0, hit
    assert r["outliers"]["false_detections"] == 0
    first = next(e for e in r["events"] if e["state"] in ("degraded", "slow"))
    assert first["node"].endswith(named)
    # The phase or the link is in the reason.
    phase = {"throttle": "prefill" if "H100" in named else "decode", "kv_link": "KV"}
    assert phase[fault["kind"]] in first["reason"]


def test_a_healthy_pd_fleet_shows_no_detection() -> None:
    r = straggler_run(None)
    assert r["outliers"]["false_detections"] == 0 and not r.get("events")
