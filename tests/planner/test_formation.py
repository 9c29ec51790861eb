"""`tailguard plan --inventory`: inventories, formation rules, the fleet file, --verify."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from tailguard.cli import main
from tailguard.config.fleet import load_fleet
from tailguard.core.events import remedy
from tailguard.core.hardware import DEFAULT_CATALOG, PerfModel
from tailguard.core.pipeline import StageSpec
from tailguard.core.policies import Slo
from tailguard.errors import ConfigError
from tailguard.planner.formation import (
    RATIO_TOLERANCE,
    Rated,
    Rater,
    Replica,
    Shape,
    plan_formation,
    single,
)
from tailguard.planner.inventory import exclude, parse_inventory
from tailguard.planner.inventory_cli import engine_flags
from tailguard.planner.naive import one_per_gpu, tp_across_types
from tailguard.planner.verify import base_scenario
from tailguard.sim.capacity import replica_capacity

CAT = DEFAULT_CATALOG


class RooflineRater(Rater):
    """Rates shapes by the roofline's throughput at the SLO instead of simulating them:
    the formation rules are under test here, not the capacities."""

    def rate(self, shape: Shape) -> Rated | None:
        perf = self.perf(shape)
        if perf is None:
            return None
        return Rated(shape, perf, self.plan(perf), self.rough_rps(shape))


def rater(model: str, tpot: float = 0.1, cls: type[Rater] = RooflineRater) -> Rater:
    m = CAT.model(model)
    return cls(base_scenario(m.name, Slo(2.0, tpot, 0.9), CAT), m, 1155.0, 211.0)


def test_the_issues_shape_loads_with_links_and_prices() -> None:
    inv = parse_inventory({"hosts": [{"name": "h1", "gpu": "H100-SXM", "count": 8, "link": "nvlink"},
                                     {"name": "a1", "gpu": "A100", "count": 4, "link": "pcie"},
                                     {"name": "l1", "gpu": "L4", "count": 2}],
                           "prices": {"H100-SXM": 3.0, "RTX4090": 0.3}})
    h1, a1, l1 = inv.hosts
    assert h1.gpu.name == "H100-SXM" and h1.gpu.interconnect_gbps == 450 and h1.gpu.price_per_hour == 3.0
    assert a1.gpu.name == "A100-80GB@pcie" and a1.gpu.interconnect_gbps == 32 and a1.catalog_gpu == "A100-80GB"
    assert l1.gpu.name == "L4" and l1.link == "pcie"
    assert inv.cost_per_hour == pytest.approx(8 * 3.0 + 4 * 2.21 + 2 * 0.81)
    assert [g.name for g in inv.prices] == ["H100-SXM", "RTX4090"]
    assert inv.catalog().gpu("A100-80GB@pcie").interconnect_gbps == 32


@pytest.mark.parametrize(("raw", "field"), [
    ({"hosts": [{"gpu": "L4", "count": 2, "link": "nvlink"}]}, "hosts[0].link"),
    ({"hosts": [{"gpu": "L4", "count": 0}]}, "hosts[0].count"),
    ({"hosts": [{"gpu": "Z9000"}]}, "hosts[0].gpu"),
    ({"hosts": [{"name": "x", "gpu": "L4"}, {"name": "x", "gpu": "T4"}]}, "hosts[1].name"),
    ({"hosts": []}, "hosts"),
    ({"hosts": [{"gpu": "L4"}], "prices": {"L4": -1}}, "prices.L4"),
    ({"hosts": [{"gpu": "L4", "speed": 2}]}, "hosts[0].speed"),
])
def test_bad_inventories_name_the_field(raw: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_inventory(raw)
    assert err.value.field == field


def test_re_forming_around_a_sick_gpu() -> None:
    """A detector event names the GPU; its advice points at --exclude, which forms
    the replicas on the host's other GPUs (device indices skip the excluded one)."""
    advice = remedy("gpu_throttle", 3, 4)
    assert "restart the replica on 4 other GPUs" in advice and "--exclude HOST:3" in advice
    assert remedy("gpus_healthy", None, 4).startswith("its GPUs are healthy")
    assert remedy("gpu_xid", 0, 1).startswith("GPU 0 is showing XID errors: move the replica")
    assert remedy("", None, 2) == ""
    inv = parse_inventory({"hosts": [{"name": "h1", "gpu": "H100-SXM", "count": 4},
                                     {"name": "h2", "gpu": "H100-SXM", "count": 1}]})
    left = exclude(inv, "h1:2, h2:0")
    assert [(h.name, h.count, h.usable) for h in left.hosts] == [("h1", 3, (0, 1, 3))]
    plan = plan_formation(left, rater("llama-3.1-8b"))
    assert sorted(r.devices for r in plan.replicas) == [((0,),), ((1,),), ((3,),)]
    for bad in ("h1:9", "h3:0", "h1", "h1:x"):
        with pytest.raises(ConfigError) as err:
            exclude(inv, bad)
        assert err.value.field == "--exclude"


