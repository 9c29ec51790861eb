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
from dataclasses import replace
from typing import Any

from tailguard.core.hardware import Catalog
from tailguard.core.policies import Slo
from tailguard.planner.formation import Formation, Shape
from tailguard.sim.capacity import fleet_capacity
from tailguard.sim.run import find_goodput
from tailguard.sim.scenario import FleetGroup, PolicyChoice, Scenario
from tailguard.sim.workload import parse_workload

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


def formation_scenario(formation: Formation, base: Scenario) -> Scenario:
    """``base`` with the formation's replicas as its fleet."""
    catalog = Catalog(tuple(base.catalog.gpus), tuple(base.catalog.models))
    counts: Counter[Shape] = Counter()
    engines = {}
    for r in formation.replicas:
        counts[r.rated.shape] += 1
        engines[r.rated.shape] = r.rated.engine
        for st in r.rated.shape.stages:
            catalog.add_gpu(st.gpu)
    groups = []
    for shape, n in sorted(counts.items(), key=lambda kv: kv[0].name):
        first = shape.stages[0]
        layout = shape.layout if shape.pipelined else None
        name = layout.name if layout is not None else first.gpu.name
        groups.append(FleetGroup(name, n, first.tp, engines[shape], 0.0, layout))
    return replace(base, name=f"plan: {formation.name}", fleet=tuple(groups), catalog=catalog)


def measured_goodput(formation: Formation, base: Scenario, target: float | None = None) -> float:
    """SLO goodput (req/s) of the formation behind tailguard in the simulator."""
    if not formation.replicas:
        return 0.0
    scn = formation_scenario(formation, base)
    capacity = fleet_capacity(scn)
    bound = sum(capacity.values())
    if bound <= 0:
        return 0.0
    return find_goodput(scn, POLICY, capacity, bound,
                        target if target is not None else scn.slo.attainment)


__all__ = ["base_scenario", "formation_scenario", "measured_goodput"]
