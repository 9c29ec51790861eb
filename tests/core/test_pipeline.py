"""Pipeline-parallel replicas (core/pipeline.py): the step model against hand-derived
figures, the layer split, overlap, and a mixed H100+A100 pipeline in the simulator."""

from __future__ import annotations

import random
from typing import Any

import pytest

from tailguard.core.balancer import Balancer, PoolConfig
from tailguard.core.fleet import NodeSpec
from tailguard.core.hardware import DEFAULT_CATALOG, GPU, PerfModel
from tailguard.core.pipeline import Layout, PipelinePerf, StageSpec, pipeline_perf, split_layers
from tailguard.errors import ConfigError
from tailguard.sim.run import RunOptions, simulate
from tailguard.sim.scenario import PolicyChoice, parse_scenario

QWEN = DEFAULT_CATALOG.model("qwen2.5-32b")  # 65.6 GB: fits one 80 GB card, and halves
H100 = DEFAULT_CATALOG.gpu("H100-SXM")
A100 = DEFAULT_CATALOG.gpu("A100-80GB")


def test_two_equal_stages_match_the_hand_derived_pipeline() -> None:
    """Hand derivation (two A100 stages of 32 layers each, vLLM's two micro-batches):

    * batch 1: one micro-batch crosses both stages in turn, so a token takes what
      the whole model takes on one card (plus a send): a pipeline buys no latency;
    * large batches: each stage streams its half of the weights once per
      micro-batch, twice per iteration, so an iteration reads the weights once
      in all, as one card would, but half the KV per stage: slightly faster than
      one card at the same batch, and TP-2 (each card half the weights, once) is
      the faster of the two by about the weights' share;
    * KV: each card holds half the weights, so the pipeline's cache is the
      memory left on two cards, 14x one card's for this model.
    """
    pp = pipeline_perf([StageSpec(A100), StageSpec(A100)], QWEN, split="even")
    one, tp2 = PerfModel(A100, QWEN, 1), PerfModel(A100, QWEN, 2)
    assert pp.layers == (32, 32) and pp.gpus == 2
    assert pp.step_time(1, 1024) == pytest.approx(one.step_time(1, 1024), rel=0.01)
    ctx = 64 * 1024.0
    weights = one.weight_s
    # The iteration: overhead + 2 x (half the weights + half the KV of 32 sequences).
    half = pp._stages[0]
    by_hand = (pp.params.step_overhead_s
               + 2 * (half.weight_s + half.kv_s * ctx / 2 + half.fixed_s + pp.params.pp_link_latency_s
                      + 32 * QWEN.hidden * 2 / (pp.params.pp_link_gbps * 1e9)))
    assert pp.step_time(64, ctx) == pytest.approx(by_hand, rel=1e-9)
    assert half.weight_s * 2 == pytest.approx(weights, rel=1e-9)
    assert tp2.step_time(64, ctx) < pp.step_time(64, ctx) < one.step_time(64, ctx)
    assert pp.kv_capacity_tokens > 10 * one.kv_capacity_tokens


def test_the_speed_split_balances_an_h100_and_an_a100() -> None:
    even = pipeline_perf([StageSpec(H100), StageSpec(A100)], QWEN, split="even")
    speed = pipeline_perf([StageSpec(H100), StageSpec(A100)], QWEN, split="speed")
    # HBM bandwidth 3.35 vs 2.04 TB/s: decode-bound stages balance near 1.64:1.
    assert speed.layers == (40, 24)
    assert even.step_time(128, 128 * 768.0) / speed.step_time(128, 128 * 768.0) > 1.25
    # The split is the layers' (a given list is checked against the model).
    given = Layout((StageSpec(H100), StageSpec(A100)), (40, 24))
    assert split_layers(given, QWEN) == (40, 24)
    with pytest.raises(ConfigError, match="summing to 64"):
        split_layers(Layout((StageSpec(H100), StageSpec(A100)), (40, 40)), QWEN)
    # Memory binds before speed: an H100's speed with 40 GB would take 40 layers
    # (41 GB of weights); it holds what fits (35 GB usable: 33 layers with their KV).
    small = GPU("H100-40GB", H100.tflops, H100.mem_bw_gbps, 40, 700, 4.0)
    lay = split_layers(Layout((StageSpec(small), StageSpec(A100))), QWEN)
    per_layer = (QWEN.weight_bytes + 2048 * QWEN.kv_bytes_per_token) / QWEN.layers / 1e9
    assert lay[0] == int((40 * 0.9 - 1) / per_layer) == 33 and sum(lay) == QWEN.layers
    with pytest.raises(ConfigError, match="does not fit"):
        split_layers(Layout((StageSpec(small), StageSpec(small))), DEFAULT_CATALOG.model(
            "llama-3.1-70b"))


def test_overlap_hides_the_sends_on_a_slow_link() -> None:
    """On a 0.1 GB/s link a micro-batch of 32 tokens' activations (32 x 5120 x 2 bytes)
    takes 3.3 ms to send: without overlap it adds to the first stage's time, with
    overlap the stage takes the longer of its compute and its send."""
    stages = [StageSpec(A100), StageSpec(A100)]
    plain = PipelinePerf(A100, QWEN, layout=Layout(tuple(stages), "even", link_gbps=0.1))
    over = PipelinePerf(A100, QWEN, layout=Layout(tuple(stages), "even", overlap=True,
                                                  link_gbps=0.1))
    send = 10e-6 + 32 * QWEN.hidden * 2 / 0.1e9
    ctx = 64 * 1024.0
    assert plain.step_time(64, ctx) - over.step_time(64, ctx) == pytest.approx(2 * send, rel=1e-6)


