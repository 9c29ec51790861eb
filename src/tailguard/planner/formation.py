"""Forming replicas from a GPU inventory: what ``tailguard plan --inventory`` decides.

A *shape* is a replica's hardware: one TP group of one GPU type inside one
host, or a pipeline of such groups (stages) on one or more hosts. Each shape
is *rated* by the simulator, not by a formula: its SLO capacity
(:mod:`tailguard.sim.capacity`: the highest Poisson rate that one replica alone
serves within the TTFT and TPOT SLOs at the attainment target, under the
workload's length distributions) with the engine settings the roofline plans
for it (:func:`tailguard.planner.plan.engine_plan`). The roofline's own
throughput at the SLO is no substitute: it overrates weak shapes many times
over, because queueing and prefill interference decide the tail
(docs/planner.md has the measured cases). A shape is rated in a pool of
POOL_GPUS GPUs' worth of copies behind a least-request balancer (8 TP-1
replicas, 4 TP-2, ...), or of as many as the inventory holds GPUs for, its
capacity per replica: rated alone, small replicas would lose what pooling
gives them (a TP-2 group rated alone can beat TP-1 per GPU where the fleet of
TP-1 replicas carries more), and a pool larger than the inventory's would give
them what a fleet of its size cannot. Each probe's arrivals span the
scenario's duration, as the measurement's (``--verify``) do: short probes
overrate strong shapes (:mod:`tailguard.sim.capacity`; the figures in
benchmarks/README.md, "Capacity probes").

Formation, greedy by SLO goodput per dollar (capacity / $ per hour): one
replica at a time, the best ratio that the free GPUs (best fit) can still
form among two kinds of shape, weighed together so that a single type cannot
take the GPUs a better pipeline needs:

1. **Homogeneous shapes.** For every GPU type of the inventory (a host's link
   makes its own type), TP 1, 2, 4 and 8 within one host, and pipelines of 2
   to MAX_PP stages of one TP degree on the type's GPUs (one host or several:
   the only shapes where the model fits no host alone, and better than TP
   where a host has no NVLink). Within one type the best ratio is the most
   goodput per GPU; across types the most goodput per dollar.
2. **Pipelines across types** of the free GPUs: two stages of equal TP (vLLM
   runs one TP degree for every stage) on different GPU types or hosts,
   layers split by speed and memory (:func:`tailguard.core.pipeline.split_layers`).
   The roofline ranks the candidates and the simulator rates the best few;
   the best is taken where it beats the best homogeneous shape by more than
   RATIO_TOLERANCE (a stage more is a process and a link more to fail).

The objective says where to stop:

* ``per-dollar`` (the default): only shapes within RATIO_TOLERANCE of the
  best ratio of either kind. Any other shape lowers the fleet's goodput per
  dollar, so its GPUs are the ones to drop (the report names them and their
  ratio);
* ``goodput``: every shape with SLO capacity (GPUs already paid for);
* a demand (``--rate``): once the capacities carry it, which is the
  cheapest formation that does;
* a budget (``--budget``): at the budget (see 3).

3. **Under a budget** a GPU costs the same owned or bought, so single-host
   shapes of the inventory's types, and of the types ``prices`` names, may
   go on to bought GPUs once the inventory's are taken: the best ratio takes
   the budget, and what it leaves out of the inventory is what to drop.

GPUs no shape can use within the SLO are left out and reported.

The naive formations it is measured against are in :mod:`tailguard.planner.naive`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from tailguard.core.hardware import GPU, Model, PerfModel
from tailguard.core.pipeline import Layout, PipelinePerf, StageSpec
from tailguard.errors import ConfigError
from tailguard.planner.inventory import Host, Inventory
from tailguard.planner.plan import EnginePlan, engine_plan
from tailguard.sim.capacity import ProbeStream, replica_capacity
from tailguard.sim.scenario import Scenario

OBJECTIVES = ("per-dollar", "goodput")
TP_DEGREES = (1, 2, 4, 8)
# Shapes this close to the best goodput per dollar count as equally good: SLO
# capacities are bisected to 1% and move a few % between probe workloads.
RATIO_TOLERANCE = 0.05
MAX_PP = 4
# A one-type pipeline is rated at this share of its type's best roofline goodput
# per dollar (the roofline ranks one type's shapes well, not types).
PP_ROUGH_SHARE = 0.7
# Cross-type pipelines the simulator rates per round, the roofline's best first.
MIXED_RATED = 4
# Shapes are rated in pools of this many GPUs (at least one replica).
POOL_GPUS = 8
# vLLM's long-prefill cap (Rater._capped) is rated where more than this share of
# the prompts take more than one step's budget and hold the engine for more than
# LONG_PROMPT_HOLD of the TTFT SLO (a shorter hold rarely decides a miss), kept
# where it adds more than CAP_GAIN to the capacity (bisected to 1%), and never
# set under MIN_CAP_TOKENS (a prompt computed a few dozen tokens a step crawls).
LONG_PROMPT_SHARE = 0.01
LONG_PROMPT_HOLD = 0.25
CAP_GAIN = 0.02
MIN_CAP_TOKENS = 64


@dataclass(frozen=True, slots=True)
class Shape:
    """A replica's hardware: its stages (``StageSpec``) and what it costs."""

    stages: tuple[StageSpec, ...]
    cost_per_hour: float
    link_gbps: float = 0.0  # between stages (pipelines)
    label: str = ""  # a name other than the layout's (naive mixed TP groups)

    @property
    def gpus(self) -> int:
        return sum(s.tp for s in self.stages)

    @property
    def pipelined(self) -> bool:
        return len(self.stages) > 1

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        if not self.pipelined:
            s = self.stages[0]
            return s.gpu.name if s.tp == 1 else f"{s.tp}x{s.gpu.name}"
        return self.layout.name

    @property
    def layout(self) -> Layout:
        return Layout(self.stages, "speed", link_gbps=self.link_gbps)


