"""Naive formations to measure the planner against (``--verify``, benchmarks/formation.py).

* **One replica per GPU**: TP-1 wherever the model fits, whatever its SLO
  capacity.
* **TP across types**: the inventory's GPUs in order, in TP groups of the
  smallest degree that fits on every GPU, across host and type boundaries. A
  group steps at its slowest member with the smallest one's memory, and
  all-reduces over the network when it spans hosts.
"""

from __future__ import annotations

from dataclasses import replace

from tailguard.core.hardware import Model, PerfModel
from tailguard.core.pipeline import StageSpec
from tailguard.planner.formation import TP_DEGREES, Formation, Rater, Replica, Shape, single
from tailguard.planner.inventory import Inventory

# The decode step at which a mixed TP group's slowest member is found.
REFERENCE_BATCH, REFERENCE_CTX = 32, 1024.0


def one_per_gpu(inv: Inventory, rater: Rater) -> Formation:
    """Naive: a TP-1 replica on every GPU the model fits on, whatever its SLO capacity."""
    replicas: list[Replica] = []
    unused: dict[str, int] = {}
    for h in inv.hosts:
        r = rater.rate(single(h.gpu, 1))
        if r is None:
            unused[h.name] = h.count
            continue
        replicas += [Replica(r, (h.name,), devices=((i,),)) for i in h.usable]
    return Formation("one replica per GPU", tuple(replicas), unused)


def tp_across_types(inv: Inventory, rater: Rater, model: Model) -> Formation:
    """Naive: the GPUs in inventory order, in TP groups of the smallest degree that
    fits on every GPU, across hosts and types."""
    kinds = {h.gpu for h in inv.hosts}
    degree = next((d for d in TP_DEGREES
                   if all(PerfModel(g, model, d).fits for g in kinds)), None)
    gpus = [(h, h.gpu) for h in inv.hosts for _ in range(h.count)]
    if degree is None:
        return Formation("TP across types", (), {h.name: h.count for h in inv.hosts})
    replicas: list[Replica] = []
    for i in range(0, len(gpus) - degree + 1, degree):
        members = gpus[i:i + degree]
        hosts = tuple(dict.fromkeys(h.name for h, _ in members))
        slowest = max(dict.fromkeys(g for _, g in members),
                      key=lambda g: PerfModel(g, model, degree).decode_step(REFERENCE_BATCH,
                                                                              REFERENCE_CTX))
        smallest = min((g for _, g in members), key=lambda g: g.mem_gb)
        label = "+".join(dict.fromkeys(g.name for _, g in members))
        gpu = slowest
        if len(hosts) > 1 or "+" in label:  # its own modelled type: the slowest member's
            # speed, the smallest one's memory, all-reduces over the network across hosts
            link = inv.network_gbps if len(hosts) > 1 else slowest.interconnect_gbps
            gpu = replace(slowest, name=f"{slowest.name}@{'net' if len(hosts) > 1 else 'mix'}"
                          f"{smallest.mem_gb:g}", mem_gb=smallest.mem_gb,
                          interconnect_gbps=min(link, slowest.interconnect_gbps))
        shape = Shape((StageSpec(gpu, degree),), sum(g.price_per_hour for _, g in members),
                      label=f"TP{degree}[{label}]" if degree > 1 else "")
        r = rater.rate(shape)
        if r is not None:
            replicas.append(Replica(r, ("+".join(hosts),)))
    used = len(replicas) * degree
    unused: dict[str, int] = {}
    for h, _ in gpus[used:]:
        unused[h.name] = unused.get(h.name, 0) + 1
    return Formation("TP across types", tuple(replicas), unused)


__all__ = ["one_per_gpu", "tp_across_types"]