def test_shapes_are_rated_pooled_as_the_inventory_allows() -> None:
    """A shape is rated among as many copies as the inventory's GPUs form, up to
    POOL_GPUS' worth: two H100s cannot pool like eight."""
    inv = parse_inventory({"hosts": [{"name": "h1", "gpu": "H100-SXM", "count": 2},
                                     {"name": "l1", "gpu": "L4", "count": 8},
                                     {"name": "l2", "gpu": "L4", "count": 4}]})
    h100, l4 = (next(h.gpu for h in inv.hosts if h.gpu.name == n) for n in ("H100-SXM", "L4"))
    assert inv.gpu_counts() == {h100: 2, l4: 12}
    m = CAT.model("llama-3.1-8b")
    scn = base_scenario(m.name, Slo(2.0, 0.1, 0.9), CAT)
    pooled, unbounded = Rater(scn, m, 1155.0, 211.0, inv.gpu_counts()), Rater(scn, m, 1155.0, 211.0)
    mixed = Shape((StageSpec(h100, 1), StageSpec(l4, 1)), h100.price_per_hour + l4.price_per_hour)
    for shape, copies, anywhere in ((single(h100, 1), 2, 8), (single(h100, 2), 1, 4),
                                    (single(l4, 1), 8, 8), (single(l4, 4), 2, 2),
                                    (single(l4, 8), 1, 1), (mixed, 2, 4)):
        assert pooled.copies(shape) == copies and unbounded.copies(shape) == anywhere, shape.name


def test_tp_stays_inside_one_host_and_one_type() -> None:
    inv = parse_inventory({"hosts": [{"name": f"h{i}", "gpu": "H100-SXM", "count": 1}
                                     for i in range(3)]
                                    + [{"name": "a1", "gpu": "A100-80GB", "count": 4}]})
    plan = plan_formation(inv, rater("llama-3.1-70b"), objective="goodput")
    assert plan.replicas
    for r in plan.replicas:
        if not r.rated.shape.pipelined:
            assert len(r.hosts) == 1 and "+" not in r.hosts[0]
            host = next(h for h in inv.hosts if h.name == r.hosts[0])
            assert r.rated.shape.stages[0].gpu == host.gpu
            assert r.rated.shape.stages[0].tp <= host.count
    # No 1-GPU H100 host holds 70B, so the H100s form a pipeline, one stage a host.
    (pipe,) = [r for r in plan.replicas if r.rated.shape.stages[0].gpu.name == "H100-SXM"]
    stages = len(pipe.rated.shape.stages)
    assert stages >= 2 and pipe.rated.shape.name == f"H100-SXM-PP{stages}"
    assert len(set(pipe.hosts)) == stages and set(pipe.hosts) <= {"h0", "h1", "h2"}
    used: dict[str, int] = {}
    for r in plan.replicas:
        for host, st, dev in zip(r.hosts, r.rated.shape.stages, r.devices, strict=True):
            used[host] = used.get(host, 0) + st.tp
            assert len(dev) == st.tp
    assert all(used.get(h.name, 0) + plan.unused.get(h.name, 0) == h.count for h in inv.hosts)


def test_pipelines_of_one_type_are_weighed_where_tp_fits() -> None:
    # 70B on H200s: TP-2 fits, but without NVLink its all-reduces go over PCIe
    # for every prompt token, while two TP-1 stages send activations once.
    found = {}
    for link in ("pcie", "nvlink"):
        inv = parse_inventory({"hosts": [{"name": "x", "gpu": "H200", "count": 4, "link": link}]})
        plan = plan_formation(inv, rater("llama-3.1-70b"))
        by_name = {r.shape.name.replace("@pcie", ""): r for r in plan.rated}
        assert {"2xH200", "H200-PP2", "H200-PP4"} <= set(by_name)
        found[link] = by_name
        if link == "pcie":
            assert by_name["H200-PP2"].ratio > 1.5 * by_name["2xH200"].ratio
            assert plan.replicas and all(r.rated.shape.pipelined for r in plan.replicas)
            assert sum(r.rated.shape.gpus for r in plan.replicas) == 4
            # One host: a single vLLM process over every stage's GPUs.
            flags = [engine_flags(r, "llama-3.1-70b") for r in plan.replicas]
            visible = sorted(f.split()[0] for f in flags)
            assert visible[0].startswith("CUDA_VISIBLE_DEVICES=0,1"), flags
            assert all("--pipeline-parallel-size" in f for f in flags)
    # The link decides TP's rating, not the pipeline's (stages send over the network).
    assert found["nvlink"]["2xH200"].ratio > 1.5 * found["pcie"]["2xH200"].ratio
    assert found["nvlink"]["H200-PP2"].ratio == found["pcie"]["H200-PP2"].ratio


