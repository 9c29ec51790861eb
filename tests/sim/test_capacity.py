"""SLO capacity probes: common random numbers, and probes long enough to mean it."""

from __future__ import annotations

import random

import pytest

from tailguard.core.hardware import DEFAULT_CATALOG, PerfModel
from tailguard.core.policies import Slo
from tailguard.planner.plan import engine_plan
from tailguard.planner.verify import base_scenario
from tailguard.sim.capacity import (
    NODE_SPAN_S,
    PROBE_REQUESTS,
    WARMUP_SHARE,
    ProbeStream,
    _meets,
    _met_alone,
    node_capacity,
    probe_workload,
    replica_capacity,
)
from tailguard.sim.cluster import run_cluster
from tailguard.sim.results import attainment
from tailguard.sim.scenario import NodePlan

MODEL = DEFAULT_CATALOG.model("llama-3.1-8b")
SLO = Slo(2.0, 0.1, 0.9)


def test_a_probe_stream_grows_as_one_prefix_and_compares_by_its_draws() -> None:
    scn = base_scenario(MODEL.name, SLO, DEFAULT_CATALOG)
    stream = ProbeStream(scn)
    gaps, prompts, outputs = probe_workload(scn)
    assert (stream.gaps, stream.prompts, stream.outputs) == (list(gaps), list(prompts),
                                                             list(outputs))
    stream.grow(PROBE_REQUESTS * 2 + 1)
    assert len(stream.gaps) == len(stream.prompts) == len(stream.outputs) == PROBE_REQUESTS * 3
    assert stream.gaps[:PROBE_REQUESTS] == list(gaps)
    other = ProbeStream(scn)  # another scenario object of the same workload: the same stream
    assert other == stream and hash(other) == hash(stream)
    other.grow(PROBE_REQUESTS * 3)
    assert (other.gaps, other.prompts) == (stream.gaps, stream.prompts)
    assert ProbeStream(base_scenario(MODEL.name, SLO, DEFAULT_CATALOG, seed=2)) != stream


def test_short_probes_overrate_a_fast_pool_and_spanned_ones_hold_over_a_long_run() -> None:
    """Two H100s serving an 8B model carry ~55 req/s: 1500 requests are 27 s of
    arrivals, too few for the batch and the queue to settle (an answer lives ~20 s
    at a 100 ms TPOT). A 120 s run at the short probes' rate misses the target; at
    the rate of probes spanning 120 s it holds (as a measurement of that length
    will: the planner spans its probes as long as --verify runs)."""
    scn = base_scenario(MODEL.name, SLO, DEFAULT_CATALOG)
    perf = PerfModel(DEFAULT_CATALOG.gpu("H100-SXM"), MODEL, 1)
    engine = engine_plan(perf, SLO.tpot_s, 1155.0, 211.0).engine
    short = replica_capacity(scn, perf, engine, copies=2)
    spanned = replica_capacity(scn, perf, engine, copies=2, span_s=120.0)
    assert spanned < 0.95 * short, (spanned, short)
    stream = ProbeStream(scn)
    assert not _meets(perf, engine, SLO, stream, 2, 120.0, short)
    assert _meets(perf, engine, SLO, stream, 2, 120.0, spanned)


def test_a_nodes_capacity_is_probed_over_node_span_s_and_unchanged_where_1500_requests_span_it() -> None:
    """The capacity bound (what ``load:`` is a share of): a 3B model on one B200
    carries ~130 req/s, where 1500 requests are 7 s of arrivals; an 8B model on one
    A100 ~7 req/s, where they span minutes and the bound stays what it was."""
    def capacities(model: str, gpu: str, tpot: float) -> tuple[float, float]:
        m = DEFAULT_CATALOG.model(model)
        scn = base_scenario(m.name, Slo(2.0, tpot, 0.9), DEFAULT_CATALOG)
        perf = PerfModel(DEFAULT_CATALOG.gpu(gpu), m, 1)
        engine = engine_plan(perf, tpot, 1155.0, 211.0).engine
        node = node_capacity(scn, NodePlan("n", 0, perf, engine))
        return replica_capacity(scn, perf, engine), node

    short, node = capacities("llama-3.1-8b", "A100-80GB", 0.1)
    assert node == short and PROBE_REQUESTS / short > NODE_SPAN_S
    short, node = capacities("llama-3.2-3b", "B200", 0.05)
    assert node < 0.8 * short, (node, short)


