"""The simulated fleet's side: engines, the network to them, and the faults they suffer.

One :class:`SimNode` per node of the fleet: its engine model
(:class:`~tailguard.engine.Engine`), the extra one-way delay of a slow link,
and its fault state. :func:`apply_fault` starts or ends one scenario fault
on a node; what a fault does:

``throttle``      the engine runs at ``factor`` times its speed; with ``gpu_index``
                  one GPU of a TP or PP replica does: every step waits for the
                  slowest rank (of its stage, in a pipeline), whose GPU-side work
                  takes 1/factor longer while the host's overhead and the links'
                  transfers do not (PerfModel.slowed); throttles of the whole
                  replica multiply with it
``stall``         the engine pauses for ``seconds`` (repeated every ``period_s``
                  when given)
``crash``         every request held fails, new ones fail to connect, until it ends
``errors``        that share of requests is answered with a 5xx at once
``network``       ``delay_s`` more each way between the gateway and the node

:func:`health_check` is the gateway's active health probing, which takes a
crashed node out of rotation as the live gateway's monitor does.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from tailguard.config.faults import FaultSpec
from tailguard.core.balancer import Balancer
from tailguard.core.hardware import PerfModel
from tailguard.engine import FAILED, Engine
from tailguard.sim.scenario import NodePlan

# The gateway's active health checks: a probe every HEALTH_INTERVAL_S, judged by
# the core's probe rule (core/probes.py, the gateway's defaults).
HEALTH_INTERVAL_S = 2.0


class SimNode:
    """One simulated node: its engine, its link and its fault state."""

    __slots__ = ("base_speed", "crashed", "delay", "engine", "error_rate",
                 "index", "kv_rate", "plan", "ranks", "scheduled", "throttle", "version")

    def __init__(self, index: int, plan: NodePlan, step_by_step: bool) -> None:
        self.index = index
        self.plan = plan
        self.engine = Engine(plan.perf, plan.engine, speed=plan.speed, step_by_step=step_by_step)
        self.base_speed = plan.speed
        self.version = 0  # of the engine's wake-up: an older one on the heap is stale
        self.scheduled = math.inf
        self.crashed = False
        self.error_rate = 0.0
        self.delay = 0.0  # extra one-way network delay (network fault)
        self.kv_rate = 1.0  # its KV path's share of its link's rate (kv_link fault)
        self.throttle = 1.0  # the whole replica's throttle factor
        self.ranks: dict[int, float] = {}  # GPU index -> its throttle factor

    @property
    def speed(self) -> float:
        """The replica's speed factor on whole steps: its card's spread times its
        own throttle (a throttled rank changes its step model instead: ``perf``)."""
        return self.base_speed * self.throttle

    @property
    def perf(self) -> PerfModel:
        """Its step model, with its throttled GPUs slowed."""
        return self.plan.perf.slowed(self.ranks) if self.ranks else self.plan.perf

    def gpu_cause(self) -> tuple[str, str]:
        """What simulated GPU telemetry (DCGM) would say: (cause kind, text)."""
        tp = self.plan.perf.gpus
        if self.ranks:
            k, f = min(self.ranks.items(), key=lambda kv: kv[1])
            of = f" of {tp}" if tp > 1 else ""
            return "gpu_throttle", f"GPU {k}{of}: throttled to {f:.0%} of its clock (simulated)"
        if self.throttle < 1.0:
            return "gpu_throttle", (f"{'all ' if tp > 1 else ''}{tp} GPU{'s' if tp > 1 else ''}: "
                                    f"throttled to {self.throttle:.0%} of their clock (simulated)")
        return "gpus_healthy", (f"{'all ' if tp > 1 else ''}{tp} GPU{'s' if tp > 1 else ''} "
                                "healthy (simulated DCGM): the engine, host or network then")


def health_check(nodes: list[SimNode], balancer: Balancer, now: float) -> None:
    """One round of the gateway's health probes: only a crashed node fails its probe
    (a hung or slow engine still answers ``/health`` in the engine model)."""
    for ns in nodes:
        balancer.on_probe(ns.plan.id, not ns.crashed, now)


# (engine request id, time) of a request that failed in the crash, and
# (time, engine event kind, engine request id) of one that had already progressed.
Failed = Callable[[int, float], None]
Deliver = Callable[[float, int, int], None]


def apply_fault(f: FaultSpec, ending: bool, ns: SimNode, now: float, failed: Failed,
                deliver: Deliver) -> None:
    """Start (or, ``ending``, end) fault ``f`` on node ``ns`` at ``now``."""
    eng = ns.engine
    if f.kind == "throttle":
        if f.gpu_index is None:
            ns.throttle = 1.0 if ending else f.factor
            eng.set_speed(ns.speed, now)
            return
        if ending:
            ns.ranks.pop(f.gpu_index, None)
        else:
            ns.ranks[f.gpu_index] = f.factor
        eng.set_perf(ns.perf, now)
    elif f.kind == "stall":
        if not ending:
            eng.stall(f.seconds, now)
    elif f.kind == "crash":
        if ending:
            ns.crashed = False
            eng.restart(now)
        else:
            ns.crashed = True
            # crash() first reports what had already happened, then one FAILED per request.
            for t_ev, kind, eid in eng.crash(now):
                if kind == FAILED:
                    failed(eid, t_ev)
                else:
                    deliver(t_ev, kind, eid)
    elif f.kind == "errors":
        ns.error_rate = 0.0 if ending else f.rate
    elif f.kind == "kv_link":
        ns.kv_rate = 1.0 if ending else f.factor
    elif f.kind == "network":
        ns.delay = 0.0 if ending else f.delay_s