def test_pipelines_split_layers_by_speed_across_types() -> None:
    inv = parse_inventory({"hosts": [{"name": "h1", "gpu": "H100-SXM", "count": 1},
                                     {"name": "a1", "gpu": "A100-80GB", "count": 1}]})
    r32 = rater("qwen2.5-32b")
    plan = plan_formation(inv, r32, objective="goodput")
    # 32B fits an 80 GB GPU alone, but leaves it little KV room: two stages carry
    # more than the two GPUs alone (by the roofline), and are weighed beside them.
    (pipe,) = plan.replicas
    alone = [x for x in plan.rated if not x.shape.pipelined]
    assert pipe.rated.shape.name == "H100-SXM+A100-80GB" and len(alone) == 2
    assert pipe.rated.capacity_rps > sum(x.capacity_rps for x in alone)
    # An 8B model has room on each: the pipeline's rating is no better, one replica each.
    small = plan_formation(inv, rater("llama-3.1-8b"), objective="goodput")
    assert sorted(x.rated.shape.name for x in small.replicas) == ["A100-80GB", "H100-SXM"]
    inv = parse_inventory({"hosts": [{"name": "h1", "gpu": "H100-SXM", "count": 1},
                                     {"name": "x1", "gpu": "H200", "count": 1}]})
    plan = plan_formation(inv, rater("llama-3.1-70b"), objective="goodput")
    (r,) = plan.replicas  # 70B fits neither alone
    assert r.rated.shape.name == "H200+H100-SXM" and r.hosts == ("x1", "h1")
    layers = r.rated.perf.layers  # type: ignore[attr-defined]
    assert sum(layers) == 80 and layers[0] > layers[1]  # the faster, larger H200 takes more


def test_per_dollar_drops_what_lowers_goodput_per_dollar_and_goodput_keeps_it() -> None:
    inv = parse_inventory({"hosts": [{"name": "h1", "gpu": "H100-SXM", "count": 2},
                                     {"name": "t1", "gpu": "T4", "count": 4}]})
    r = rater("llama-3.1-8b", tpot=0.1)
    thrifty = plan_formation(inv, r)
    everything = plan_formation(inv, r, objective="goodput")
    assert thrifty.unused == {"t1": 4} and thrifty.gpus == 2
    assert everything.gpus > thrifty.gpus and everything.goodput_rps > thrifty.goodput_rps
    assert (thrifty.goodput_rps / thrifty.cost_per_hour
            > everything.goodput_rps / everything.cost_per_hour)
    # No formation rates above the best shape weighed: a fleet's goodput per
    # dollar is its replicas' ratios averaged by cost.
    top = thrifty.ceiling
    assert top is not None and top.shape.name == "H100-SXM"
    for f in (thrifty, everything, one_per_gpu(inv, r),
              tp_across_types(inv, r, CAT.model("llama-3.1-8b"))):
        assert 0 < f.rated_ratio <= top.ratio + 1e-9, f.name
    assert thrifty.rated_ratio == pytest.approx(top.ratio)
    assert everything.rated_ratio < top.ratio


def test_per_dollar_drops_single_types_a_cross_type_pipeline_beats() -> None:
    """70B fits no single type here at its TPOT but for 8 A10Gs, and a pipeline of
    two H100s and two smaller cards beats that per dollar: the A10G group taken
    first must be dropped once the pipeline sets the bar (it lowered the fleet's
    goodput per dollar from 0.249 to 0.194 req/s per $/h by the roofline)."""
    inv = parse_inventory({"hosts": [{"name": "n0", "gpu": "H100-SXM", "count": 2},
                                     {"name": "n2", "gpu": "L4", "count": 8},
                                     {"name": "n3", "gpu": "A10G", "count": 8}]})
    r = rater("llama-3.1-70b", tpot=0.1)
    plan = plan_formation(inv, r)
    top = plan.ceiling
    assert top is not None and top.shape.pipelined and plan.replicas
    assert all(x.rated.ratio >= top.ratio * (1 - RATIO_TOLERANCE) for x in plan.replicas)
    assert plan.rated_ratio == pytest.approx(top.ratio)
    # The goodput objective keeps the A10Gs: they add goodput.
    assert plan_formation(inv, r, objective="goodput").goodput_rps > plan.goodput_rps