@dataclass(frozen=True, slots=True)
class Rated:
    """A shape with its performance model, planned engine and measured SLO capacity."""

    shape: Shape
    perf: PerfModel
    plan: EnginePlan
    capacity_rps: float

    @property
    def ratio(self) -> float:
        """SLO goodput per dollar: req/s per $/h."""
        return self.capacity_rps / self.shape.cost_per_hour


@dataclass(frozen=True, slots=True)
class Replica:
    rated: Rated
    hosts: tuple[str, ...]  # each stage's host ("+"-joined when a naive group spans hosts)
    devices: tuple[tuple[int, ...], ...] = ()  # each stage's GPU indices on its host
    added: bool = False  # on GPUs to buy (--budget)


Placement = tuple[tuple[str, ...], tuple[tuple[int, ...], ...]]


@dataclass(frozen=True, slots=True)
class Formation:
    name: str
    replicas: tuple[Replica, ...]
    unused: Mapping[str, int] = field(default_factory=dict)  # host -> GPUs left out
    skipped: tuple[str, ...] = ()  # GPU types without SLO capacity, as readable lines
    rated: tuple[Rated, ...] = ()  # every single-type shape the planner weighed

    @property
    def goodput_rps(self) -> float:
        """The sum of the replicas' SLO capacities (the fleet's capacity bound)."""
        return sum(r.rated.capacity_rps for r in self.replicas)

    @property
    def cost_per_hour(self) -> float:
        return sum(r.rated.shape.cost_per_hour for r in self.replicas)

    @property
    def gpus(self) -> int:
        return sum(r.rated.shape.gpus for r in self.replicas)

    @property
    def rated_ratio(self) -> float:
        """The replicas' rated SLO goodput per dollar (capacities' sum over $/h)."""
        cost = self.cost_per_hour
        return self.goodput_rps / cost if cost > 0 else 0.0

    @property
    def ceiling(self) -> Rated | None:
        """The best goodput per dollar of any shape weighed (and of the replicas).

        A fleet's rated goodput per dollar is its replicas' ratios averaged by
        cost, so no formation of these GPUs rates above this shape's: it bounds
        what any formation can gain over another (pooling aside).
        """
        shapes = [r for r in (*self.rated, *(x.rated for x in self.replicas))
                  if r.capacity_rps > 0]
        return max(shapes, key=lambda r: r.ratio, default=None)


