"""Prefill, decode or both: disaggregated formations (``--roles auto``).

The co-located planner (:mod:`tailguard.planner.formation`) rates every shape
serving both phases, and drops a GPU type whose co-located goodput per
dollar is poor. Disaggregation changes that: where prompts are long and the
TPOT SLO tight, a type that cannot hold the TPOT beside long prompts may
decode well once they are computed elsewhere, and a type with compute to
spare may compute prompts for the others. It is a hardware question: prompts
are compute-bound, so they belong on the GPUs with the most FLOPs per byte of
memory bandwidth, and decodes are bandwidth-bound (Splitwise, ISCA'24:
H100 prompts with A100 tokens; H100/A100 compute 3.43x, bandwidth 1.64x).

Which split pays, if any, depends on the workload's lengths, the SLO and the
inventory's proportions, so splits are *measured*, not scored: each one's SLO
goodput behind the ``tailguard`` policy in the simulator (the bisection of
``--verify``). The replicas are the whole inventory, each GPU type in its
best-rated shape (its smallest TP that fits where no shape has co-located
capacity), and a candidate gives every type a role or leaves it out. With the
types of a subset ordered by compute per byte of bandwidth:

* every replica both (co-located);
* the first ``k`` types prefill, the rest decode, for every ``k``;
* the first ``k`` types both, the rest decode (a strong type that also
  decodes the short prompts it need not hand over);

for every subset of the types (at most ``MAX_TYPES`` of them, the most
numerous), and, with a single type, a third or a half of its replicas
prefilling for the rest (DistServe's homogeneous split). The best goodput per
dollar wins (``--objective goodput``: the best goodput); a split must beat
the best co-located choice by ``TIE`` (a split is a link and a hand-off more
to fail). The co-located subsets are measured too, and one may beat the
co-located plan itself: the plan rates each shape in a pool of its own kind,
while behind tailguard a mixed fleet splits the prompts by length between
its types, which those ratings cannot see.
The naive splits ``--verify`` measures the choice against are the fastest type
prefilling for all the others, and the fastest type decoding for them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from tailguard.planner.formation import TP_DEGREES, Formation, Rated, Rater, Replica, single
from tailguard.planner.inventory import Inventory
from tailguard.planner.verify import measured_goodput
from tailguard.sim.scenario import Scenario

# A split must beat co-located serving by this much to be chosen.
TIE = 1.03
# Subsets of at most this many types are formed (15 subsets, 49 candidates).
MAX_TYPES = 4

NONE = "none"  # a replica left out of the formation


@dataclass(frozen=True, slots=True)
class RoleChoice:
    """A role for every replica of the whole formation (``none``: left out), named,
    with its measured goodput and price."""

    name: str
    roles: tuple[str, ...]
    goodput_rps: float = 0.0
    cost_per_hour: float = 0.0

    @property
    def ratio(self) -> float:
        return self.goodput_rps / self.cost_per_hour if self.cost_per_hour > 0 else 0.0


def whole_inventory(inv: Inventory, rater: Rater) -> Formation:
    """Every GPU of the inventory in replicas: each host's type in its shape of the
    best rated goodput per GPU, or its smallest TP that fits when none has any."""
    replicas: list[Replica] = []
    unused: dict[str, int] = {}
    for h in inv.hosts:
        rated = [r for tp in TP_DEGREES if tp <= h.count
                 and (r := rater.rate(single(h.gpu, tp))) is not None]
        if not rated:
            unused[h.name] = h.count
            continue
        best: Rated = max(rated, key=lambda r: (r.capacity_rps / r.shape.gpus, -r.shape.gpus))
        tp = best.shape.gpus
        devices = h.usable
        for i in range(0, len(devices) - tp + 1, tp):
            replicas.append(Replica(best, (h.name,), devices=(tuple(devices[i:i + tp]),)))
        if len(devices) % tp:
            unused[h.name] = len(devices) % tp
    return Formation("whole inventory", tuple(replicas), unused)


def _types(full: Formation) -> list[str]:
    """The formation's shape types, the most compute per byte of bandwidth first."""
    ridge: dict[str, float] = {}
    count: dict[str, int] = {}
    for r in full.replicas:
        name = r.rated.shape.name
        ridge.setdefault(name, r.rated.shape.stages[0].gpu.ridge_flops_per_byte)
        count[name] = count.get(name, 0) + r.rated.shape.gpus
    kept = sorted(count, key=lambda n: -count[n])[:MAX_TYPES]
    return sorted(kept, key=lambda name: -ridge[name])


