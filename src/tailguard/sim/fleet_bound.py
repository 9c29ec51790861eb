"""The fleet's capacity bound, where some of its nodes cannot serve the whole workload.

:mod:`tailguard.sim.capacity` rates each node on the whole mix of the
workload's requests, and the fleet's bound is the sum. That holds while every
node can serve every request: with long prompts it does not. An L4 prefilling
a 40k-token prompt misses a 5 s TTFT even idle, so on the whole mix of a
long-context trace its capacity is 0; an A100 is 0 too when 5% of prompts are
beyond it; the sum then says the fleet carries almost nothing, while a router
that gives the long prompts to the H100s and the rest to the others carries
several requests a second.

So where a node class's "missed alone" share is over what the attainment
target allows, the fleet is **split**: each request goes to one class, and
the bound is the rate at which every class carries its share.

1. Each class (nodes of one GPU, TP and engine) is told which of the probe
   stream's requests it can serve alone (``capacity.misses_alone``'s test).
   Requests no class can serve are the fleet's misses: they are charged to
   the strongest class as time lost, and where they are more than the
   attainment target allows, the bound is what carries the rest at it.
2. The requests, by prompt length, are cut into bands, one per class, the
   shortest to the class that serves the fewest: a class takes the next
   requests while it can serve them and its work stays within its share.
   A request's work on a class is the time its prefill and its decode's part
   of a step take there (the decode at the batch the TPOT allows). The shares
   are balanced by bisection on the work per node, so every class ends about
   equally loaded.
3. Each class is rated on its band alone, by the same simulated search as a
   node on the whole mix (``capacity._capacity`` on a stream of the band's
   requests), and the bound is the lowest of ``nodes x capacity / share``.
   A second pass re-balances the bands by what each class carried per unit of
   work, and is kept if its bound is higher.

Which SLO binds a class is read from a probe just above its capacity: the
share of its band's requests that miss their TTFT, and their TPOT.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tailguard.core.hardware import PerfModel
from tailguard.core.policies import Slo
from tailguard.engine import EngineConfig
from tailguard.sim.capacity import (
    NODE_SPAN_S,
    PROBE_REQUESTS,
    WARMUP_SHARE,
    ProbeStream,
    _capacity,
    fleet_capacity,
)
from tailguard.sim.cluster import run_cluster
from tailguard.sim.scenario import NodePlan, Scenario, parse_scenario

PASSES = 2


@dataclass(frozen=True, slots=True)
class Band:
    """One class's part of a split fleet's requests."""

    prompt_min: int  # its shortest prompt (tokens)
    prompt_max: int  # its longest
    share: float  # of the workload's requests
    binds: str  # "ttft" or "tpot": the SLO its requests miss first past its capacity


@dataclass(frozen=True, slots=True)
class FleetCapacity:
    """Each node's SLO capacity and the fleet's bound (what ``load:`` is a share of).

    Unsplit, a node's capacity is on the whole mix and the bound their sum;
    split (``bands`` by GPU class), on its band, and the bound is the rate at
    which every class carries its band.
    """

    nodes: dict[str, float]
    bound: float
    bands: dict[str, Band] | None = None
    missed: float = 0.0  # share of requests no class serves (split only)
    # ... over a larger draw, the strongest class, and the seconds of its node each
    # takes (split only: what that class's rate counts beside its band).
    lost_share: float = 0.0
    lost_class: str = ""
    lost_work_s: float = 0.0


class BandStream(ProbeStream):
    """A probe stream of the requests of a prompt-length band of ``base``'s workload:
    its lengths in the base stream's order, with gaps of its own."""

    def __init__(self, base: ProbeStream, lo: tuple[int, int], hi: tuple[int, int]) -> None:
        self._base, self._lo, self._hi = base, lo, hi
        self._band = (hash(base), lo, hi)
        self._seen = 0
        self._rng = random.Random(f"band:{base.seed}:{lo}:{hi}")
        self.gaps, self.prompts, self.outputs = [], [], []
        self.grow(PROBE_REQUESTS)

    def __hash__(self) -> int:
        return hash(self._band)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BandStream) and self._band == other._band

    def grow(self, n: int) -> None:
        base, lo, hi, rng = self._base, self._lo, self._hi, self._rng
        size = len(base.prompts)
        while len(self.prompts) < n:
            if self._seen >= size:
                base.grow(size + PROBE_REQUESTS)
                size = len(base.prompts)
            p, o = base.prompts[self._seen], base.outputs[self._seen]
            self._seen += 1
            if lo <= (p, o) <= hi:
                self.prompts.append(p)
                self.outputs.append(o)
                self.gaps.append(rng.expovariate(1.0))