def test_a_node_that_misses_long_prompts_alone_is_named_with_its_reason() -> None:
    """Long prompts: an L4 cannot hold the longest in its KV cache nor prefill many of
    them in time even alone, so its capacity on the whole mix is 0 and ``misses_alone``
    says why; an H100 serves them all. The fleet's bound is then split: the L4 gets
    the short prompts (sim/fleet_bound.py)."""
    from tailguard.sim.capacity import misses_alone
    from tailguard.sim.run import RunOptions, simulate
    from tailguard.sim.scenario import parse_scenario

    scn = parse_scenario({
        "name": "long", "seed": 3, "model": MODEL.name, "slo": {"ttft_s": 5.0, "tpot_s": 0.15},
        "fleet": [{"gpu": "H100-SXM", "count": 1}, {"gpu": "L4", "count": 1}],
        "workload": {"duration_s": 20, "arrival": {"process": "poisson", "load": 0.5},
                     "input_tokens": {"dist": "lognormal", "mu": 9.1, "sigma": 0.9,
                                      "max": 100000},
                     "output_tokens": {"dist": "fixed", "value": 50}},
        "policies": ["tailguard"]})
    h100, l4 = scn.nodes()
    assert sum(misses_alone(scn, h100).values()) < 0.05
    l4_misses = misses_alone(scn, l4)
    assert l4_misses.get("kv", 0.0) > 0.0 and l4_misses.get("ttft", 0.0) > 0.0
    assert node_capacity(scn, l4) == 0.0
    doc = simulate(scn, opts=RunOptions(duration_s=20))
    bands = doc["capacity_bands"]
    assert bands["L4"]["prompt_tokens"][1] <= bands["H100-SXM"]["prompt_tokens"][0]
    assert doc["node_capacity_rps"]["L4#0"] > 0.0 and "warnings" not in doc
    short = parse_scenario({
        "name": "short", "model": MODEL.name, "fleet": [{"gpu": "L4", "count": 1}],
        "workload": {"duration_s": 10, "arrival": {"process": "poisson", "rate": 1},
                     "input_tokens": {"dist": "fixed", "value": 500},
                     "output_tokens": {"dist": "fixed", "value": 50}}})
    assert misses_alone(short, short.nodes()[0]) == {}


@pytest.mark.parametrize(("gpu", "prompt_mu", "rate", "horizon_s"), [
    ("H100-SXM", 7.0, 20.0, 1e9),  # busy, within the SLO
    ("H100-SXM", 7.0, 28.0, 1e9),  # over capacity: the queue grows
    ("L4", 8.5, 0.1, 1e9),  # long prompts: some miss TTFT, some cannot fit its KV
    ("A100-80GB", 7.0, 6.0, 60.0),  # cut off at the horizon with requests unfinished
])
def test_a_lone_nodes_probe_gives_what_the_full_simulator_gives(
        gpu: str, prompt_mu: float, rate: float, horizon_s: float) -> None:
    """A probe of one node drives its engine directly (``_met_alone``): nothing
    between the client and a lone node may change a request's timing, so the
    attainment is exactly the simulated gateway's."""
    rng = random.Random(f"{gpu}:{rate}")
    n = 800
    t, arrivals = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        arrivals.append(t)
    prompts = [min(60_000, max(1, int(rng.lognormvariate(prompt_mu, 0.9)))) for _ in range(n)]
    outputs = [max(1, int(rng.expovariate(1 / 150))) for _ in range(n)]
    perf = PerfModel(DEFAULT_CATALOG.gpu(gpu), MODEL, 1)
    engine = engine_plan(perf, SLO.tpot_s, 1155.0, 211.0).engine
    start = arrivals[int(n * WARMUP_SHARE)]
    rec = run_cluster([NodePlan("n", 0, perf, engine)], MODEL.name, arrivals, prompts,
                      outputs, policy="round_robin", slo=SLO, seed=0, horizon_s=horizon_s)
    full = attainment(rec, SLO, start)
    assert 0.0 < full < 1.0  # each case has requests that miss and requests that meet
    assert _met_alone(perf, engine, SLO, arrivals, prompts, outputs, horizon_s, start) == full
