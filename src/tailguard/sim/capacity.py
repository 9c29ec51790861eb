"""SLO capacity: how many requests per second one node can carry within the SLO.

Definition. The SLO capacity of a node is the highest Poisson arrival rate at
which that node *alone*, fed the scenario's prompt and answer lengths, serves
at least the attainment target (default 0.99) of its requests within both the
TTFT and the TPOT SLO. It is found by simulation, not by formula, because
queueing, batching and chunked-prefill interference all matter:

1. draw ``n`` (default 1500) request lengths and ``n`` unit-rate exponential
   gaps once (common random numbers: every probe sees the same requests, only
   compressed in time, so attainment falls almost monotonically with rate);
2. probe a rate by simulating the node alone and measuring the attainment of
   the requests after the first 20% (the warm-up);
3. bracket the capacity by doubling/halving from the roofline's rough
   throughput, then bisect to 1% of the rate.

A probe of a fixed count is short at a high rate, and a short probe overrates:
its arrivals end before the batch and the queue reach their steady state (an
answer lives for its tokens times the TPOT). With ``span_s`` (what the planner
rates shapes with), a probe takes as many requests as its rate brings in
``span_s`` seconds: the stream of requests grows in chunks
(:class:`ProbeStream`), each probe a prefix of the same one, so common random
numbers still hold. A node's own capacity (the fleet's capacity bound) is
probed so over at least NODE_SPAN_S; where the fixed count already spans that
long at the capacity it finds, nothing changes. The measurements behind this
are in ``benchmarks/README.md`` (planner and capacity).

The fleet's **capacity bound** is the sum over nodes of their SLO capacities:
a fleet cannot do better than every node working on its own at its limit, and
a good router gets close because pooling only helps. ``load: 0.8`` in a
scenario means 80% of this bound. Where some nodes cannot serve the whole mix
(long prompts), :mod:`tailguard.sim.fleet_bound` splits it among them. Nodes of the same GPU, TP and engine
settings share one computation; results are memoised per process.
"""

from __future__ import annotations

import bisect
import functools
import math
import random
from collections.abc import Callable, Sequence

from tailguard.core.hardware import PerfModel
from tailguard.core.policies import Slo
from tailguard.engine import Engine, EngineConfig
from tailguard.engine.scheduler import FINISH, FIRST_TOKEN
from tailguard.sim.cluster import run_cluster
from tailguard.sim.results import attainment
from tailguard.sim.scenario import NodePlan, Scenario
from tailguard.traffic.workload import sample_lengths

PROBE_REQUESTS = 1500
# A node's SLO capacity (the capacity bound that ``load:`` is a share of) is
# probed over arrivals of at least this span: about three lifetimes of an
# answer of 211 tokens at a 100 ms TPOT.
NODE_SPAN_S = 60.0
# A spanned probe draws at most this many requests (its span shrinks beyond it).
MAX_PROBE_REQUESTS = 120_000
WARMUP_SHARE = 0.2
PRECISION = 0.01
# A spanned search stops at this precision: over capacity by a share e, the
# queue grows by e x capacity a second and takes about TTFT / e seconds to
# break the TTFT SLO, so a 90 s probe under a 2 s TTFT cannot tell rates much
# closer than 3% apart (and each spanned probe costs its rate x span requests).
SPANNED_PRECISION = 0.03
IDLE_LOAD = 0.02  # arrivals x a lone request's time: nearly never two at once


class ProbeStream:
    """The requests capacity probes replay: unit-rate gaps and lengths, drawn in
    chunks on demand so that every probe is a prefix of one stream.

    The first chunk is ``probe_workload``'s draw (PROBE_REQUESTS), so a probe of
    that many requests sees what an unspanned one does; chunk k after it comes
    from its own seed. Streams are equal when their seed and first chunk are
    (the rest follows from them), so capacities are memoised across scenarios
    of the same workload, as they were when probes were tuples; ``shared``
    hands every caller of one workload the same stream, so its chunks are
    drawn and held once.
    """

    def __init__(self, scn: Scenario, chunk: int = PROBE_REQUESTS) -> None:
        self._scn, self._chunk = scn, chunk
        first = probe_workload(scn, chunk)
        self.seed = scn.seed
        self._key = (scn.seed, *first)
        self.gaps, self.prompts, self.outputs = list(first[0]), list(first[1]), list(first[2])

    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProbeStream) and self._key == other._key

    @classmethod
    def shared(cls, scn: Scenario) -> ProbeStream:
        """The stream of ``scn``'s workload that earlier callers grew (a new one if none)."""
        stream = cls(scn)
        kept = _STREAMS.get(stream)
        if kept is None:
            if len(_STREAMS) >= MAX_SHARED_STREAMS:
                _STREAMS.clear()  # capacities memoised on them keep their own
            kept = _STREAMS[stream] = stream
        return kept

    def grow(self, n: int) -> None:
        """Draw until the stream holds at least ``n`` requests."""
        while len(self.gaps) < n:
            rng = random.Random(f"{self._scn.seed}:capacity:{len(self.gaps) // self._chunk}")
            self.gaps += [rng.expovariate(1.0) for _ in range(self._chunk)]
            prompts, outputs = sample_lengths(self._scn.workload, self._chunk, rng)
            self.prompts += prompts
            self.outputs += outputs


