"""The discrete-event simulator: a fleet of engine models driven by the decision core.

One heap of events ordered by ``(time, sequence number)``: the sequence number
is the deterministic tie-break, so the same seed gives the same run, byte for
byte. Events are arrivals, submissions reaching an engine (after half the
network round trip), engine wake-ups (an engine reports the next moment it
needs attention; stale wake-ups are skipped by a version counter), deliveries
of first tokens and finishes back to the gateway, fault changes and the
balancer's periodic tick.

The gateway side is the real :class:`tailguard.core.balancer.Balancer`, the
same object the live gateway drives, and it is told only what a gateway would
see: prompt length at arrival, the first token, the finish with its outcome.
Like the gateway, the simulated gateway retries a request that failed before
its first token on another node (once), and never after.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tailguard.core.admission import AdmissionConfig, Shed
from tailguard.core.balancer import Balancer, Event, PoolConfig, Ticket
from tailguard.core.fleet import NodeSpec, Outcome
from tailguard.core.hedging import HedgeConfig
from tailguard.core.limits import LimitConfig
from tailguard.core.outliers import OutlierConfig
from tailguard.core.policies import Slo
from tailguard.engine import FAILED, FINISH, FIRST_TOKEN, Engine
from tailguard.sim.hedge import SimHedges
from tailguard.sim.scenario import Fault, NodePlan

# Event kinds, in the order they win a tie at the same instant... by sequence.
_ARRIVE, _SUBMIT, _ENGINE, _FIRST, _FINISH, _FAIL, _FAULT, _TICK = range(8)
_HEDGE = 8  # a hedge timer (tailguard.sim.hedge)
_HEDGE_ROUTED = frozenset((_SUBMIT, _FIRST, _FINISH, _FAIL))

# Request status codes in the result arrays.
OK, FAILED_STATUS, UNFINISHED, SHED = 0, 1, 2, 3

MAX_ATTEMPTS = 2  # the first try and one retry on another node

_DELIVERY = {FIRST_TOKEN: _FIRST, FINISH: _FINISH, FAILED: _FAIL}


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
    hedges: int = 0  # duplicates sent (tailguard.sim.hedge)
    hedge_wins: int = 0  # ... whose copy produced the first token first
    retries: int = 0
    end_time: float = 0.0
    # With limits/admission: seconds each request waited in the gateway queue,
    # its priority (0 high, 1 normal, 2 low) and each node's final limit.
    queue_s: list[float] = field(default_factory=list)
    priority: list[int] = field(default_factory=list)
    limits: dict[str, int] = field(default_factory=dict)


class _NodeSim:
    __slots__ = ("base_speed", "crashed", "delay", "engine", "error_rate", "index", "plan",
                 "scheduled", "version")

    def __init__(self, index: int, plan: NodePlan, step_by_step: bool) -> None:
        self.index = index
        self.plan = plan
        self.engine = Engine(plan.perf, plan.engine, speed=plan.speed, step_by_step=step_by_step)
        self.base_speed = plan.speed
        self.version = 0
        self.scheduled = math.inf
        self.crashed = False
        self.error_rate = 0.0
        self.delay = 0.0  # extra one-way network delay (slow_network fault)


def node_specs(plans: Sequence[NodePlan], model: str) -> list[NodeSpec]:
    return [
        NodeSpec(id=p.id, gpu=p.perf.gpu, gpu_name=p.perf.gpu.name, tp=p.perf.tp, models=(model,),
                 max_num_seqs=p.engine.max_num_seqs)
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
    policy_options: dict[str, object] | None = None,
    slo: Slo,
    seed: int,
    network_rtt_s: float = 0.0,
    faults: Sequence[Fault] = (),
    horizon_s: float = math.inf,
    tick_s: float = 1.0,
    step_by_step: bool = False,
    progress: Callable[[float], None] | None = None,
    outliers: OutlierConfig | None = None,
    hedging: HedgeConfig | None = None,
    limits: LimitConfig | None = None,
    admission: AdmissionConfig | None = None,
    priorities: Sequence[int] | None = None,
) -> RunRecord:
    """Simulate one policy on one fleet for one request list; return per-request outcomes."""
    n_req = len(arrivals)
    rng = random.Random(f"{seed}:{policy}:route")
    fault_rng = random.Random(f"{seed}:faults")
    balancer = Balancer(node_specs(plans, model),
                        [PoolConfig(model, policy, dict(policy_options or {}), slo,
                                    limits=limits, admission=admission)], rng,
                        # None (capacity probes, unit runs): no detection.
                        outliers=outliers or OutlierConfig(enabled=False))
    nodes = [_NodeSim(i, p, step_by_step) for i, p in enumerate(plans)]
    by_id = {p.id: i for i, p in enumerate(plans)}
    rec = RunRecord(
        arrival=list(arrivals), prompt=list(prompts), output=list(outputs),
        node=[-1] * n_req, first=[-1.0] * n_req, end=[-1.0] * n_req,
        status=[UNFINISHED] * n_req, node_ids=[p.id for p in plans],
    )
    tickets: list[Ticket | None] = [None] * n_req
    attempts = [0] * n_req
    limited = limits is not None or admission is not None
    prio = list(priorities) if priorities is not None else [1] * n_req
    if limited:
        rec.queue_s = [0.0] * n_req
        rec.priority = prio
    half_rtt = network_rtt_s / 2.0
    hedges: SimHedges | None = None  # set just before the loop when hedging is on

    heap: list[tuple[float, int, int, int, int]] = []
    push = heapq.heappush
    pop = heapq.heappop
    seq = 0

    for fi, f in enumerate(faults):
        push(heap, (f.at_s, seq, _FAULT, fi, 0))
        seq += 1
        if f.kind == "stall":
            end = f.at_s + (f.duration_s if f.duration_s is not None else horizon_s)
            t, k = f.at_s + f.period_s, 1
            while t < end and t < horizon_s:
                push(heap, (t, seq, _FAULT, fi, 0))
                seq += 1
                k += 1
                t = f.at_s + k * f.period_s
        elif f.duration_s is not None:
            push(heap, (f.at_s + f.duration_s, seq, _FAULT, fi, 1))
            seq += 1
    if n_req:
        push(heap, (arrivals[0], seq, _ARRIVE, 0, 0))
        seq += 1
    push(heap, (tick_s, seq, _TICK, 0, 0))
    seq += 1

    arrival_times = rec.arrival
    first = rec.first
    end_t = rec.end
    status = rec.status
    out_tokens = rec.output
    model_name = model
    outstanding = n_req
    next_progress = 0.0
    now = 0.0

    def reschedule(ns: _NodeSim) -> None:
        nonlocal seq
        t = ns.engine.next_event_time()
        if t != ns.scheduled:
            ns.scheduled = t
            ns.version += 1
            if t < math.inf:
                push(heap, (t, seq, _ENGINE, ns.index, ns.version))
                seq += 1

    def dispatch(rid: int, t: float) -> None:
        """Route request ``rid`` at time ``t`` (first try or retry)."""
        nonlocal seq, outstanding
        exclude: tuple[str, ...] = ()
        old = tickets[rid]
        if old is not None:
            exclude = (old.node.id,)
        attempts[rid] += 1
        if limited:
            got = balancer.admit(model_name, rec.prompt[rid], t, priority=prio[rid],
                                 exclude=exclude, payload=rid)
            if not isinstance(got, Ticket):
                if got is None:
                    status[rid] = FAILED_STATUS
                elif isinstance(got, Shed):
                    status[rid] = SHED
                else:
                    return  # queued: poll_queue places it when a permit frees
                end_t[rid] = t
                outstanding -= 1
                return
            send(rid, got, t)
            return
        ticket = balancer.pick(model_name, rec.prompt[rid], t, exclude=exclude)
        if ticket is None:
            status[rid] = FAILED_STATUS
            end_t[rid] = t
            outstanding -= 1
            return
        send(rid, ticket, t)

    def send(rid: int, ticket: Ticket, t: float) -> None:
        nonlocal seq
        if hedges is not None and attempts[rid] == 1:
            hedges.on_send(rid, ticket, t)
        tickets[rid] = ticket
        ni = by_id[ticket.node.id]
        rec.node[rid] = ni
        ns = nodes[ni]
        if ns.crashed:
            push(heap, (t + half_rtt * 2 + ns.delay * 2, seq, _FAIL, rid, 0))
            seq += 1
            return
        if ns.error_rate > 0.0 and fault_rng.random() < ns.error_rate:
            push(heap, (t + half_rtt * 2 + ns.delay * 2, seq, _FAIL, rid, 1))
            seq += 1
            return
        push(heap, (t + half_rtt + ns.delay, seq, _SUBMIT, rid, ni))
        seq += 1

    def place_queued(t: float) -> None:
        """Late binding: the queue's decisions since the last call."""
        nonlocal outstanding
        for waiter, decision in balancer.poll_queue(t):
            rid = waiter.payload
            if isinstance(decision, Shed):
                status[rid] = SHED
                end_t[rid] = t
                outstanding -= 1
            else:
                if attempts[rid] == 1:
                    rec.queue_s[rid] = t - arrival_times[rid]
                send(rid, decision, t)

    def deliver(t_ev: float, ev_kind: int, rid: int) -> None:
        """Queue an engine event for the gateway, after the network delay back."""
        nonlocal seq
        ns = nodes[rec.node[rid] if rid < n_req or hedges is None else hedges.delivery_node(rid)]
        push(heap, (t_ev + half_rtt + ns.delay, seq, _DELIVERY[ev_kind], rid, 2))
        seq += 1

    def fail(rid: int, t: float, outcome: Outcome) -> None:
        nonlocal outstanding
        ticket = tickets[rid]
        if ticket is None or ticket.released:
            return
        balancer.on_finish(ticket, t, outcome, 0)
        if first[rid] < 0.0 and attempts[rid] < MAX_ATTEMPTS:
            rec.retries += 1
            dispatch(rid, t)
            return
        status[rid] = FAILED_STATUS
        end_t[rid] = t
        outstanding -= 1

    def fail_and_place(rid: int, t: float, outcome: Outcome) -> None:
        fail(rid, t, outcome)
        place_queued(t)

    on_fail = fail_and_place if limited else fail

    if hedging is not None and hedging.enabled:
        def post(t: float, k: int, a: int, b: int) -> None:
            nonlocal seq
            push(heap, (t, seq, k, a, b))
            seq += 1

        hedges = SimHedges(hedging, n_req=n_req, balancer=balancer, model=model, rec=rec,
                           tickets=tickets, nodes=nodes, by_id=by_id, half_rtt=half_rtt,
                           fault_rng=fault_rng, post=post, reschedule=reschedule,
                           kinds=(_HEDGE, _SUBMIT, _FIRST, _FINISH, _FAIL),
                           status_unfinished=UNFINISHED)
        fault_fail = hedges.wrap_fail(on_fail)
    else:
        fault_fail = on_fail

    while heap:
        now, _, kind, a, b = pop(heap)
        if now > horizon_s:
            break
        if hedges is not None and kind in _HEDGE_ROUTED:
            a = hedges.route(kind, a, b, now)  # which copy of a hedged request, if any
            if a < 0:
                continue
        if kind == _ENGINE:
            ns = nodes[a]
            if b != ns.version:
                continue
            ns.scheduled = math.inf
            delay = half_rtt + ns.delay
            for t_ev, ev_kind, rid in ns.engine.advance(now):
                push(heap, (t_ev + delay, seq, _DELIVERY[ev_kind], rid, 2))
                seq += 1
            reschedule(ns)
        elif kind == _ARRIVE:
            if a + 1 < n_req:
                push(heap, (arrival_times[a + 1], seq, _ARRIVE, a + 1, 0))
                seq += 1
            dispatch(a, now)
            if progress is not None and now >= next_progress:
                progress(now)
                next_progress = now + 10.0
        elif kind == _SUBMIT:
            ns = nodes[b]
            if ns.crashed:
                fail(a, now + half_rtt + ns.delay, Outcome.CONNECT_FAILURE)
                continue
            ns.engine.submit(a, rec.prompt[a], out_tokens[a], now)
            reschedule(ns)
        elif kind == _FIRST:
            ticket = tickets[a]
            if ticket is not None and not ticket.released and first[a] < 0.0:
                first[a] = now
                balancer.on_first_token(ticket, now)
                if limited:  # a shorter prompt backlog may have let a waiter go
                    place_queued(now)
        elif kind == _FINISH:
            ticket = tickets[a]
            if ticket is not None and not ticket.released:
                if first[a] < 0.0:  # a one-token answer: first token and finish together
                    first[a] = now
                    balancer.on_first_token(ticket, now)
                balancer.on_finish(ticket, now, Outcome.OK, out_tokens[a])
                status[a] = OK
                end_t[a] = now
                outstanding -= 1
                if limited:
                    place_queued(now)
        elif kind == _FAIL:
            on_fail(a, now, Outcome.CONNECT_FAILURE if b == 0 else Outcome.UPSTREAM_5XX)
        elif kind == _FAULT:
            _apply_fault(faults[a], b == 1, nodes[by_id[faults[a].node]], now, fault_fail,
                         deliver)
            reschedule(nodes[by_id[faults[a].node]])
        elif kind == _HEDGE:
            if hedges is not None:
                hedges.fire(a, now)
        else:  # _TICK
            rec.events.extend(balancer.tick(now))
            if limited:
                place_queued(now)
            if outstanding > 0:
                push(heap, (now + tick_s, seq, _TICK, 0, 0))
                seq += 1
    rec.end_time = now
    rec.limits = {n.id: n.limiter.limit for n in balancer.nodes.values() if n.limiter is not None}
    if hedges is not None:
        rec.hedges, rec.hedge_wins = hedges.hedger.hedges, hedges.hedger.wins
    det = balancer.outliers
    if det is not None:
        rec.outliers = {"detected": det.detected_ejections, "enforced": det.enforced_ejections,
                        "time_in_states": det.time_in_states(now)}
    return rec


def _apply_fault(
    f: Fault, ending: bool, ns: _NodeSim, now: float,
    fail: Callable[[int, float, Outcome], None],
    deliver: Callable[[float, int, int], None],
) -> None:
    eng = ns.engine
    if f.kind == "throttle":
        eng.set_speed(ns.base_speed if ending else ns.base_speed * f.factor, now)
    elif f.kind == "stall":
        if not ending:
            eng.stall(f.pause_s, now)
    elif f.kind == "crash":
        if ending:
            ns.crashed = False
            eng.restart(now)
        else:
            ns.crashed = True
            # crash() first reports what had already happened, then one FAILED per request.
            for t_ev, kind, rid in eng.crash(now):
                if kind == FAILED:
                    fail(rid, t_ev, Outcome.CONNECT_FAILURE)
                else:
                    deliver(t_ev, kind, rid)
    elif f.kind == "error_rate":
        ns.error_rate = 0.0 if ending else f.rate
    elif f.kind == "slow_network":
        ns.delay = 0.0 if ending else f.delay_s