def _feasible(perf: PerfModel, engine: EngineConfig, scn: Scenario, p: int, o: int) -> bool:
    """``capacity.misses_alone``'s test: the node serves the request alone in its SLO."""
    kv = engine.kv_capacity_tokens or perf.kv_capacity_tokens
    if p + o > kv:
        return False
    if perf.prefill_time(p) + perf.decode_step(1, p) > scn.slo.ttft_s:
        return False
    return perf.decode_step(1, p + o / 2) <= scn.slo.tpot_s


def _work(perf: PerfModel, engine: EngineConfig, scn: Scenario, p: int, o: int) -> float:
    """Seconds of a node's time the request takes: its prefill, and its share of the
    decode steps of the largest batch of such requests the TPOT SLO and the KV allow."""
    ctx = p + o / 2
    kv = engine.kv_capacity_tokens or perf.kv_capacity_tokens
    batch = max(1, min(perf.max_batch_for_tpot(scn.slo.tpot_s, ctx, 512), int(kv // (p + o))))
    return perf.prefill_time(p) + o * perf.decode_step(batch, ctx) / batch


@dataclass
class _Class:
    name: str
    plan: NodePlan
    ids: list[str]
    ok: list[bool]  # by probe request
    work: list[float]
    weight: float = 1.0  # work a node carries per unit of the balance (pass 2: measured)


def _assign(classes: list[_Class], order: list[int], x: float) -> list[tuple[int, int]] | None:
    """Bands (start, end in ``order``) with each class's work per node within ``x``
    (times its weight); None if the strongest class cannot take the rest."""
    bands, k, n = [], 0, len(order)
    for ci, c in enumerate(classes):
        budget = x * c.weight * len(c.ids)
        used, start = 0.0, k
        last = ci == len(classes) - 1
        while k < n:
            i = order[k]
            if not c.ok[i] or (not last and used + c.work[i] > budget):
                break
            used += c.work[i]
            k += 1
        if last and (k < n or used > budget):
            return None
        bands.append((start, k))
    return bands


def _balance(classes: list[_Class], order: list[int]) -> list[tuple[int, int]] | None:
    top = classes[-1]
    hi = sum(top.work[i] for i in order) / (top.weight * len(top.ids)) * 1.001
    if _assign(classes, order, hi) is None:
        return None
    lo = 0.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if _assign(classes, order, mid) is None:
            lo = mid
        else:
            hi = mid
    return _assign(classes, order, hi)


@functools.lru_cache(maxsize=64)
def _binds(perf: PerfModel, engine: EngineConfig, slo: Slo, stream: ProbeStream,
           rate: float) -> str:
    """Which SLO the band's requests miss more at ``rate`` (just past capacity)."""
    n = PROBE_REQUESTS
    t, arrivals = 0.0, []
    for g in stream.gaps[:n]:
        t += g / rate
        arrivals.append(t)
    rec = run_cluster([NodePlan("probe#0", 0, perf, engine)], perf.model.name, arrivals,
                      stream.prompts[:n], stream.outputs[:n], policy="round_robin",
                      slo=slo, seed=0, horizon_s=t * 1.5 + 60.0)
    start = arrivals[int(n * WARMUP_SHARE)]
    ttft = tpot = 0
    for a, f, e, o in zip(rec.arrival, rec.first, rec.end, rec.output, strict=True):
        if a < start:
            continue
        if f < 0 or f - a > slo.ttft_s:
            ttft += 1
        elif o > 1 and (e - f) / (o - 1) > slo.tpot_s:
            tpot += 1
    return "tpot" if tpot > ttft else "ttft"


# Requests drawn to measure the share of the requests no class serves and their
# work (a thin tail of the prompt lengths: the probes' 1,500 hold a handful).
LOST_SAMPLE = 20_000


def _lost_work(scn: Scenario, classes: list[_Class], stream: ProbeStream
               ) -> tuple[float, float]:
    """The share of the workload's requests that no class serves alone (over
    LOST_SAMPLE of them), and the mean seconds of a node of the strongest class
    (the last) each takes (0 for one whose KV it cannot hold: the engine refuses it)."""
    stream.grow(LOST_SAMPLE)
    perf, engine = classes[-1].plan.perf, classes[-1].plan.engine
    kv = engine.kv_capacity_tokens or perf.kv_capacity_tokens
    lost, work = 0, 0.0
    for p, o in zip(stream.prompts[:LOST_SAMPLE], stream.outputs[:LOST_SAMPLE], strict=True):
        if any(_feasible(c.plan.perf, c.plan.engine, scn, p, o) for c in classes):
            continue
        lost += 1
        if p + o <= kv:
            work += _work(perf, engine, scn, p, o)
    return lost / LOST_SAMPLE, work / lost if lost else 0.0


def _split(scn: Scenario, classes: list[_Class], stream: ProbeStream) -> FleetCapacity | None:
    prompts, outputs = stream.prompts[:PROBE_REQUESTS], stream.outputs[:PROBE_REQUESTS]
    n = len(prompts)
    served = [i for i in range(n) if any(c.ok[i] for c in classes)]
    missed = 1.0 - len(served) / n
    order = sorted(served, key=lambda i: (prompts[i], outputs[i]))
    # Each band is rated at the fleet's own target: the requests no class serves
    # (``missed``) are left out of every band. They still take a node's time (a
    # router sends them somewhere, and they miss there): the strongest class's
    # rate is what its nodes carry of its band beside them (_lost_work). Where
    # they are more than the target allows (a long-context trace on a fleet
    # without its strongest GPUs), no rate reaches the target; the bound is then
    # the rate at which the rest meet it, so ``load:`` still scales the trace to
    # what the fleet carries, and ``missed`` says how far short it falls.
    slo = scn.slo
    lost_share, lost_work = _lost_work(scn, classes, stream)
    best: FleetCapacity | None = None
    for _ in range(PASSES):
        bands = _balance(classes, order)
        if bands is None:
            return best
        rates, caps, out_bands = [], {}, {}
        for c, (start, end) in zip(classes, bands, strict=True):
            if end <= start:
                caps[c.name] = 0.0
                continue
            lo, hi = order[start], order[end - 1]
            band = BandStream(stream, (prompts[lo], outputs[lo]), (prompts[hi], outputs[hi]))
            share = (end - start) / n
            cap = _capacity(c.plan.perf, c.plan.engine, slo, band, len(c.ids), NODE_SPAN_S)
            caps[c.name] = cap
            binds = _binds(c.plan.perf, c.plan.engine, slo, band, cap * 1.15) if cap > 0 else "-"
            out_bands[c.name] = Band(prompts[lo], prompts[hi], share, binds)
            if c is classes[-1] and lost_work > 0.0:
                # At a fleet rate R its nodes take R x share of the band and spend
                # R x lost_share x lost_work seconds a second on the lost ones.
                rates.append(len(c.ids) * cap / (share + lost_share * lost_work * cap))
            else:
                rates.append(len(c.ids) * cap / share)
            # What a node of the class carried per unit of balanced work: the next
            # pass gives a class that did better more of the work.
            work = sum(c.work[order[k]] for k in range(start, end)) / (end - start)
            c.weight = max(1e-9, cap * work)
        bound = min(rates) if rates else 0.0
        nodes = {nid: caps[c.name] for c in classes for nid in c.ids}
        found = FleetCapacity(nodes, bound, out_bands, missed, lost_share,
                              classes[-1].name, lost_work)
        if best is None or found.bound > best.bound:
            best = found
    return best


def fleet_bound(scn: Scenario, progress: Callable[[int, int, str], None] | None = None,
                split: bool = True) -> FleetCapacity:
    """Each node's SLO capacity and the fleet's bound; split where some class cannot
    serve the whole mix (module docstring), unless ``split`` is False (the sum: the
    split's probes take 10-25 s of simulation on a long-prompt fleet)."""
    caps = fleet_capacity(scn, progress)
    plans = scn.nodes()
    stream = ProbeStream.shared(scn)
    whole = FleetCapacity(caps, sum(caps.values()))
    if not split:
        return whole
    stream = ProbeStream.shared(scn)
    prompts, outputs = stream.prompts[:PROBE_REQUESTS], stream.outputs[:PROBE_REQUESTS]
    groups: dict[tuple[PerfModel, EngineConfig], list[NodePlan]] = {}
    for plan in plans:
        groups.setdefault((plan.perf, plan.engine), []).append(plan)
    allowed = (1.0 - scn.slo.attainment) * len(prompts)
    classes = []
    blocked = False
    for (perf, engine), members in groups.items():
        ok = [_feasible(perf, engine, scn, p, o) for p, o in zip(prompts, outputs, strict=True)]
        if len(ok) - sum(ok) > allowed:
            blocked = True
        if not any(ok):
            continue
        work = [_work(perf, engine, scn, p, o) for p, o in zip(prompts, outputs, strict=True)]
        name = members[0].id.split("#")[0]
        classes.append(_Class(name, members[0], [m.id for m in members], ok, work))
    if not blocked or not classes:
        return whole
    # Weakest first: the class that serves the fewest requests, then the slowest.
    classes.sort(key=lambda c: (sum(c.ok), -sum(c.work)))
    found = _split(scn, classes, stream)
    if found is None or found.bound <= whole.bound:
        return whole
    for plan in plans:  # classes that serve nothing
        found.nodes.setdefault(plan.id, 0.0)
    return found


def binding_slos(scn: Scenario, fc: FleetCapacity) -> dict[str, str]:
    """By GPU class, the SLO its requests miss first just past its capacity ("ttft" or
    "tpot"; "-": it has none), on its band where the fleet is split."""
    out: dict[str, str] = {}
    stream = ProbeStream.shared(scn)
    for plan in scn.nodes():
        name, cap = plan.id.split("#")[0], fc.nodes.get(plan.id, 0.0)
        if name in out:
            continue
        band = (fc.bands or {}).get(name)
        if band is not None:
            out[name] = band.binds
        elif cap > 0.0 and fc.bands is None:
            out[name] = _binds(plan.perf, plan.engine, scn.slo, stream, cap * 1.15)
        else:
            out[name] = "-"
    return out


def capacity_bound(model: str, slo: Slo, fleet: Sequence[tuple[str, int]],
                   input_tokens: Mapping[str, Any], output_tokens: Mapping[str, Any],
                   tp: int = 1) -> float:
    """The SLO capacity bound (req/s) of ``fleet`` ((GPU, count) pairs, replicas of
    ``tp`` GPUs) serving ``model`` at the given length distributions (scenario syntax)."""
    scn = parse_scenario({
        "name": "bound", "seed": 1, "model": model,
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "fleet": [{"gpu": g, "count": c, "tp": tp} for g, c in fleet],
        "workload": {"duration_s": 60, "warmup_s": 0, "arrival": {"process": "poisson", "rate": 1},
                     "input_tokens": dict(input_tokens), "output_tokens": dict(output_tokens)},
    })
    return fleet_bound(scn).bound


__all__ = ["Band", "BandStream", "FleetCapacity", "binding_slos", "capacity_bound",
           "fleet_bound"]