_STREAMS: dict[ProbeStream, ProbeStream] = {}
MAX_SHARED_STREAMS = 16


def _meets(perf: PerfModel, engine: EngineConfig, slo: Slo, stream: ProbeStream, copies: int,
           span_s: float | None, rate: float) -> bool:
    n = PROBE_REQUESTS
    if span_s is not None:
        n = min(MAX_PROBE_REQUESTS, max(n, math.ceil(rate * copies * span_s)))
        stream.grow(n)
    gaps, prompts, outputs = stream.gaps[:n], stream.prompts[:n], stream.outputs[:n]
    t = 0.0
    arrivals = []
    for g in gaps:
        t += g / (rate * copies)
        arrivals.append(t)
    horizon_s = t * 1.5 + 60.0
    start_s = arrivals[int(len(arrivals) * WARMUP_SHARE)]
    if copies == 1:
        return _met_alone(perf, engine, slo, arrivals, prompts, outputs, horizon_s,
                          start_s) >= slo.attainment
    plans = [NodePlan(f"probe#{i}", 0, perf, engine) for i in range(copies)]
    rec = run_cluster(plans, perf.model.name, arrivals, prompts, outputs,
                      policy="least_request", slo=slo, seed=0, horizon_s=horizon_s)
    return attainment(rec, slo, start_s) >= slo.attainment


def _met_alone(perf: PerfModel, config: EngineConfig, slo: Slo, arrivals: Sequence[float],
               prompts: Sequence[int], outputs: Sequence[int], horizon_s: float,
               start_s: float) -> float:
    """SLO attainment of one node's engine fed ``arrivals`` directly, of the requests
    that arrived at or after ``start_s``, counting what finished by ``horizon_s``.

    A lone node behind the gateway gets every request the moment it arrives and
    the gateway changes none of its timings (nothing to route, retry or move to),
    so a probe of one node drives its engine model alone: a fifth of the
    simulator's cost per request. ``tests/sim/test_capacity.py`` holds it to the
    full simulator's answer."""
    eng = Engine(perf, config)
    n = len(arrivals)
    first = [-1.0] * n
    met = 0
    i = 0
    while True:
        t_engine = eng.next_event_time()
        t_arrive = arrivals[i] if i < n else math.inf
        now = t_arrive if t_arrive <= t_engine else t_engine
        if now > horizon_s:
            break
        if t_arrive <= t_engine:
            eng.submit(i, prompts[i], outputs[i], now)
            i += 1
            continue
        for t, kind, rid in eng.advance(now):
            if kind == FIRST_TOKEN:
                first[rid] = t
            elif kind == FINISH and arrivals[rid] >= start_s:  # (a FAILED one misses)
                f = first[rid] if first[rid] >= 0.0 else t  # a one-token answer's
                out = outputs[rid]
                tpot = (t - f) / (out - 1) if out > 1 else 0.0
                met += f - arrivals[rid] <= slo.ttft_s and tpot <= slo.tpot_s
    window = n - bisect.bisect_left(arrivals, start_s)
    return met / window if window else 0.0