def test_a_pipeline_is_its_own_class_and_the_router_prices_it_so() -> None:
    lay = Layout((StageSpec(H100), StageSpec(A100)))
    spec = NodeSpec("p0", H100, H100.name, models=("qwen2.5-32b",), layout=lay)
    assert spec.gpu_class == "H100-SXM+A100-80GB"
    assert Layout((StageSpec(A100, 2), StageSpec(A100, 2))).name == "2xA100-80GB-PP2"
    b = Balancer([spec, NodeSpec("h0", H100, H100.name, models=("qwen2.5-32b",))],
                 [PoolConfig("qwen2.5-32b")], random.Random(1))
    perf = b.nodes["p0"].perf
    assert isinstance(perf, PipelinePerf) and perf.layers == (40, 24)
    assert not isinstance(b.nodes["h0"].perf, PipelinePerf)


def scenario(entry: dict[str, Any]) -> dict[str, Any]:
    return {"name": "pp", "seed": 1, "model": "qwen2.5-32b",
            "slo": {"ttft_s": 5.0, "tpot_s": 0.2},
            "fleet": [{**entry, "count": 2}],
            "workload": {"duration_s": 200, "warmup_s": 30,
                         "arrival": {"process": "poisson", "rate": 1.0},
                         "input_tokens": {"dist": "fixed", "value": 512},
                         "output_tokens": {"dist": "fixed", "value": 256}}}


def test_a_speed_split_carries_a_quarter_more_than_an_even_one_in_the_simulator() -> None:
    """Two PP-2 replicas of an H100 and an A100: the SLO goodput (the highest rate at
    99% attainment) with the layers split by speed is a quarter over the even split's
    (about 1.33x in 200 s runs)."""
    stages = [{"gpu": "H100-SXM"}, {"gpu": "A100-80GB"}]
    opts = RunOptions(find_goodput=True)
    res = {split: simulate(parse_scenario(scenario({"stages": stages, "split": split})),
                           [PolicyChoice("tailguard")], opts)["results"]["tailguard"]
           for split in ("even", "speed")}
    assert res["speed"]["max_goodput_rps"] >= 1.25 * res["even"]["max_goodput_rps"]


def test_pipeline_entries_are_checked() -> None:
    ok = parse_scenario(scenario({"gpu": "A100-80GB", "pp": 2, "split": "even"}))
    assert [n.id for n in ok.nodes()] == ["A100-80GB-PP2#0", "A100-80GB-PP2#1"]
    with pytest.raises(ConfigError, match=r"fleet\[0\]\.split"):
        parse_scenario(scenario({"gpu": "A100-80GB", "split": "even"}))  # no pipeline
    with pytest.raises(ConfigError, match=r"fleet\[0\]\.split"):
        parse_scenario(scenario({"gpu": "A100-80GB", "pp": 2, "split": "fast"}))
    with pytest.raises(ConfigError, match=r"fleet\[0\]\.gpu: give it per stage"):
        parse_scenario(scenario({"gpu": "A100-80GB", "stages": [{"gpu": "H100"}]}))
    with pytest.raises(ConfigError, match=r"fleet\[0\]\.stages\[1\]\.gpu"):
        parse_scenario(scenario({"stages": [{"gpu": "H100"}, {"gpu": "Z9"}]}))
    with pytest.raises(ConfigError, match="does not fit"):
        parse_scenario(scenario({"stages": [{"gpu": "T4"}, {"gpu": "T4"}]}))
    # A throttle may name any GPU of the pipeline (here 2 stages x TP-2 = 4).
    raw = scenario({"gpu": "A100-80GB", "tp": 2, "pp": 2})
    raw["faults"] = [{"node": "2xA100-80GB-PP2#0", "kind": "throttle", "factor": 0.5,
                      "gpu_index": 3, "at_s": 60}]
    parse_scenario(raw)
    raw["faults"][0]["gpu_index"] = 4
    with pytest.raises(ConfigError, match="gpu_index"):
        parse_scenario(raw)


def test_a_fleet_files_pipeline_node_reaches_the_router_and_recordings() -> None:
    from tailguard.config.fleet import parse_node
    from tailguard.core.record import from_jsonable, spec_to_dict

    node = parse_node({"id": "p0", "url": "http://127.0.0.1:9", "models": ["qwen2.5-32b"],
                       "stages": [{"gpu": "H100"}, {"gpu": "A100"}], "split": [36, 28]},
                      "nodes[0]")
    spec = node.spec()
    assert node.gpu == spec.gpu_class == "H100-SXM+A100-80GB"
    # A recording's node comes back the same, its split a list read back as layers.
    back = from_jsonable(NodeSpec, spec_to_dict(spec))
    b = Balancer([back], [PoolConfig("qwen2.5-32b")], random.Random(1))
    perf = b.nodes["p0"].perf
    assert isinstance(perf, PipelinePerf) and perf.layers == (36, 28)
    with pytest.raises(ConfigError, match=r"nodes\[0\]\.tp: give it per stage"):
        parse_node({"id": "p0", "url": "http://127.0.0.1:9", "models": ["m"], "tp": 2,
                    "stages": [{"gpu": "H100"}]}, "nodes[0]")
    pp = parse_node({"id": "p1", "url": "http://127.0.0.1:9", "models": ["m"], "gpu": "A100",
                     "tp": 2, "pp": 2}, "nodes[1]")
    assert pp.gpu == "2xA100-80GB-PP2" and pp.layout is not None and pp.layout.gpus == 4
    # The gateway's metrics and remediation name the class the detector judges by.
    assert pp.gpu_class == pp.spec().gpu_class == "2xA100-80GB-PP2"
    assert node.gpu_class == spec.gpu_class