def test_a_demand_takes_the_cheapest_way_there_and_a_budget_buys_more() -> None:
    inv = parse_inventory({"hosts": [{"name": "h1", "gpu": "H100-SXM", "count": 8},
                                     {"name": "a1", "gpu": "A100-80GB", "count": 8}]})
    r = rater("llama-3.1-8b")
    one = r.rate(Shape((plan_formation(inv, r).replicas[0].rated.shape.stages), 0.0))
    assert one is not None
    plan = plan_formation(inv, r, demand=2.5 * one.capacity_rps)
    assert len(plan.replicas) == 3 and plan.unused["a1"] == 8
    # A budget beyond the inventory goes to the best goodput per dollar: the owned
    # H100s, then bought ones, while the A100s (less per dollar) are dropped.
    budget = inv.cost_per_hour + 3 * 4.25
    big = plan_formation(inv, r, budget=budget)
    added = [x for x in big.replicas if x.added]
    assert {x.rated.shape.name for x in big.replicas} == {"H100-SXM"}
    assert len(added) == int(budget / 4.25) - 8 and big.unused == {"a1": 8}
    assert budget - 4.25 < big.cost_per_hour <= budget
    # Priced GPUs in no host may be bought when they are better per dollar.
    cheap = parse_inventory({"hosts": [{"name": "a1", "gpu": "A100-80GB", "count": 1}],
                             "prices": {"H100-SXM": 1.0}})
    bought = plan_formation(cheap, r, budget=5.0)
    assert [x.rated.shape.name for x in bought.replicas if x.added] == ["H100-SXM"] * 5
    # A small budget keeps the best goodput per dollar first.
    small = plan_formation(inv, r, budget=10.0)
    assert {x.rated.shape.name for x in small.replicas} == {"H100-SXM"}
    assert small.cost_per_hour <= 10.0


def test_naive_formations() -> None:
    inv = parse_inventory({"hosts": [{"name": "h1", "gpu": "H100-SXM", "count": 3},
                                     {"name": "a1", "gpu": "A100-80GB", "count": 2},
                                     {"name": "t1", "gpu": "T4", "count": 2}]})
    r = rater("llama-3.1-8b")
    one = one_per_gpu(inv, r)
    assert one.gpus == 5 and one.unused == {"t1": 2}  # 8B does not fit a 16 GB T4
    tp = tp_across_types(inv, r, CAT.model("llama-3.1-8b"))
    assert [x.rated.shape.name for x in tp.replicas] == [
        "TP2[H100-SXM]", "TP2[H100-SXM+A100-80GB]", "TP2[A100-80GB+T4]"]
    assert tp.unused == {"t1": 1}
    mixed = tp.replicas[2].rated
    # A group of mixed types steps at its slowest member with the smallest memory,
    # and all-reduces over the network when it spans hosts.
    gpu = mixed.shape.stages[0].gpu
    assert gpu.mem_gb == 16 and gpu.interconnect_gbps == min(inv.network_gbps, 16)
    assert mixed.shape.cost_per_hour == pytest.approx(2.21 + 0.35)
    assert mixed.perf.decode_step(8, 1000) >= PerfModel(CAT.gpu("A100-80GB"), CAT.model(
        "llama-3.1-8b"), 2).decode_step(8, 1000)


INVENTORY = """
hosts:
  - {name: h1, gpu: H100-SXM, count: 1, link: nvlink}
  - {name: l1, gpu: L4, count: 2}
prices: {L4: 0.7}
"""


