"""The discrete-event simulator: a fleet of engine models driven by the decision core.

One heap of events ordered by ``(time, sequence number)``: the sequence number
is the deterministic tie-break, so the same seed gives the same run, byte for
byte. Events are arrivals, submissions reaching an engine (after half the
network round trip), engine wake-ups (an engine reports the next moment it
needs attention; stale wake-ups are skipped by a version counter), deliveries
of first tokens, finishes and failures back to the gateway, fault changes,
exchange timers and the balancer's periodic tick.

The gateway side is the core's: each request is an
:class:`~tailguard.core.exchange.Exchange` on the real
:class:`~tailguard.core.balancer.Balancer`, the same objects the live gateway
drives, told only what a gateway would see (prompt length at arrival, the
first token, the finish or the failure with its origin).
:class:`ClusterSim` maps the exchange's actions onto the heap: a dispatched
copy is an engine request of its own id (its index in ``copies``), a cancel
removes it from its engine, a timer is an event. Retries, the retry budget,
the hedge and its race are therefore exactly the gateway's. The engines, the
network and the faults are :mod:`tailguard.sim.nodes`.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tailguard import engine as eng
from tailguard.config.faults import FaultSpec
from tailguard.core.admission import AdmissionConfig
from tailguard.core.balancer import Balancer, Event, PoolConfig
from tailguard.core.events import remedy
from tailguard.core.exchange import (
    COMMITTED,
    ENDED,
    Action,
    ArmTimer,
    Cancel,
    Copy,
    Decode,
    Dispatch,
    Exchange,
    Failure,
    Migrate,
    Request,
    pump,
)
from tailguard.core.fleet import STALL_S, NodeSpec, Outcome
from tailguard.core.hedging import HedgeConfig
from tailguard.core.kv_transfer import DEFAULT_LINK, Link, PairLink
from tailguard.core.limits import LimitConfig
from tailguard.core.migration import MigrationConfig
from tailguard.core.outliers import OutlierConfig
from tailguard.core.pipeline import PipelinePerf
from tailguard.core.policies import Slo
from tailguard.core.retry_budget import RetryConfig
from tailguard.sim.moves import GAP_RESOLUTION_S, REVIEW, WATCH, StreamWatch
from tailguard.sim.nodes import HEALTH_INTERVAL_S, SimNode, apply_fault, health_check
from tailguard.sim.scenario import NodePlan
from tailguard.sim.streams import StreamReports

# Event kinds; the heap holds (time, seq, kind, a, b), a and b as noted.
ARRIVE = 0  # a: request id
SUBMIT = 1  # a: copy id, b: node index
ENGINE = 2  # a: node index, b: the engine wake-up's version
FIRST = 3  # a: copy id
FINISH = 4  # a: copy id
FAIL = 5  # a: copy id, b: 0 connect failure, else a 5xx
FAULT = 6  # a: fault index, b: 1 when the fault ends
TICK = 7
TIMER = 8  # a: request id (an exchange's timer)
HEALTH = 9  # a round of health probes
HANDOFF = 10  # a: copy id: its prompt's KV has reached its decode node
MOVES = 11  # mid-stream migration's look at a node (a) or a moved copy (a); b: sim/moves.py
QUIET = 12  # a: node index whose long step has ended, b: its note (sim/streams.py)

# Request status codes in the result arrays.
OK, FAILED_STATUS, UNFINISHED, SHED = 0, 1, 2, 3
_STATUS = {"ok": OK, "shed": SHED}

_DELIVERY = {eng.FIRST_TOKEN: FIRST, eng.FINISH: FINISH, eng.FAILED: FAIL}
_CONNECT = Failure(Outcome.CONNECT_FAILURE, 502, "cannot connect to the node",
                   "upstream_connect_failed")
_5XX = Failure(Outcome.UPSTREAM_5XX, 502, "the node answered 5xx", "upstream_error", judged=False)


@dataclass(slots=True)
class RunRecord:
    """Per-request outcome arrays of one run (index = request id)."""

    arrival: list[float]
    prompt: list[int]
    output: list[int]
    node: list[int]
    first: list[float]
    end: list[float]
    status: list[int]
    node_ids: list[str]
    events: list[Event] = field(default_factory=list)
    outliers: dict[str, Any] = field(default_factory=dict)  # detector counts and state times
    hedges: int = 0  # duplicates sent
    hedge_wins: int = 0  # ... whose copy produced the first token first
    retries: int = 0
    end_time: float = 0.0
    # With limits/admission: seconds each request waited in the gateway queue,
    # its priority (0 high, 1 normal, 2 low) and each node's final limit.
    queue_s: list[float] = field(default_factory=list)
    priority: list[int] = field(default_factory=list)
    limits: dict[str, int] = field(default_factory=dict)
    # With shared prefixes: prompt tokens each request's answering copy found in
    # its engine's prefix cache.
    cached: list[int] = field(default_factory=list)
    # Disaggregated fleets: the node that computed each request's prompt for its
    # decode node (-1: the decode node itself), and its KV transfer's seconds.
    prefill_node: list[int] = field(default_factory=list)
    kv_s: list[float] = field(default_factory=list)
    handoff: list[float] = field(default_factory=list)  # when its prompt was handed over
    # Mid-stream migration: continuations sent, by cause, and the prompt tokens
    # they made engines compute again (the original prompt plus the answer so far).
    moves: dict[str, int] = field(default_factory=dict)
    move_prefill_tokens: int = 0
    # Each request's longest gap between two tokens (sim/moves.py; empty when
    # migration is off): nan never served, inf failed after its first token.
    gaps: list[float] = field(default_factory=list)


def node_specs(plans: Sequence[NodePlan], model: str) -> list[NodeSpec]:
    return [
        NodeSpec(id=p.id, gpu=p.perf.gpu, gpu_name=p.perf.gpu.name, tp=p.perf.tp, models=(model,),
                 max_num_seqs=p.engine.max_num_seqs,
                 layout=p.perf.layout if isinstance(p.perf, PipelinePerf) else None,
                 role=p.role, kv_link=p.kv_link)
        for p in plans
    ]


def run_cluster(
    plans: Sequence[NodePlan],
    model: str,
    arrivals: Sequence[float],
    prompts: Sequence[int],
    outputs: Sequence[int],
    *,
    policy: str,
    policy_options: Any = None,
    slo: Slo,
    seed: int,
    network_rtt_s: float = 0.0,
    faults: Sequence[FaultSpec] = (),
    horizon_s: float = math.inf,
    tick_s: float = 1.0,
    step_by_step: bool = False,
    progress: Callable[[float], None] | None = None,
    outliers: OutlierConfig | None = None,
    hedging: HedgeConfig | None = None,
    migration: MigrationConfig | None = None,
    limits: LimitConfig | None = None,
    admission: AdmissionConfig | None = None,
    priorities: Sequence[int] | None = None,
    retries: RetryConfig | None = None,
    exchange_type: type[Exchange] = Exchange,
    gpu_telemetry: bool = False,
    blocks: Sequence[tuple[int, ...]] | None = None,
    block_tokens: int = 0,
    sessions: Sequence[int] | None = None,
    kv_link: Link = DEFAULT_LINK,
    kv_pairs: tuple[PairLink, ...] = (),
) -> RunRecord:
    """Simulate one policy on one fleet for one request list; return per-request outcomes.

    ``blocks``: each request's hashed ``block_tokens``-token blocks (prompt, then
    answer), for the engines' prefix caches and the router's prefix index;
    ``sessions``: each request's session (its key for session affinity)."""
    pool = PoolConfig(model, policy, policy_options, slo, limits=limits,
                      admission=admission, retries=retries or RetryConfig(),
                      hedging=hedging or HedgeConfig(), kv_link=kv_link, kv_pairs=kv_pairs,
                      migration=migration or MigrationConfig())
    if blocks is not None:
        pool = dataclasses.replace(pool, prefix_block_tokens=block_tokens)
    balancer = Balancer(node_specs(plans, model), [pool],
                        random.Random(f"{seed}:{policy}:route"),
                        # None (capacity probes, unit runs): no detection.
                        outliers=outliers or OutlierConfig(enabled=False))
    sim = ClusterSim(balancer, plans, model, arrivals, prompts, outputs, seed=seed,
                     network_rtt_s=network_rtt_s, faults=faults, step_by_step=step_by_step,
                     limited=limits is not None or admission is not None,
                     priorities=priorities, exchange_type=exchange_type,
                     gpu_telemetry=gpu_telemetry,
                     blocks=blocks, block_tokens=block_tokens, sessions=sessions)
    return sim.run(horizon_s, tick_s, progress)


