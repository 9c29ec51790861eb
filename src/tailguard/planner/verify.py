"""Checking a formation in the simulator (``tailguard plan --inventory ... --verify``).

A formation becomes a scenario fleet (one group per replica shape, with the
engine settings planned for it) behind the ``tailguard`` policy, and its SLO
goodput is measured as ``tailguard sim --find-goodput`` does: the highest
Poisson rate whose SLO attainment reaches the target, by bisection. The
formation's planned goodput is the sum of its replicas' SLO capacities (each
alone), the bound a router approaches; the measured figure is what the
gateway's routing gets out of the whole fleet.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from tailguard.core.hardware import Catalog
from tailguard.core.policies import Slo
from tailguard.planner.formation import Formation, Rater, Shape, plan_formation
from tailguard.planner.inventory import Inventory
from tailguard.sim.capacity import fleet_capacity
from tailguard.sim.run import find_goodput, make_requests, run_policy
from tailguard.sim.scenario import FleetGroup, PolicyChoice, Scenario
from tailguard.traffic.workload import parse_workload

POLICY = PolicyChoice("tailguard")


def base_scenario(model: str, slo: Slo, catalog: Catalog, input_tokens: Any = None,
                  output_tokens: Any = None, duration_s: float = 120.0,
                  seed: int = 1) -> Scenario:
    """A scenario with no fleet: the model, SLO and lengths formations are rated under.

    ``input_tokens``/``output_tokens`` are length distributions in scenario
    syntax (default: the Azure conversation trace's fits).
    """
    workload = parse_workload({
        "duration_s": duration_s, "warmup_s": min(20.0, duration_s / 5),
        "arrival": {"process": "poisson", "rate": 1.0},
        "input_tokens": input_tokens or {"dist": "azure-conv"},
        "output_tokens": output_tokens or {"dist": "azure-conv"},
    }, "workload")
    return Scenario("plan", seed, model, slo, 0.0, (), workload, (), (POLICY,), catalog)


def formation_scenario(formation: Formation, base: Scenario,
                       roles: Sequence[str] | None = None) -> Scenario:
    """``base`` with the formation's replicas as its fleet; ``roles``: each replica's
    (disaggregated serving, :mod:`tailguard.planner.roles`), else both."""
    catalog = Catalog(tuple(base.catalog.gpus), tuple(base.catalog.models))
    counts: Counter[tuple[Shape, str]] = Counter()
    engines = {}
    for i, r in enumerate(formation.replicas):
        counts[(r.rated.shape, roles[i] if roles is not None else "both")] += 1
        engines[r.rated.shape] = r.rated.plan.engine
        for st in r.rated.shape.stages:
            catalog.add_gpu(st.gpu)
    groups = []
    for (shape, role), n in sorted(counts.items(), key=lambda kv: (kv[0][0].name, kv[0][1])):
        first = shape.stages[0]
        layout = shape.layout if shape.pipelined else None
        name = layout.name if layout is not None else first.gpu.name
        groups.append(FleetGroup(name, n, first.tp, engines[shape], 0.0, layout, role))
    return replace(base, name=f"plan: {formation.name}", fleet=tuple(groups), catalog=catalog)


def measured_goodput(formation: Formation, base: Scenario, target: float | None = None,
                     roles: Sequence[str] | None = None) -> float:
    """SLO goodput (req/s) of the formation behind tailguard in the simulator."""
    if not formation.replicas:
        return 0.0
    scn = formation_scenario(formation, base, roles)
    capacity = fleet_capacity(scn)
    bound = sum(capacity.values())
    if bound <= 0:
        return 0.0
    return find_goodput(scn, POLICY, capacity, bound,
                        target if target is not None else scn.slo.attainment)


def plan_for_demand(inv: Inventory, rater: Rater, demand: float, base: Scenario,
                    target: float, budget: float | None = None, objective: str = "per-dollar",
                    rounds: int = 12) -> tuple[Formation, float]:
    """The cheapest formation whose measured SLO goodput carries ``demand``, and that
    goodput. Shapes are rated each in a pool of its own kind (Rater.copies), while
    the formation's replicas pool across kinds behind tailguard, so the ratings'
    sum can miss the measurement either way (2 H100s and 2 A100s, 8B: 66.4 req/s
    rated, 67.5 measured; before probes spanned the run, two H100s rated 91.7 and
    measured 48.2). The formation therefore grows a replica at a time (the next in
    goodput per dollar) until the measurement carries the demand, the inventory
    has nothing more to give or ``rounds`` are spent."""
    plan = plan_formation(inv, rater, budget, demand, objective)
    got = measured_goodput(plan, base, target)
    for _ in range(rounds):
        if got >= demand or plan.goodput_rps <= 0:
            break
        more = plan_formation(inv, rater, budget, plan.goodput_rps + 1e-6, objective)
        if len(more.replicas) == len(plan.replicas):
            break  # nothing more within the inventory (and budget)
        plan, got = more, measured_goodput(more, base, target)
    return plan, got


def attainment_at(formation: Formation, base: Scenario, rate: float,
                  roles: Sequence[str] | None = None) -> float:
    """SLO attainment of the formation behind tailguard at ``rate`` req/s (Poisson)."""
    if not formation.replicas:
        return 0.0
    scn = formation_scenario(formation, base, roles)
    scn = replace(scn, workload=replace(scn.workload, arrival=replace(
        scn.workload.arrival, rate=rate, load=None)))
    res = run_policy(scn, POLICY, make_requests(scn, rate), fleet_capacity(scn), rate)
    return float(res["slo_attainment"])


__all__ = ["attainment_at", "base_scenario", "formation_scenario", "measured_goodput",
           "plan_for_demand"]