def test_cli_verify_beats_naive_where_weak_gpus_miss_the_tpot(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An L4 decodes an 8B model at ~75 ms a token: at a 60 ms TPOT one replica per
    GPU pays for L4s that meet no SLO, while TP-2 brings them under it (and the
    per-dollar objective weighs whether that is worth its price). Measured in the
    simulator behind tailguard, as --verify does."""
    inv = tmp_path / "inv.yaml"
    inv.write_text(INVENTORY)
    out = tmp_path / "fleet.yaml"
    base = ["plan", "--inventory", str(inv), "--model", "llama-3.1-8b", "--slo-ttft", "2",
            "--slo-tpot", "0.06"]
    assert main([*base, "--verify", "--format", "json", "--fleet-out", str(out)]) == 0
    doc = json.loads(capsys.readouterr().out)
    check = doc["verify"]
    naive = check["one replica per GPU"]
    assert naive["gpus"] == 3 and check["planned"]["goodput_rps"] > 0
    ratio = check["planned"]["rps_per_dollar_hour"] / naive["rps_per_dollar_hour"]
    assert ratio >= 1.2, check
    fleet = load_fleet(out)
    assert len(fleet.nodes) == len(doc["replicas"])
    assert all(n.gpu_spec is not None for n in fleet.nodes)
    assert yaml.safe_load(out.read_text()) == doc["fleet_file"]
    # A demand is met as measured, not only as rated: grown until the simulated
    # fleet carries it (or the inventory is spent).
    assert main([*base, "--rate", "12", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    got = doc["fleet"]["measured_goodput_rps"]
    assert got >= 12 or doc["fleet"]["gpus"] == 3, doc["fleet"]
    # Every shape weighed, best goodput per dollar first; lengths from a scenario.
    assert [x["shape"] for x in doc["shapes"]][:1] == ["H100-SXM"]
    scn = Path(__file__).parents[2] / "scenarios" / "mixed.yaml"
    assert main([*base, "--scenario", str(scn)]) == 0
    assert "lengths " + str(scn) in capsys.readouterr().out
    assert main([*base, "--objective", "goodput"]) == 0
    table = capsys.readouterr().out
    assert "2xL4" in table and "per M output tokens" in table and "CUDA_VISIBLE_DEVICES=0,1" in table


def test_a_long_prompt_workload_gets_vllms_long_prefill_cap_where_it_measures_more() -> None:
    """Prompts past a step's budget hold every prompt behind them for the steps they
    take; vLLM's --long-prefill-token-threshold lets those behind share each step.
    The rater measures the cap (a half, then a quarter of the prompt budget) and
    keeps it only where the capacity it measures is higher."""
    m = CAT.model("llama-3.1-8b")
    long = base_scenario(m.name, Slo(3.0, 0.1, 0.99), CAT,
                         {"dist": "lognormal", "mu": 8.5, "sigma": 1.0, "max": 120_000},
                         {"dist": "lognormal", "mu": 5.5, "sigma": 0.8, "max": 4000})
    rated = Rater(long, m, 7000.0, 340.0).rate(single(CAT.gpu("H100-SXM"), 1))
    assert rated is not None
    plan = rated.plan
    assert plan.long_prefill_token_threshold in (plan.prompt_budget // 2, plan.prompt_budget // 4)
    uncapped = replica_capacity(long, rated.perf, replace(plan, long_prefill_token_threshold=0)
                                .engine, copies=8, span_s=120.0)
    assert rated.capacity_rps > 1.02 * uncapped
    r = Replica(rated, ("h1",), ((0,),))
    assert f"--long-prefill-token-threshold {plan.long_prefill_token_threshold}" in \
        engine_flags(r, m.name)
    # Prompts within a step's budget (an L4's is about 500 tokens at this TPOT): nothing
    # to cap, nothing measured.
    short = Rater(base_scenario(m.name, Slo(3.0, 0.1, 0.99), CAT,
                                {"dist": "fixed", "value": 400}, {"dist": "fixed", "value": 100}),
                  m, 400.0, 100.0).rate(single(CAT.gpu("L4"), 1))
    assert short is not None and short.plan.long_prefill_token_threshold == 0
    assert "--long-prefill-token-threshold" not in engine_flags(
        Replica(short, ("h1",), ((0,),)), m.name)


def test_cli_errors(tmp_path: Path) -> None:
    inv = tmp_path / "inv.yaml"
    inv.write_text(INVENTORY)
    base = ["plan", "--model", "llama-3.1-8b", "--slo-ttft", "2", "--slo-tpot", "0.06"]
    assert main(base) == 2  # neither --fleet nor --inventory
    assert main([*base, "--inventory", str(inv), "--format", "vllm"]) == 2
    assert main([*base, "--inventory", str(inv), "--budget", "-1"]) == 2
    inv.write_text("hosts: [{gpu: L4, link: nvlink}]\n")
    assert main([*base, "--inventory", str(inv)]) == 2