@functools.lru_cache(maxsize=256)
def _capacity(perf: PerfModel, engine: EngineConfig, slo: Slo, stream: ProbeStream,
              copies: int = 1, span_s: float | None = None) -> float:
    # ``copies`` > 1: the capacity per node of that many alike behind a
    # least-request balancer (pooling lets each carry more than alone).
    # ``span_s``: each probe's arrivals span at least that long (module docstring).
    prompts, outputs = stream.prompts[:PROBE_REQUESTS], stream.outputs[:PROBE_REQUESTS]
    # A node that cannot prefill enough of the prompts within the TTFT even when
    # idle has no SLO capacity: say so now. The search would halve its rate
    # down to 1e-4 req/s, and a probe's simulated time (its ticks) grows as the
    # rate falls: 50 s of wall time for one L4 facing 12,000-token histories.
    # The 1.2 margin keeps this to nodes far from the line, where the roofline's
    # prefill time and the engine's chunked steps cannot disagree on the answer.
    too_long = sum(1 for p in prompts if perf.prefill_time(p) > 1.2 * slo.ttft_s)
    if too_long > (1.0 - slo.attainment) * len(prompts) * 1.5:
        return 0.0
    # Likewise a node whose decode step alone, a batch of one, is over the TPOT
    # (an L4 streaming an 8B model's 16 GB takes ~75 ms a token): no rate helps.
    too_slow = sum(1 for p in prompts if perf.decode_step(1, float(p)) > 1.1 * slo.tpot_s)
    if too_slow > (1.0 - slo.attainment) * len(prompts) * 1.5:
        return 0.0
    # And one whose KV cache cannot hold enough of the requests whole.
    kv = engine.kv_capacity_tokens or perf.kv_capacity_tokens
    too_big = sum(1 for p, o in zip(prompts, outputs, strict=True) if p + o > kv)
    if too_big > (1.0 - slo.attainment) * len(prompts) * 1.5:
        return 0.0
    mean_out = sum(outputs) / len(outputs)
    mean_in = sum(prompts) / len(prompts)
    if span_s is None:  # rough start: a request's prefill and its share of a batch-16 decode
        guess = 1.0 / (perf.prefill_time(int(mean_in))
                       + mean_out * perf.decode_step(16, mean_in) / 16)
    else:  # the short probes' capacity: it overrates, and costs little
        guess = _capacity(perf, engine, slo, stream, copies)
        if guess <= 0.0 or guess * copies * span_s <= PROBE_REQUESTS:
            return guess  # the short probes spanned as long at that rate already
    meets = functools.partial(_meets, perf, engine, slo, stream, copies, span_s)
    lo, hi = 0.0, guess
    if meets(hi):
        lo = hi
        hi *= 2.0
        while meets(hi):
            lo, hi = hi, hi * 2.0
            if hi > 1e5:
                return lo
    else:
        # A request alone takes about ``alone`` seconds; at a rate where
        # requests almost never overlap (IDLE_LOAD), a miss is the request's own
        # and no lower rate can help (halving on to 1e-4 req/s would cost
        # minutes of simulated idling).
        alone = perf.prefill_time(int(mean_in)) + mean_out * perf.decode_step(1, mean_in)
        while True:
            hi_new = hi / 2.0
            if hi_new < 1e-4 or hi_new * alone < IDLE_LOAD:
                return 0.0
            if meets(hi_new):
                lo = hi_new
                break
            hi = hi_new
    precision = PRECISION if span_s is None else SPANNED_PRECISION
    while hi - lo > precision * lo:
        mid = (lo + hi) / 2.0
        if meets(mid):
            lo = mid
        else:
            hi = mid
    return lo


def probe_workload(scn: Scenario, n: int = PROBE_REQUESTS) -> tuple[
        tuple[float, ...], tuple[int, ...], tuple[int, ...]]:
    rng = random.Random(f"{scn.seed}:capacity")
    gaps = tuple(rng.expovariate(1.0) for _ in range(n))
    prompts, outputs = sample_lengths(scn.workload, n, rng)
    return gaps, tuple(prompts), tuple(outputs)


def node_capacity(scn: Scenario, plan: NodePlan) -> float:
    """SLO capacity (req/s) of one node at nominal speed (card spread and faults excluded),
    from probes spanning at least NODE_SPAN_S."""
    return _capacity(plan.perf, plan.engine, scn.slo, ProbeStream.shared(scn), 1, NODE_SPAN_S)


def replica_capacity(scn: Scenario, perf: PerfModel, engine: EngineConfig, copies: int = 1,
                     span_s: float | None = None) -> float:
    """SLO capacity (req/s) of a replica that is not (yet) in the scenario's fleet,
    under the scenario's SLO and lengths (what the planner weighs formations by);
    with ``copies``, per replica of that many pooled behind least-request; with
    ``span_s``, from probes whose arrivals span that long at every rate."""
    return _capacity(perf, engine, scn.slo, ProbeStream.shared(scn), copies, span_s)


def misses_alone(scn: Scenario, plan: NodePlan) -> dict[str, float]:
    """The share of the workload's requests that one node cannot serve within the SLO
    even alone on an idle engine, by the first reason (``kv``: prompt and answer do not
    fit its KV cache; ``ttft``: its prefill is too slow; ``tpot``: a lone decode step
    is); empty when it can serve them all. A node whose misses exceed ``1 -
    attainment`` has capacity 0 at any rate: the reason ``tailguard capacity`` gives."""
    stream = ProbeStream.shared(scn)
    perf, slo = plan.perf, scn.slo
    kv = perf.kv_capacity_tokens
    counts: dict[str, int] = {}
    for prompt, out in zip(stream.prompts, stream.outputs, strict=True):
        if prompt + out > kv:
            why = "kv"
        elif perf.prefill_time(prompt) + perf.decode_step(1, prompt) > slo.ttft_s:
            why = "ttft"
        elif perf.decode_step(1, prompt + out / 2) > slo.tpot_s:
            why = "tpot"
        else:
            continue
        counts[why] = counts.get(why, 0) + 1
    n = len(stream.prompts)
    return {why: k / n for why, k in counts.items()}


def fleet_capacity(scn: Scenario,
                   progress: Callable[[int, int, str], None] | None = None) -> dict[str, float]:
    """Each node's SLO capacity by node id; ``progress(done, total, node)`` after each."""
    plans = scn.nodes()
    out = {}
    for i, plan in enumerate(plans):
        out[plan.id] = node_capacity(scn, plan)
        if progress is not None:
            progress(i + 1, len(plans), plan.id)
    return out