def usd_per_million_tokens(cost_per_hour: float, rps: float, output_tokens: float) -> float:
    """$ per million output tokens at ``rps`` requests/s of ``output_tokens`` each."""
    tokens_per_hour = rps * output_tokens * 3600.0
    return cost_per_hour * 1e6 / tokens_per_hour if tokens_per_hour > 0 else float("inf")


class Rater:
    """Rates shapes under one scenario's model, SLO and lengths (memoised)."""

    def __init__(self, scn: Scenario, model: Model, input_tokens: float,
                 output_tokens: float, available: Mapping[GPU, int] | None = None) -> None:
        """``available``: the GPUs of each type there are to form (the inventory's);
        a shape is rated in a pool of no more copies than they hold (None: no limit,
        as when GPUs may be bought)."""
        self.scn, self.model = scn, model
        self.input_tokens, self.output_tokens = input_tokens, output_tokens
        self.available = available
        self._memo: dict[Shape, Rated | None] = {}
        self._rough: dict[Shape, float] = {}

    def perf(self, shape: Shape) -> PerfModel | None:
        """The shape's performance model; None if the model does not fit."""
        first = shape.stages[0]
        try:
            if shape.pipelined:
                perf: PerfModel = PipelinePerf(first.gpu, self.model, first.tp,
                                               layout=shape.layout)
            else:
                perf = PerfModel(first.gpu, self.model, first.tp)
        except ConfigError:  # the split cannot place every layer
            return None
        return perf if perf.fits else None

    def plan(self, perf: PerfModel) -> EnginePlan:
        return engine_plan(perf, self.scn.slo.tpot_s, self.input_tokens, self.output_tokens)

    def rough_rps(self, shape: Shape) -> float:
        """The roofline's requests/s at the TPOT SLO (ranking only; 0 if it does not fit)."""
        if shape not in self._rough:
            perf = self.perf(shape)
            self._rough[shape] = (0.0 if perf is None else
                                  self.plan(perf).tokens_per_s / self.output_tokens)
        return self._rough[shape]

    def copies(self, shape: Shape) -> int:
        """How many replicas of ``shape`` it is rated pooled with (at least one)."""
        copies = POOL_GPUS // shape.gpus
        if self.available is not None:
            per_replica: dict[GPU, int] = {}
            for st in shape.stages:
                per_replica[st.gpu] = per_replica.get(st.gpu, 0) + st.tp
            for gpu, n in per_replica.items():
                copies = min(copies, self.available.get(gpu, POOL_GPUS) // n)
        return max(1, copies)

    def rate(self, shape: Shape) -> Rated | None:
        if shape not in self._memo:
            perf = self.perf(shape)
            rated = None
            if perf is not None:
                plan = self.plan(perf)
                copies = self.copies(shape)
                span = self.scn.workload.duration_s
                best = replica_capacity(self.scn, perf, plan.engine, copies=copies, span_s=span)
                rated = Rated(shape, perf, plan, best)
                if best > 0.0 and self._long_prompts(perf, plan):  # (0: prompts beyond it)
                    rated = self._capped(rated, copies, span)
            self._memo[shape] = rated
        return self._memo[shape]

    def _long_prompts(self, perf: PerfModel, plan: EnginePlan) -> bool:
        """Whether more than LONG_PROMPT_SHARE of the workload's prompts take more than
        one step's prompt budget and hold the engine for more than LONG_PROMPT_HOLD of
        the TTFT SLO (every prompt behind one waits that long): where a cap can matter."""
        prompts = ProbeStream.shared(self.scn).prompts
        budget = plan.prompt_budget
        hold = LONG_PROMPT_HOLD * self.scn.slo.ttft_s
        long = sum(1 for p in prompts if p > budget and perf.prefill_time(p) > hold)
        return long > LONG_PROMPT_SHARE * len(prompts)

    def _capped(self, rated: Rated, copies: int, span: float) -> Rated:
        """``rated`` with vLLM's long-prefill cap at a half, then a quarter, of its
        prompt budget, where the capacity it measures is higher by more than
        CAP_GAIN (with no cap, a prompt takes the whole budget of every step until
        it is computed, and every prompt behind it waits; with one, the prompts
        behind share the rest of each step)."""
        for share in (2, 4):
            cap = max(rated.plan.prompt_budget // share, MIN_CAP_TOKENS)
            plan = replace(rated.plan, long_prefill_token_threshold=cap)
            got = replica_capacity(self.scn, rated.perf, plan.engine, copies=copies, span_s=span)
            if got <= rated.capacity_rps * (1.0 + CAP_GAIN):
                break
            rated = Rated(rated.shape, rated.perf, plan, got)
        return rated


def single(gpu: GPU, tp: int) -> Shape:
    """A TP group of ``tp`` x ``gpu`` in one host."""
    return Shape((StageSpec(gpu, tp),), gpu.price_per_hour * tp)


class _Free:
    """The inventory's free GPUs per host, taken stage by stage (best fit)."""

    def __init__(self, hosts: Iterable[Host]) -> None:
        self.hosts = list(hosts)
        self.free = {h.name: h.count for h in self.hosts}
        self.devices = {h.name: h.usable for h in self.hosts}

    def take(self, shape: Shape, commit: bool = True) -> Placement | None:
        """Each stage's host and GPU indices (None: the free GPUs cannot hold it)."""
        trial = dict(self.free)
        chosen, devices = [], []
        for st in shape.stages:
            fits = [h.name for h in self.hosts if h.gpu == st.gpu and trial[h.name] >= st.tp]
            if not fits:
                return None
            name = min(fits, key=lambda n: (trial[n], n))
            first = len(self.devices[name]) - trial[name]
            trial[name] -= st.tp
            chosen.append(name)
            devices.append(self.devices[name][first:first + st.tp])
        if commit:
            self.free = trial
        return tuple(chosen), tuple(devices)

    def groups(self) -> list[StageSpec]:
        """Every (GPU type, TP degree) a stage could still take from one host."""
        out: dict[tuple[str, int], StageSpec] = {}
        for h in self.hosts:
            for d in TP_DEGREES:
                if d <= self.free[h.name]:
                    out.setdefault((h.gpu.name, d), StageSpec(h.gpu, d))
        return list(out.values())


def homogeneous_shapes(inv: Inventory, rater: Rater) -> list[Shape]:
    """Every TP x PP degree of each GPU type (TP within one host, stages of one TP
    degree on the type's GPUs), pipelines also where TP fits: without NVLink a
    TP group all-reduces each layer's activations over PCIe for every prompt
    token (70B on PCIe H200s at a 50 ms TPOT: TP-2 2.1 req/s, two TP-1 stages
    3.8). Pipelines under PP_ROUGH_SHARE of the type's best by the roofline
    are not rated (planning time)."""
    biggest: dict[GPU, int] = {}  # the largest host of each type, and all its GPUs
    total: dict[GPU, int] = {}
    for h in inv.hosts:
        biggest[h.gpu] = max(biggest.get(h.gpu, 0), h.count)
        total[h.gpu] = total.get(h.gpu, 0) + h.count
    shapes: list[Shape] = []
    for gpu, most in biggest.items():
        singles = [s for d in TP_DEGREES if d <= most if rater.perf(s := single(gpu, d))]
        pipes = [Shape((StageSpec(gpu, d),) * pp, gpu.price_per_hour * d * pp, inv.network_gbps)
                 for d in TP_DEGREES if d <= most
                 for pp in range(2, MAX_PP + 1) if d * pp <= total[gpu]]
        rough = {s: rater.rough_rps(s) / s.cost_per_hour for s in singles + pipes}
        best = max(rough.values(), default=0.0)
        shapes += singles + [s for s in pipes if rough[s] > 0 and rough[s] >= PP_ROUGH_SHARE * best]
    return shapes


@dataclass(slots=True)
class _Goal:
    """When formation stops: at the budget ($/h) or once the demand (req/s) is carried."""

    budget: float = float("inf")
    demand: float = float("inf")
    floor: float = 0.0  # the least goodput per dollar a shape must bring

    def wants(self, r: Rated) -> bool:
        return (r.ratio >= self.floor and r.shape.cost_per_hour <= self.budget + 1e-9
                and self.demand > 0)

    def took(self, r: Rated) -> None:
        self.budget -= r.shape.cost_per_hour
        self.demand -= r.capacity_rps


def _mixed_round(free: _Free, inv: Inventory, rater: Rater) -> list[Rated]:
    """Cross-type two-stage pipelines the free GPUs could form, rated (best few)."""
    cands = []
    for a, b in itertools.combinations_with_replacement(free.groups(), 2):
        if a.tp != b.tp:
            continue
        first, second = sorted((a, b), key=lambda s: (-s.gpu.mem_bw_gbps, s.gpu.name))
        shape = Shape((first, second), (a.gpu.price_per_hour + b.gpu.price_per_hour) * a.tp,
                      inv.network_gbps)
        if free.take(shape, commit=False) is None:
            continue
        rough = rater.rough_rps(shape)
        if rough > 0:
            cands.append((rough / shape.cost_per_hour, shape))
    cands.sort(key=lambda c: (-c[0], c[1].name))
    return [r for _, s in cands[:MIXED_RATED] if (r := rater.rate(s)) is not None]


def plan_formation(inv: Inventory, rater: Rater, budget: float | None = None,
                   demand: float | None = None, objective: str = "per-dollar") -> Formation:
    """The planner's formation of ``inv`` (see the module docstring).

    ``objective``: ``per-dollar`` (without a budget or demand, only the shapes
    within RATIO_TOLERANCE of the best goodput per dollar; the rest is
    dropped) or ``goodput`` (every GPU that adds SLO goodput). ``budget``: $/h
    not to exceed (shapes best ratio first, the inventory's GPUs before bought ones).
    ``demand``: the req/s to carry; formation stops once the replicas' SLO
    capacities reach it, which is the cheapest way there.
    """
    if objective not in OBJECTIVES:
        raise ConfigError("objective", f"must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    rated = _earned([r for s in homogeneous_shapes(inv, rater)
                     if (r := rater.rate(s)) is not None])
    buy: frozenset[Shape] = frozenset()
    if budget is not None:  # GPUs cost alike owned or bought: the best ratio takes the budget
        rated += _buyable(inv, rater)
        buy = frozenset(r.shape for r in rated if not r.shape.pipelined)
    thrifty = objective == "per-dollar" and budget is None and demand is None
    goal = _Goal(float("inf") if budget is None else budget,
                 float("inf") if demand is None else demand)
    replicas, free = _form(inv, rater, rated, buy, goal, thrifty)
    useful = {r.shape.stages[0].gpu.name for r in rated if r.capacity_rps > 0}
    skipped = tuple(sorted({f"{r.shape.stages[0].gpu.name}: no SLO capacity at any TP degree "
                            "(prefill or decode too slow for the SLO)"
                            for r in rated if r.shape.stages[0].gpu.name not in useful}))
    unused = {h: n for h, n in free.free.items() if n > 0}
    return Formation("planned", tuple(replicas), unused, skipped, tuple(rated))


def _form(inv: Inventory, rater: Rater, rated: Sequence[Rated], buy: frozenset[Shape],
          goal: _Goal, thrifty: bool) -> tuple[list[Replica], _Free]:
    """Replicas one at a time, each the best goodput per dollar the free GPUs can
    still form: a single type's shape (``rated``, or bought: ``buy``) or a
    cross-type pipeline. Weighed together, so that a single type cannot take the
    GPUs a better pipeline needs (70B on 2 H100s, 8 L4s and 8 A10Gs: the H100s
    as TP-2 rated 0.015 req/s per $/h, in a pipeline with two A10Gs 0.249)."""
    free = _Free(inv.hosts)
    replicas: list[Replica] = []
    order = sorted((r for r in rated if r.capacity_rps > 0),
                   key=lambda r: (-r.ratio, r.shape.gpus, r.shape.name))

    def raise_floor(options: Iterable[Rated]) -> None:
        if thrifty:  # only what keeps the fleet's goodput per dollar near the best
            top = max((r.ratio for r in options), default=0.0) * (1.0 - RATIO_TOLERANCE)
            goal.floor = max(goal.floor, top)

    def fits(r: Rated) -> bool:
        return r.shape in buy or free.take(r.shape, commit=False) is not None

    raise_floor(order)
    mixing = True  # the free GPUs only shrink: no pipeline once, none after
    while goal.budget > 0 and goal.demand > 0:
        mixed = [r for r in _mixed_round(free, inv, rater) if r.capacity_rps > 0] if mixing else []
        mixing = bool(mixed)
        raise_floor(mixed)
        key = lambda r: (-r.ratio, r.shape.gpus, r.shape.name)  # noqa: E731
        one = min((r for r in order if goal.wants(r) and fits(r)), key=key, default=None)
        pipe = min((r for r in mixed if goal.wants(r) and fits(r)), key=key, default=None)
        # A pipeline across types must beat the best single type by more than the
        # ratings' noise, as one of a single type must beat its TP groups (_earned).
        if pipe is not None and (one is None or pipe.ratio > one.ratio * (1 + RATIO_TOLERANCE)):
            pick = pipe
        elif one is not None:
            pick = one
        else:
            break
        taken = free.take(pick.shape)
        if taken is not None:
            replicas.append(Replica(pick, *taken))
        else:  # bought: the inventory has no GPUs left for it
            name = f"new-{pick.shape.stages[0].gpu.name}-{sum(x.added for x in replicas)}"
            replicas.append(Replica(pick, (name,), (tuple(range(pick.shape.gpus)),), added=True))
        goal.took(pick)
    return replicas, free


def _earned(rated: Sequence[Rated]) -> list[Rated]:
    """``rated`` less pipelines within RATIO_TOLERANCE of their type's best TP group
    (alike as measured, and a stage more is a process and a link more to fail)."""
    best: dict[GPU, float] = {}
    for r in rated:
        if not r.shape.pipelined and r.capacity_rps > 0:
            gpu = r.shape.stages[0].gpu
            best[gpu] = max(best.get(gpu, 0.0), r.ratio)
    return [r for r in rated if not r.shape.pipelined
            or r.ratio > best.get(r.shape.stages[0].gpu, 0.0) * (1.0 + RATIO_TOLERANCE)]


def _buyable(inv: Inventory, rater: Rater) -> list[Rated]:
    """Single-host shapes of GPU types priced but in no host (hosts of up to 8)."""
    known = {h.gpu.name for h in inv.hosts}
    out = []
    for gpu in inv.prices:
        if gpu.name not in known:
            out += [r for d in TP_DEGREES if (r := rater.rate(single(gpu, d))) is not None]
    return out


__all__ = ["Formation", "Rated", "Rater", "Replica", "Shape", "plan_formation",
           "single", "usd_per_million_tokens"]
