"""One engine replica as the decision core knows it (:class:`Node`), and the
read-only view routing policies get of it (:class:`NodeView`).

A node is made of parts, each in its own module and the only writer of its
fields: its load (:mod:`.load`), the prompt work it computes (:mod:`.work`),
its silences and stalls (:mod:`.silence`), the other replicas' view
(:mod:`.peers`), its learned speed (:mod:`.speed`) and its lifecycle, whose
states move through one transition table (:mod:`.lifecycle`); the engine's
last report (:mod:`.engine_report`) is a frozen value swapped whole. The parts
are mixins over one slotted object rather than objects of their own because
the router reads a dozen of these fields per node for every request: one
attribute deep, not two. ``tests/core/test_fleet.py`` checks that no module
outside a part writes its fields.
"""

from __future__ import annotations

from typing import Protocol

from tailguard.core.estimate import CapacityEstimate, PeakEwma
from tailguard.core.fleet.engine_report import NOT_REPORTED, EngineReport
from tailguard.core.fleet.lifecycle import Lifecycle
from tailguard.core.fleet.load import KV_RECOVERY_S, KV_SHORT, Load
from tailguard.core.fleet.peers import PeerView
from tailguard.core.fleet.silence import Silence
from tailguard.core.fleet.spec import NodeSpec
from tailguard.core.fleet.speed import Speed
from tailguard.core.fleet.work import PromptWork
from tailguard.core.hardware import PerfModel
from tailguard.core.limits import Limiter


class NodeView(Protocol):
    """What a routing policy may read about a node. Never written by a policy.

    ``weight_scale`` is in (0, 1]; the nodes of one ``spec.gpu_class`` share their
    ``class_*_slowdown`` values (the router bounds a whole class by them).
    """

    @property
    def id(self) -> str: ...
    @property
    def spec(self) -> NodeSpec: ...
    @property
    def perf(self) -> PerfModel: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def prefilling(self) -> int: ...
    @property
    def prefill_backlog(self) -> int: ...
    @property
    def awaiting_kv(self) -> int: ...
    @property
    def fleet_in_flight(self) -> int: ...
    @property
    def fleet_backlog(self) -> int: ...
    @property
    def decoding(self) -> int: ...
    @property
    def slots(self) -> int: ...
    @property
    def weight_scale(self) -> float: ...
    @property
    def capacity(self) -> CapacityEstimate: ...
    @property
    def latency(self) -> PeakEwma: ...
    @property
    def engine(self) -> EngineReport: ...
    @property
    def class_decode_slowdown(self) -> float: ...
    @property
    def class_prefill_slowdown(self) -> float: ...
    @property
    def decode_excess(self) -> float: ...
    @property
    def duty(self) -> float: ...
    @property
    def duty_sq(self) -> float: ...
    @property
    def remote_ratio(self) -> float: ...
    @property
    def overdue_at(self) -> float: ...
    def overdue_s(self, now: float) -> float: ...


class Node(Lifecycle, Load, PromptWork, Silence, PeerView, Speed):
    """Live state of one node: its parts' fields, and what is its own (its spec and
    prior, its engine slots, its limiter, the engine's last report)."""

    __slots__ = ("engine", "id", "limiter", "perf", "slots", "spec",
                 *Lifecycle.FIELDS, *Load.FIELDS, *PromptWork.FIELDS, *Silence.FIELDS,
                 *PeerView.FIELDS, *Speed.FIELDS)

    def __init__(self, spec: NodeSpec, perf: PerfModel) -> None:
        self.spec = spec
        self.id = spec.id
        self.perf = perf
        self.slots = spec.max_num_seqs
        # Concurrency limit when a pool of the node has limits (core/limits.py).
        self.limiter: Limiter | None = None
        self.engine = NOT_REPORTED
        self._init_lifecycle()
        self._init_load()
        self._init_work()
        self._init_silence()
        self._init_peers()
        self._init_speed()

    def use_limiter(self, limiter: Limiter | None) -> None:
        """The node's concurrency limiter, from its pools' limits (or none)."""
        self.limiter = limiter

    def report_engine(self, report: EngineReport) -> None:
        """The engine's latest report (or NOT_REPORTED-like values when stale): it
        marks the node short of KV cache when it queues requests with its cache
        full, or has preempted one since its last report. A preempted request is
        computed again, prompt and answer so far, before it decodes on: what the
        node times until then is the preemption's, and a long context's
        recompute on a mid-range GPU outlasts ``KV_RECOVERY_S`` (benchmarks/
        README.md, "When a node is short of KV cache"), so the node is given
        the time its roofline takes to compute all the context it holds."""
        last, self.engine = self.engine, report
        if report.preemptions > last.preemptions >= 0:
            self.kv_short(report.at, max(KV_RECOVERY_S,
                                         self.perf.prefill_time(self.context_tokens)))
        elif report.waiting > 0 and report.kv_usage >= KV_SHORT:
            self.kv_short(report.at)

    def note_kv(self, now: float, answer_tokens: float, kv_tokens: int, scale: float) -> bool:
        """The gateway's own count of the KV its requests need (:meth:`Load.note_kv`),
        used only where the engine does not say when it preempts.

        The count takes every request sent to the node as holding its prompt and
        answer at once, which requests still queued behind a prompt backlog do
        not: an engine computes prompts a few thousand tokens a step and admits
        a waiting one only when its cache has room. In a burst of prompts the
        count said "short" while the engine's cache was mostly free, and the
        node went unjudged for the whole burst. An engine that reports its
        preemptions (vLLM, and the simulator's) marks itself, when it does
        (:meth:`report_engine`).
        """
        if self.engine.preemptions >= 0:
            return False
        return Load.note_kv(self, now, answer_tokens, kv_tokens, scale)

    def __repr__(self) -> str:
        return f"Node({self.id}, {self.spec.gpu_class}, in_flight={self.in_flight}, {self.state.value})"