def _choice(full: Formation, name: str, role_of: dict[str, str]) -> RoleChoice:
    roles = tuple(role_of.get(r.rated.shape.name, NONE) for r in full.replicas)
    cost = sum(r.rated.shape.cost_per_hour for r, role in zip(full.replicas, roles, strict=True)
               if role != NONE)
    return RoleChoice(name, roles, cost_per_hour=cost)


def candidates(full: Formation) -> list[RoleChoice]:
    """The assignments worth measuring (module docstring), all types co-located first."""
    types = _types(full)
    out = [_choice(full, "co-located: " + " + ".join(types), dict.fromkeys(types, "both"))]
    for size in range(len(types), 0, -1):
        for subset in itertools.combinations(types, size):
            if size < len(types):
                out.append(_choice(full, "co-located: " + " + ".join(subset),
                                   dict.fromkeys(subset, "both")))
            for k in range(1, size):
                first, rest = subset[:k], subset[k:]
                out.append(_choice(full, f"{' + '.join(first)} prefill, "
                                         f"{' + '.join(rest)} decode",
                                   {**dict.fromkeys(first, "prefill"),
                                    **dict.fromkeys(rest, "decode")}))
                out.append(_choice(full, f"{' + '.join(first)} both, "
                                         f"{' + '.join(rest)} decode",
                                   {**dict.fromkeys(first, "both"),
                                    **dict.fromkeys(rest, "decode")}))
    if len(types) == 1 and len(full.replicas) >= 2:
        n = len(full.replicas)
        cost = sum(r.rated.shape.cost_per_hour for r in full.replicas)
        for p in sorted({max(1, n // 3), n // 2}):
            out.append(RoleChoice(f"{p} of {n} {types[0]} prefill, the rest decode",
                                  tuple("prefill" if i < p else "decode" for i in range(n)),
                                  cost_per_hour=cost))
    return out


def naive_splits(full: Formation) -> list[RoleChoice]:
    """The splits an operator might try first over the whole inventory: the fastest
    type (the most compute) prefills for all the others, or decodes for them."""
    kinds = {r.rated.shape.name: r.rated.shape.stages[0].gpu.tflops for r in full.replicas}
    if len(kinds) < 2:
        return []
    fast = max(kinds, key=lambda n: kinds[n])
    return [_choice(full, f"naive: {fast} prefill, the rest decode",
                    {t: "prefill" if t == fast else "decode" for t in kinds}),
            _choice(full, f"naive: {fast} decode, the rest prefill",
                    {t: "decode" if t == fast else "prefill" for t in kinds})]


def chosen_part(full: Formation, choice: RoleChoice) -> tuple[Formation, tuple[str, ...]]:
    """The replicas a choice keeps, and their roles."""
    kept = [(r, role) for r, role in zip(full.replicas, choice.roles, strict=True)
            if role != NONE]
    return (Formation(choice.name, tuple(r for r, _ in kept)),
            tuple(role for _, role in kept))


def measure(full: Formation, base: Scenario, choices: list[RoleChoice],
            target: float) -> list[RoleChoice]:
    """Each choice with its SLO goodput behind tailguard in the simulator."""
    out = []
    for c in choices:
        part, roles = chosen_part(full, c)
        if "decode" not in roles and "both" not in roles:
            out.append(c)  # nothing streams answers: serves nothing
            continue
        out.append(RoleChoice(c.name, c.roles, measured_goodput(part, base, target, roles),
                              c.cost_per_hour))
    return out


def is_split(c: RoleChoice) -> bool:
    return any(r in ("prefill", "decode") for r in c.roles)


def choose_roles(measured: list[RoleChoice], colocated: RoleChoice,
                 objective: str = "per-dollar") -> RoleChoice | None:
    """The best measured choice, None where ``colocated`` (the co-located plan,
    measured) is as good. A split must beat the best co-located choice (the plan,
    or a co-located subset of the whole inventory, which the pooled ratings can
    misjudge) by ``TIE``."""
    def score(c: RoleChoice) -> float:
        return c.goodput_rps if objective == "goodput" else c.ratio

    together = max([colocated, *(c for c in measured if not is_split(c))], key=score)
    splits = [c for c in measured if is_split(c)]
    best = max(splits, key=score) if splits else None
    if best is not None and score(best) > TIE * score(together):
        return best
    return together if together is not colocated and score(together) > score(colocated) \
        else None


__all__ = ["NONE", "TIE", "RoleChoice", "candidates", "choose_roles", "chosen_part",
           "is_split", "measure", "naive_splits", "whole_inventory"]