class ClusterSim:
    """The simulated gateway: one exchange per request, its actions onto the heap."""

    def __init__(self, balancer: Balancer, plans: Sequence[NodePlan], model: str,
                 arrivals: Sequence[float], prompts: Sequence[int], outputs: Sequence[int], *,
                 seed: int, network_rtt_s: float, faults: Sequence[FaultSpec], step_by_step: bool,
                 limited: bool, priorities: Sequence[int] | None,
                 exchange_type: type[Exchange],
                 gpu_telemetry: bool = False, blocks: Sequence[tuple[int, ...]] | None = None,
                 block_tokens: int = 0, sessions: Sequence[int] | None = None) -> None:
        n = len(arrivals)
        self.sessions = sessions
        self.blocks = blocks
        self.bt = block_tokens
        self.gpu_telemetry = gpu_telemetry
        self.balancer = balancer
        self.model = model
        self.faults = faults
        self.hedger = balancer.pools[model].hedger  # the pool's, which its exchanges draw on
        self.limited = limited
        self.exchange_type = exchange_type
        self.fault_rng = random.Random(f"{seed}:faults")
        self.nodes = [SimNode(i, p, step_by_step) for i, p in enumerate(plans)]
        self.by_id = {p.id: i for i, p in enumerate(plans)}
        self.half_rtt = network_rtt_s / 2.0
        self.prio = list(priorities) if priorities is not None else [1] * n
        self.rec = RunRecord(
            arrival=list(arrivals), prompt=list(prompts), output=list(outputs),
            node=[-1] * n, first=[-1.0] * n, end=[-1.0] * n,
            status=[UNFINISHED] * n, node_ids=[p.id for p in plans],
        )
        if limited:
            self.rec.queue_s = [0.0] * n
            self.rec.priority = self.prio
        if blocks is not None:
            self.rec.cached = [0] * n
        self.pool = balancer.pools[model]
        if any(p.role != "both" for p in plans):
            self.rec.prefill_node = [-1] * n
            self.rec.kv_s = [0.0] * n
            self.rec.handoff = [-1.0] * n
        self.exchanges: list[Exchange | None] = [None] * n
        # By copy id, which is its engine request id; None once its exchange ended
        # (its later events are stale), so that ended exchanges are not kept alive.
        self.copies: list[Copy | None] = []
        self.copy_ex: list[Exchange | None] = []  # copy id -> its exchange, the same way
        self.copy_node: list[int] = []  # copy id -> node index
        self.outstanding = n
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.seq = itertools.count()  # the tie-break: the same seed gives the same run
        # Committed streams, told at each tick (sim/streams.py), so that the
        # detector judges long answers piece by piece here as it does live.
        det = balancer.outliers
        self.judge_pieces = det is not None and det.config.segment_s > 0.0
        # A stream's first piece is judged no sooner than this after its first token
        # (Learner.stream_progress): the first time it is worth telling.
        self.piece_s = det.config.segment_s if det is not None else 0.0
        self.streaming = StreamReports()
        # Mid-stream migration: the streams each node holds, its long steps, the
        # reviews a gateway's stall clock would make, and each request's longest gap.
        self.moving = self.pool.config.migration.enabled
        self.watch = StreamWatch(self.nodes, self.copies, self.copy_ex, self.copy_node,
                                 self.pool.config.migration.stall_floor_s, self._do,
                                 lambda t, x, what: self.push(t, MOVES, x, what))

    def push(self, t: float, kind: int, a: int = 0, b: int = 0) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), kind, a, b))

    # -- the loop ------------------------------------------------------------------

    def run(self, horizon_s: float, tick_s: float,
            progress: Callable[[float], None] | None) -> RunRecord:
        rec = self.rec
        self._start(horizon_s, tick_s)
        heap = self.heap
        pop = heapq.heappop
        push = heapq.heappush
        seq = self.seq
        nodes = self.nodes
        copies = self.copies
        watch_on = self.watch.on if self.moving else [set() for _ in nodes]
        n_req = len(rec.arrival)
        next_progress = 0.0
        now = 0.0
        while heap:
            now, _, kind, a, b = pop(heap)
            if now > horizon_s:
                break
            if kind == ENGINE:
                ns = nodes[a]
                if b != ns.version:
                    continue
                ns.scheduled = math.inf
                delay = self.half_rtt + ns.delay
                for t_ev, ev_kind, cid in ns.engine.advance(now):
                    push(heap, (t_ev + delay, next(seq), _DELIVERY[ev_kind], cid, 2))
                self._reschedule(ns)
                # (a run no longer than the resolution has no long step in it)
                if watch_on[a] and ns.scheduled - now > GAP_RESOLUTION_S:
                    self.watch.look(ns, now)
                if STALL_S <= ns.scheduled - now < math.inf and self.streaming:
                    self._long_step(ns, now)
            elif kind == ARRIVE:
                if a + 1 < n_req:
                    push(heap, (rec.arrival[a + 1], next(seq), ARRIVE, a + 1, 0))
                self._arrive(a, now)
                if progress is not None and now >= next_progress:
                    progress(now)
                    next_progress = now + 10.0
            elif kind == SUBMIT:
                self._submit(a, nodes[b], now)
            elif kind <= FAIL:  # FIRST, FINISH, FAIL
                copy = copies[a]
                ex = self.copy_ex[a]
                if copy is None or ex is None:
                    continue
                if copy.pio == a:  # its prefill leg, on another node
                    self._prefill_event(ex, copy, kind, b, now)
                elif kind == FIRST:
                    self._first(ex, copy, now)
                elif kind == FINISH:
                    self._finish(ex, copy, now)
                else:
                    self._failed(ex, copy, now, _CONNECT if b == 0 else _5XX)
            elif kind == TIMER:
                timed = self.exchanges[a]
                if timed is not None:
                    self._do(timed, timed.timer(now), now)
            elif kind == FAULT:
                self._fault(a, b == 1, now)
            elif kind == HANDOFF:
                self._hand_off(a, now)
            elif kind == MOVES:
                self._watched(a, b, now)
            elif kind == QUIET:
                self.streaming.quiet_ended(nodes[a], b, now, self.copy_node, self.half_rtt)
            elif kind == HEALTH:
                health_check(nodes, self.balancer, now)
                if self.outstanding > 0:
                    self.push(now + HEALTH_INTERVAL_S, HEALTH)
            else:  # TICK
                self._tick(now, tick_s)
        return self._finish_record(now)

    def _start(self, horizon_s: float, tick_s: float) -> None:
        """The first arrival, the first tick, the faults and, where a node may crash, probes."""
        self._schedule_faults(horizon_s)
        if self.rec.arrival:
            self.push(self.rec.arrival[0], ARRIVE, 0)
        self.push(tick_s, TICK)
        if any(f.kind == "crash" for f in self.faults):  # nothing else fails a probe
            self.push(HEALTH_INTERVAL_S, HEALTH)

    def _submit(self, cid: int, ns: SimNode, now: float) -> None:
        """Copy ``cid`` reaches its node's engine (or fails there: the node is down)."""
        if ns.crashed:
            self.push(now + self.half_rtt + ns.delay, FAIL, cid, 0)
            return
        owner = self.copy_ex[cid]
        if owner is None:
            return
        rid = owner.tag
        copy = self.copies[cid]
        prompt, output = self._sizes(rid, copy)
        if copy is not None and copy.pio == cid:  # a prefill leg: one token, its KV held
            blocks = self.blocks[rid] if self.blocks is not None else ()
            ns.engine.submit(cid, prompt, 1, now, blocks, self.bt, hold_kv=True)
            self._reschedule(ns)
            return
        priority = 0
        if copy is not None and copy.after is not None:  # a continuation
            cfg = owner.migration
            if cfg is not None and cfg.engine_priority is not None:
                priority = cfg.engine_priority
        if self.blocks is None:
            ns.engine.submit(cid, prompt, output, now, priority=priority)
        else:
            ns.engine.submit(cid, prompt, output, now, self.blocks[rid], self.bt,
                             priority=priority)
        self._reschedule(ns)

    def _sizes(self, rid: int, copy: Copy | None) -> tuple[int, int]:
        """The prompt and answer a copy asks its engine for: a continuation's prompt
        carries the answer so far, and it asks for the rest."""
        after = copy.after if copy is not None and copy.after is not None else 0
        return self.rec.prompt[rid] + after, max(1, self.rec.output[rid] - after)

    def _prefill_event(self, ex: Exchange, copy: Copy, kind: int, b: int, now: float) -> None:
        """What a prefill leg's engine said: done (its one token), or failed."""
        if kind == FINISH:
            self._do(ex, ex.prefilled(copy, now), now)
        elif kind == FAIL:
            self._do(ex, ex.prefill_failed(copy, now, _CONNECT if b == 0 else _5XX), now)
            if ex.ended is not None:
                self._settle(ex, now)
            if self.limited:
                self._place_queued(now)

    def _decode(self, ex: Exchange, copy: Copy, now: float) -> None:
        """The decode leg leaves the gateway: its node pulls the prompt's KV from the
        prefill node over their link, then admits it (HANDOFF)."""
        p = self.by_id[copy.prefill_node]  # type: ignore[index]  # a Decode has one
        d = self.copy_node[copy.io]
        rid = ex.tag
        pn, dn = self.nodes[p], self.nodes[d]
        kv = self.pool.links.nominal_s(pn.plan.id, dn.plan.id,
                                       dn.plan.perf.model.kv_bytes_per_token,
                                       self._sizes(rid, copy)[0])
        rate = min(pn.kv_rate, dn.kv_rate)  # a kv_link fault on either end
        if rate != 1.0:
            link = self.pool.links.between(pn.plan.id, dn.plan.id)
            setup = link.setup_s if link is not None else 0.0
            kv = setup + (kv - setup) / rate
        if self.rec.kv_s:
            self.rec.prefill_node[rid] = p
            self.rec.kv_s[rid] = kv
            self.rec.handoff[rid] = now
        ns = self.nodes[d]
        self.push(now + self.half_rtt + ns.delay + kv, HANDOFF, copy.io)

    def _hand_off(self, cid: int, now: float) -> None:
        """The KV arrived: the prefill node frees it, the decode node admits the request."""
        copy = self.copies[cid]
        owner = self.copy_ex[cid]
        if copy is None or owner is None:
            return
        pn = self.nodes[self.copy_node[copy.pio]]
        # A prefill node that crashed meanwhile lost the KV: the decode node
        # computes the prompt itself (vLLM's recompute on a failed KV load).
        remote = pn.engine.release_kv(copy.pio, now)
        if remote:
            self._reschedule(pn)
        ns = self.nodes[self.copy_node[cid]]
        if ns.crashed:
            self.push(now + self.half_rtt + ns.delay, FAIL, cid, 0)
            return
        rid = owner.tag
        blocks = self.blocks[rid] if self.blocks is not None else ()
        prompt, output = self._sizes(rid, copy)
        ns.engine.submit(cid, prompt, output, now, blocks, self.bt, remote_kv=remote)
        self._reschedule(ns)

    def _watched(self, x: int, what: int, now: float) -> None:
        """Mid-stream migration's event: a review of node ``x``'s streams, a look at its
        next step, or whether moved copy ``x`` resumed first."""
        if what == REVIEW:
            self.watch.review(x, now)
        elif what == WATCH:
            self.watch.look(self.nodes[x], now)
        else:
            self.watch.resume(x, now)
        if self.limited:
            self._place_queued(now)

    def _tick(self, now: float, tick_s: float) -> None:
        """The balancer's periodic work: stream progress, detection, the queues."""
        if self.streaming:
            self.streaming.report(now, self.nodes, self.copy_node, self.half_rtt)
        if self.moving:
            nodes, ids = self.balancer.nodes, self.rec.node_ids
            self.watch.states(lambda ni: nodes[ids[ni]].state, now)
        # The engines' own counts, as the gateway scrapes them from /metrics (every
        # 0.5 s by default; here each tick): an engine queueing prompts with its KV
        # cache full marks its node's samples as the load's (Node.report_engine), and
        # its limiter counts the node congested. Without them the simulator's detector
        # took a healthy L4 thrashing under a 1.3x burst, its prompts silent for
        # seconds while decodes were preempted, for a stalling node and quarantined it.
        report = self.balancer.on_engine_metrics
        for ns, node_id in zip(self.nodes, self.rec.node_ids, strict=True):
            if not ns.crashed:  # a dead engine answers no scrape
                e = ns.engine
                report(node_id, now, e.num_running, e.num_waiting, e.kv_usage,
                       e.num_preemptions)
        events = self.balancer.tick(now)
        if events and self.gpu_telemetry:
            events = [self._with_gpu_cause(e) for e in events]
        self.rec.events.extend(events)
        if self.limited:
            self._place_queued(now)
        if self.outstanding > 0:
            self.push(now + tick_s, TICK)

    def _schedule_faults(self, horizon_s: float) -> None:
        for fi, f in enumerate(self.faults):
            self.push(f.at_s, FAULT, fi)
            if f.kind == "stall" and f.period_s is not None:
                end = f.at_s + (f.duration_s if f.duration_s is not None else horizon_s)
                t, k = f.at_s + f.period_s, 1
                while t < end and t < horizon_s:
                    self.push(t, FAULT, fi)
                    k += 1
                    t = f.at_s + k * f.period_s
            elif f.duration_s is not None:
                self.push(f.at_s + f.duration_s, FAULT, fi, 1)

    def _finish_record(self, now: float) -> RunRecord:
        rec = self.rec
        rec.end_time = now
        if self.moving:
            rec.gaps = self.watch.gaps(rec.node, rec.first, rec.end,
                                       [st == OK for st in rec.status], self.half_rtt)
        b = self.balancer
        rec.limits = {n.id: n.limiter.limit for n in b.nodes.values() if n.limiter is not None}
        if self.hedger is not None:
            rec.hedges, rec.hedge_wins = self.hedger.hedges, self.hedger.wins
        det = b.outliers
        if det is not None:
            rec.outliers = {"detected": det.detected_ejections, "enforced": det.enforced_ejections,
                            "time_in_states": det.time_in_states(now),
                            "stalls": {n.id: (n.stalls, n.stalled_s) for n in b.nodes.values()
                                       if n.stalls}}
        return rec

    def _reschedule(self, ns: SimNode) -> None:
        t = ns.engine.next_event_time()
        if t != ns.scheduled:
            ns.scheduled = t
            ns.version += 1
            if t < math.inf:
                heapq.heappush(self.heap, (t, next(self.seq), ENGINE, ns.index, ns.version))

    # -- exchange events -------------------------------------------------------------

    def _arrive(self, rid: int, now: float) -> None:
        rec = self.rec
        prefix: tuple[int, ...] = ()
        if self.blocks is not None:  # what a gateway hashes: the prompt's blocks
            prefix = self.blocks[rid][: rec.prompt[rid] // self.bt]
        session = str(self.sessions[rid]) if self.sessions is not None else None
        ex = self.exchange_type(self.balancer,
                                Request(self.model, rec.prompt[rid], None, self.prio[rid],
                                        prefix=prefix, session=session),
                                tag=rid)
        self.exchanges[rid] = ex
        self._do(ex, ex.arrive(now), now)
        if ex.ended is not None:  # refused or failed at once
            self._settle(ex, now)

    def _first(self, ex: Exchange, copy: Copy, now: float) -> None:
        # With prefix caching the count of cached prompt tokens comes at the end,
        # with the usage, as from vLLM: the prefill sample waits for it.
        actions = ex.first_chunk(copy, now, defer_prefill=self.blocks is not None)
        if actions:  # the race's losers
            self._do(ex, actions, now)
        if copy.state == COMMITTED and ex.committed is copy:
            if self.rec.first[ex.tag] < 0.0:
                self.rec.first[ex.tag] = now
            self.rec.node[ex.tag] = self.copy_node[copy.io]
            if self.judge_pieces:
                self.streaming.committed(ex, copy, now + self.piece_s)
            if self.moving:
                self.watch.committed(ex, copy, now)
        if self.limited:  # a shorter prompt backlog may have let a waiter go
            self._place_queued(now)

    def _finish(self, ex: Exchange, copy: Copy, now: float) -> None:
        if copy.state == ENDED:
            return
        rid = ex.tag
        cached: int | None = None
        if self.blocks is not None:
            cached = self.nodes[self.copy_node[copy.io]].engine.cached_tokens(copy.io)
            if ex.committed is copy or ex.committed is None:
                self.rec.cached[rid] = cached
        actions = ex.finished(copy, now, Outcome.OK, self._sizes(rid, copy)[1],
                              cached_tokens=cached)
        if actions:
            self._do(ex, actions, now)
        self._settle(ex, now)
        if ex.committed is copy:
            if self.rec.first[rid] < 0.0:  # a one-token answer: first token and finish together
                self.rec.first[rid] = now
            self.rec.node[rid] = self.copy_node[copy.io]
        if self.limited:
            self._place_queued(now)

    def _failed(self, ex: Exchange, copy: Copy, now: float, failure: Failure) -> None:
        # A stream's tokens so far (a crash's: read before it): the client has them.
        tokens = self.watch.crash_tokens.pop(copy.io, 0) if copy.state == COMMITTED else 0
        self._do(ex, ex.failed(copy, now, failure, tokens), now)
        if ex.ended is not None:
            self._settle(ex, now)
        if self.limited:
            self._place_queued(now)

    def _place_queued(self, now: float) -> None:
        """Late binding: the queue's decisions since the last call."""
        for ex, actions in pump(self.balancer, now):
            if actions and type(actions[0]) is Dispatch:
                self.rec.queue_s[ex.tag] = now - self.rec.arrival[ex.tag]
            self._do(ex, actions, now)
            if ex.ended is not None:
                self._settle(ex, now)

    def _with_gpu_cause(self, ev: Event) -> Event:
        """A slow node's event with what its GPUs' telemetry says (as the gateway's)."""
        if ev.state not in ("degraded", "quarantined"):
            return ev
        ns = self.nodes[self.by_id[ev.node]]
        kind, text = ns.gpu_cause()
        gpu = min(ns.ranks.items(), key=lambda kv: kv[1])[0] if ns.ranks else None
        return dataclasses.replace(ev, reason=f"{ev.reason}; {text}", cause=kind,
                                   advice=remedy(kind, gpu, ns.plan.perf.gpus))

    def _fault(self, fi: int, ending: bool, now: float) -> None:
        f = self.faults[fi]
        assert f.node is not None, "a scenario's fault names its node"
        ns = self.nodes[self.by_id[f.node]]
        if f.kind == "crash" and not ending and self.moving:
            self.watch.crashing(ns, now)
        apply_fault(f, ending, ns, now, self._crashed, self._deliver)
        self._reschedule(ns)
        if self.streaming:
            self._long_step(ns, now)
        if self.moving and self.watch.on[ns.index]:
            self.watch.look(ns, now)

    def _long_step(self, ns: SimNode, now: float) -> None:
        """Where the step under way on ``ns`` is long enough to stall its streams, a
        look at its end (as the gateway would see it) for the gap they resume from."""
        noted = self.streaming.long_step(ns, now)
        if noted is not None:
            self.push(noted[0] + self.half_rtt + ns.delay, QUIET, ns.index, noted[1])

    def _crashed(self, cid: int, t: float) -> None:
        copy = self.copies[cid]
        ex = self.copy_ex[cid]
        if copy is not None and ex is not None:
            if copy.pio == cid:
                self._prefill_event(ex, copy, FAIL, 0, t)
            else:
                self._failed(ex, copy, t, _CONNECT)

    def _deliver(self, t_ev: float, ev_kind: int, cid: int) -> None:
        """An engine event for the gateway, after the network delay back."""
        ns = self.nodes[self.copy_node[cid]]
        self.push(t_ev + self.half_rtt + ns.delay, _DELIVERY[ev_kind], cid, 2)

    # -- exchange actions ------------------------------------------------------------

    def _do(self, ex: Exchange, actions: tuple[Action, ...], now: float) -> None:
        for a in actions:  # usually none or one
            kind = type(a)
            if kind is Dispatch:
                assert isinstance(a, Dispatch)
                self._send(ex, a, now)
            elif kind is Cancel:
                assert isinstance(a, Cancel)
                for cid in (a.copy.io, a.copy.pio):
                    if cid is not None:
                        ns = self.nodes[self.copy_node[cid]]
                        if ns.engine.cancel(cid, now):
                            self._reschedule(ns)
            elif kind is Decode:
                assert isinstance(a, Decode)
                self._decode(ex, a.copy, now)
            elif kind is Migrate:
                assert isinstance(a, Migrate)
                rec = self.rec
                rec.moves[a.cause] = rec.moves.get(a.cause, 0) + 1
                rec.move_prefill_tokens += rec.prompt[ex.tag] + a.after
                assert ex.committed is not None  # the stream it moves
                self.watch.moving(ex, ex.committed, rec.first[ex.tag], now)
                self._send(ex, Dispatch(a.copy), now)
            elif kind is ArmTimer:
                assert isinstance(a, ArmTimer)
                self.push(a.at, TIMER, ex.tag)
            # Queue: the balancer holds it (its payload is the exchange) until _place_queued.

    def _settle(self, ex: Exchange, now: float) -> None:
        """Record the ending of an exchange that ended (once), and let go of it."""
        if ex.ended is not None:
            rid = ex.tag
            status = self.rec.status
            if status[rid] == UNFINISHED:
                status[rid] = _STATUS.get(ex.ended, FAILED_STATUS)
                self.rec.end[rid] = now
                self.outstanding -= 1
                self.exchanges[rid] = None
                if self.moving:
                    self.watch.ended(ex.copies)
                for c in ex.copies:
                    self.copies[c.io] = None
                    self.copy_ex[c.io] = None
                    if c.pio is not None:
                        self.copies[c.pio] = None
                        self.copy_ex[c.pio] = None

    def _send(self, ex: Exchange, a: Dispatch, now: float) -> None:
        copy = a.copy
        cid = len(self.copies)
        ni = self.by_id[copy.ticket.node.id]
        copy.io = cid
        self.copies.append(copy)
        self.copy_ex.append(ex)
        self.copy_node.append(ni)
        if not copy.hedge:
            self.rec.node[ex.tag] = ni
        if a.retry_of is not None:
            self.rec.retries += 1
        if copy.prefill_node is not None:  # its prompt first, on the prefill node
            cid = copy.pio = len(self.copies)
            ni = self.by_id[copy.prefill_node]
            self.copies.append(copy)
            self.copy_ex.append(ex)
            self.copy_node.append(ni)
        ns = self.nodes[ni]
        if ns.crashed:
            self.push(now + 2.0 * (self.half_rtt + ns.delay), FAIL, cid, 0)
        elif ns.error_rate > 0.0 and self.fault_rng.random() < ns.error_rate:
            self.push(now + 2.0 * (self.half_rtt + ns.delay), FAIL, cid, 1)
        else:
            heapq.heappush(self.heap, (now + self.half_rtt + ns.delay, next(self.seq), SUBMIT,
                                       cid, ni))
        after = ex.sent(copy, now)  # the hedge's clock, if any
        if after:
            self._do(ex, after, now)
