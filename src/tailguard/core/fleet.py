"""The fleet: node specs, their live statistics, and the read-only view policies see.

A :class:`Node` is what the decision core knows about one engine replica: its
hardware (and so its roofline prior), its live load as the gateway counts it
(dispatched, still prefilling, decoding), what the engine itself reports on
its ``/metrics`` (running, waiting, KV use), and the latency it has shown
lately. Both drivers update it only through :class:`tailguard.core.balancer.Balancer`.

Size (about 550 lines, over the ~400 guide): ``Node`` is the one object the
core's estimators share; its ``__init__`` (about 100 lines, over the ~80
guide) sets every slotted field with its meaning in one place, and splitting
it would hide which fields a node has.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from tailguard.core.estimate import CapacityEstimate, Ewma, PeakEwma
from tailguard.core.hardware import GPU, PerfModel
from tailguard.core.limits import Limiter
from tailguard.core.pipeline import Layout

# Node.decode_excess: decode samples of a node before its own speed counts, and how
# much slower than its class's it must be (a node's own estimate moves by about 4%
# with its sample noise; identical SKUs differ by ~8%, SC'22).
OWN_SAMPLES = 8
OWN_MARGIN = 1.2

# The time constant of a node's recent prompt-work rate (Node.duty): long
# enough to hold tens of prompts at a few requests a second, short enough to follow
# a burst or a peer's lost capacity spilling onto the node.
DUTY_TAU_S = 5.0

# A prompt is overdue (Node.overdue_s) once it has waited OVERDUE_FACTOR times its
# expected time to first token, at its class's learned prefill speed: a node
# whose prompts run late by less is slow, which the learner prices.
OVERDUE_FACTOR = 2.0
# How long a request cancelled past its due time (a hedge's loser) keeps its node
# overdue when nothing else there is waiting: then one request probes the node,
# which either answers (it is back) or is overdue itself within twice its
# expected TTFT. Without an end, a node left silent would never be sent another
# request, and never seen to recover (the outlier detector, not this, ejects).
OWED_S = 1.0
# A silence past a due prompt is a stall (Node.spans_stall) once it lasts this long
# (long enough that a piece of decode timed across it reads several times slow)
# and OVERDUE_FACTOR times the prompt's whole allowance (its due time less its
# dispatch): a node 3x slow answers a prompt at 3x its expected TTFT, 1.5x its
# allowance, so only one silent past 6x is taken for stalled. With the second
# bound left out, a llama.cpp server on a CPU at a third of its speed (its
# expected TTFTs near a second) had its slowest answers taken for stalls, and
# their decode left out of the evidence that would catch it.
STALL_S = 1.0


class Awaited(Protocol):
    """What a node's overdue check reads of a dispatched request (balancer.Ticket).

    ``due``: when its first token is overdue, inf while it waits for an engine
    slot (the node sets it once one frees: :meth:`Node.slot_freed`);
    ``allowance``: its due less the time its wait began.
    """

    due: float
    allowance: float

    @property
    def t_dispatch(self) -> float: ...
    @property
    def t_first(self) -> float: ...
    @property
    def released(self) -> bool: ...
    @property
    def presumed(self) -> bool: ...


class Outcome(enum.Enum):
    """How a request ended, tagged by where the failure came from."""

    OK = "ok"
    CONNECT_FAILURE = "connect_failure"
    TIMEOUT = "timeout"
    UPSTREAM_5XX = "upstream_5xx"
    UPSTREAM_429 = "upstream_429"
    CLIENT_CANCELLED = "client_cancelled"
    # The engine refused the request itself (a 4xx other than 429: bad
    # parameters, context too long): says nothing about the node's health or
    # speed, so nothing is learned from it.
    CLIENT_ERROR = "client_error"

    @property
    def is_node_failure(self) -> bool:
        """Failures that say something about the node (not the client)."""
        return self in (Outcome.CONNECT_FAILURE, Outcome.TIMEOUT, Outcome.UPSTREAM_5XX)


class NodeState(enum.Enum):
    HEALTHY = "healthy"
    DEGRADED = "degraded"  # still routed, with its weight scaled down
    QUARANTINED = "quarantined"  # no new requests; in-flight ones finish
    PROBATION = "probation"  # a small canary share, ramping up
    CORDONED = "cordoned"  # taken out by an operator
    DRAINING = "draining"  # being removed: no new requests
    DOWN = "down"  # failing the driver's active health checks: no new requests

    @property
    def routable(self) -> bool:
        return self in (NodeState.HEALTHY, NodeState.DEGRADED, NodeState.PROBATION)


# Static weights of the classic heterogeneous balancer (``seed_weighted``).
SEED_WEIGHTS: Mapping[str, float] = {"H100": 1.0, "A100": 0.8, "T4": 0.2}
SEED_DEFAULT_WEIGHT = 0.5


def seed_weight(gpu_name: str) -> float:
    """The baseline's weight by GPU class: H100 1.0, A100 0.8, T4 0.2, else 0.5."""
    upper = gpu_name.upper()
    for prefix, w in SEED_WEIGHTS.items():
        if upper.startswith(prefix) or f" {prefix}" in upper:
            return w
    return SEED_DEFAULT_WEIGHT


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """Static description of one engine replica (``tp`` GPUs serving together)."""

    id: str
    gpu: GPU | None  # None: a GPU the catalog does not know
    gpu_name: str
    tp: int = 1
    models: tuple[str, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    weight: float | None = None  # declared weight, overrides the GPU prior
    url: str | None = None
    max_num_seqs: int = 256
    # A pipeline-parallel replica's stages (core/pipeline.py); None: one stage,
    # ``tp`` GPUs of ``gpu``.
    layout: Layout | None = None

    @property
    def gpu_class(self) -> str:
        """What the node is compared with: its GPU, or its pipeline's layout."""
        if self.layout is not None:
            return self.layout.name
        return self.gpu.name if self.gpu else self.gpu_name


class NodeView(Protocol):
    """What a routing policy may read about a node. Never written by a policy."""

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
    def engine_waiting(self) -> int: ...
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


class Node:
    """Live state of one node. Mutated only by the balancer."""

    __slots__ = (
        "awaited",
        "capacity",
        "class_decode_slowdown",
        "class_prefill_slowdown",
        "debt_due",
        "debt_limit",
        "decode_excess",
        "decode_memo",
        "decoding",
        "dispatched_total",
        "duty",
        "duty_sq",
        "duty_t",
        "engine_kv_usage",
        "engine_metrics_at",
        "engine_running",
        "engine_waiting",
        "id",
        "in_flight",
        "latency",
        "limiter",
        "overdue_at",
        "owed_due",
        "owed_until",
        "own_backlog_base",
        "own_in_flight_base",
        "perf",
        "prefill_backlog",
        "prefill_tokens_total",
        "prefill_work_s",
        "prefilling",
        "presumed_cache_hits",
        "progress_t",
        "remote_backlog",
        "remote_in_flight",
        "remote_ratio",
        "remote_speed",
        "slots",
        "spec",
        "stall_from",
        "stall_to",
        "stalled_s",
        "stalls",
        "state",
        "tpot",
        "ttft",
        "weight_scale",
        "work_ends",
        "work_rate",
        "work_seq",
        "work_t",
    )

    def __init__(self, spec: NodeSpec, perf: PerfModel) -> None:
        self.spec = spec
        self.id = spec.id
        self.perf = perf
        self.state = NodeState.HEALTHY
        self.weight_scale = 1.0
        self.slots = spec.max_num_seqs
        self.in_flight = 0
        self.prefilling = 0
        self.prefill_backlog = 0
        self.decoding = 0
        # What the other gateway replicas have on this node, as they last
        # published it (core/shared.py); 0 with one gateway.
        self.remote_in_flight = 0
        self.remote_backlog = 0
        # Between two merges the others' counts are extrapolated from this
        # replica's own change since the last one, times remote_ratio (the
        # others' demand over this one's): replicas that route alike load a
        # node alike, so a rush of this replica's requests to a node is taken
        # for everyone's rush, not as if the others had stopped (0: no others).
        self.remote_ratio = 0.0
        self.own_in_flight_base = 0
        self.own_backlog_base = 0
        # The others' learned slowdowns, as (sum of decode log-ratio x weight,
        # decode weight, the same for prefill); None: no other replica knows.
        self.remote_speed: tuple[float, float, float, float] | None = None
        self.dispatched_total = 0
        self.prefill_tokens_total = 0  # prompt tokens ever dispatched here
        # What its prompts (their uncached part) add to its engine steps, at its
        # roofline speed (predict.prefill_extra_s): ever computed here (counted at
        # their first tokens), and the recent rate of it dispatched here. The rate,
        # ``duty``, is the share of the engine's time its prompts will take beside
        # its decodes (not capped: see predict.interleaved_tpot); ``duty_sq`` is
        # the same sum over the works' squares, which sets how much the work landing
        # in one answer's decode varies (policies/tailguard.py). Both are this
        # replica's (times 1 + remote_ratio for the fleet's), decayed over DUTY_TAU_S
        # at each tick: the rate given, not the rate computed, since a node stalled
        # or behind still has those prompts to compute beside its next decodes.
        # Prompt computation (roofline seconds of extra decode-step time), spread
        # over the time each prompt computes (work_at): accrued at work_rate from
        # its dispatch, at the rate that ends it by its predicted first token; the
        # rest credited at its first token. A decode judged in one-second pieces
        # then sees the prompt that slowed it while it ran, not in the piece after.
        self.prefill_work_s = 0.0  # accrued by work_t
        self.work_t = 0.0
        self.work_rate = 0.0
        self.work_ends: list[tuple[float, int, list[float]]] = []  # (end, seq, accrual)
        self.work_seq = 0
        # Balancer._decode_expected's last answer: (its inputs, (batch, step)).
        self.decode_memo: tuple[tuple[object, ...], tuple[int, float]] | None = None
        self.duty = 0.0
        self.duty_sq = 0.0
        self.duty_t = 0.0
        # What Node.overdue_s reads: the requests still waiting for their first
        # token, oldest first (those that moved on are dropped when they reach
        # the front); the earliest due time of one that left unanswered after it
        # (a hedge's loser, a client gone: the node owed it, and the debt stands
        # until it answers anything); the node's last first token or good finish.
        self.awaited: deque[Awaited] = deque()
        self.owed_due = math.inf
        self.owed_until = 0.0
        self.progress_t = 0.0
        # The last stall seen to end (Node.spans_stall): from when the node was
        # silent past a due prompt, to the answer that ended the silence.
        self.stall_from = self.stall_to = -math.inf
        self.stalls = 0  # stalls seen to end, and their silence in all (the detector's)
        self.stalled_s = 0.0
        # The earliest due of a prompt that left unanswered while others were in
        # flight, and the silence past it that makes a stall, until the next
        # answer: a stall whose waiting prompts were all hedged away is a stall.
        self.debt_due = math.inf
        self.debt_limit = STALL_S
        # The earliest time overdue_s can be above 0, as it last found (-inf: look
        # again; set so whenever the front of ``awaited`` may have changed), so a
        # policy calls it only when it can matter.
        self.overdue_at = -math.inf
        # First tokens too fast for the node's speed with no cached-token count
        # from the engine: taken for prefix-cache hits, not learnt from.
        self.presumed_cache_hits = 0
        # The GPU class's learned slowdowns (geometric mean over its nodes),
        # which is what the router uses; refreshed by Balancer.tick.
        self.class_decode_slowdown = 1.0
        self.class_prefill_slowdown = 1.0
        # The node's own learned decode slowdown over its class's where the node is
        # clearly the slower (by OWN_MARGIN, after OWN_SAMPLES samples), else 1.0:
        # what the router's TPOT check multiplies by. A card 1.4x slow for its class
        # is below what the detector flags; not where the two differ by noise, or
        # the check would move load from one of two identical cards to the other.
        self.decode_excess = 1.0
        self.capacity = CapacityEstimate()
        self.latency = PeakEwma(tau=10.0)
        self.ttft = Ewma(tau=10.0)
        self.tpot = Ewma(tau=10.0)
        self.engine_running = -1  # -1: not reported (yet)
        self.engine_waiting = -1
        self.engine_kv_usage = -1.0
        self.engine_metrics_at = -1.0
        # Concurrency limit when a pool of the node has limits (core/limits.py).
        self.limiter: Limiter | None = None

    @property
    def fleet_in_flight(self) -> int:
        """Requests on the node from every gateway replica: this one's exact count plus the
        others' (their last report, extrapolated by this one's change since)."""
        ratio = self.remote_ratio
        if ratio == 0.0:
            return self.in_flight
        est = self.remote_in_flight + ratio * (self.in_flight - self.own_in_flight_base)
        return self.in_flight + (int(est + 0.5) if est > 0.0 else 0)

    @property
    def fleet_backlog(self) -> int:
        """Prompt tokens waiting for their first token on the node, from every replica."""
        ratio = self.remote_ratio
        if ratio == 0.0:
            return self.prefill_backlog
        est = self.remote_backlog + ratio * (self.prefill_backlog - self.own_backlog_base)
        return self.prefill_backlog + (int(est) if est > 0.0 else 0)

    def work_at(self, now: float) -> float:
        """The prompt work computed by ``now`` (seconds, see ``prefill_work_s``)."""
        t = self.work_t
        if now == t:  # asked again at once (the streams of one tick): nothing new ends
            return self.prefill_work_s
        rate, base, ends = self.work_rate, self.prefill_work_s, self.work_ends
        if now > t or ends:
            while ends and ends[0][0] <= now:
                end, _, entry = heapq.heappop(ends)
                if entry[1]:
                    base += rate * max(0.0, end - t)
                    t = max(t, end)
                    rate -= entry[0]
                    entry[1] = 0.0
            if not ends:
                rate = 0.0
            base += rate * max(0.0, now - t)
            self.prefill_work_s, self.work_rate = base, rate
            self.work_t = max(t, now)
        return self.prefill_work_s

    def start_work(self, seconds: float, duration_s: float, now: float) -> list[float] | None:
        """A prompt of ``seconds`` of work dispatched, expected to compute over the next
        ``duration_s``; returns its accrual, for :meth:`end_work`."""
        self.work_at(now)
        if duration_s <= 0.0 or seconds <= 0.0:
            return None
        entry = [seconds / duration_s, 1.0, now + duration_s]  # rate, alive, end
        self.work_rate += entry[0]
        self.work_seq += 1
        heapq.heappush(self.work_ends, (now + duration_s, self.work_seq, entry))
        return entry

    def end_work(self, seconds: float, entry: list[float] | None, now: float,
                 computed: bool = True) -> None:
        """The prompt's computation ended by ``now``: what it had not accrued is
        credited (``computed``), or dropped (its request ended first)."""
        self.work_at(now)
        if entry is None:
            if computed:
                self.prefill_work_s += seconds
            return
        if not entry[1]:
            return  # accrued whole already
        entry[1] = 0.0
        self.work_rate -= entry[0]
        if computed:  # the rest of it: seconds minus what the rate gave so far
            self.prefill_work_s += entry[0] * max(0.0, entry[2] - now)

    def add_dispatched_work(self, seconds: float) -> None:
        """Prompt computation (roofline seconds) dispatched to the node."""
        self.duty += seconds / DUTY_TAU_S
        self.duty_sq += seconds * seconds / DUTY_TAU_S

    def withdraw_work(self, seconds: float) -> None:
        """A dispatched prompt that will not be computed (its request failed first)."""
        d = self.duty - seconds / DUTY_TAU_S
        self.duty = d if d > 0.0 else 0.0
        q = self.duty_sq - seconds * seconds / DUTY_TAU_S
        self.duty_sq = q if q > 0.0 else 0.0

    def decay_duty(self, now: float) -> None:
        """The prompt rates forget what was dispatched before ``now`` (each tick)."""
        dt = now - self.duty_t
        if dt > 0.0:
            w = math.exp(-dt / DUTY_TAU_S)
            self.duty *= w
            self.duty_sq *= w
            self.duty_t = now

    def overdue_s(self, now: float) -> float:
        """How long the node has been silent past its oldest waiting prompt's due
        time: 0 while it answers (a first token or a finish since that time) or
        nothing is overdue.

        A request cancelled past its due time (a hedge's loser) still counts
        until the node next answers, for at most OWED_S: otherwise every hedge
        would clear the evidence, and the router send the next request into the
        stall. A failed request says nothing here (the outlier detector counts
        failures).
        A stalled engine (a pause, a hung card, a stuck scheduler) shows here
        within a fraction of a second, long before its learned speed or the
        outlier detector moves: every request sent to it meanwhile waits out
        the rest of the stall, so the router adds this to its predicted TTFT.
        A node merely busy keeps producing first tokens and finishes; one
        merely slow is late by less than OVERDUE_FACTOR, which its learned
        speed prices. Only this replica's requests are seen.
        """
        q = self._trim()
        due = q[0].due if q else math.inf
        if self.owed_due < due:
            if now < self.owed_until:
                due = self.owed_due
            else:
                self.owed_due = math.inf  # expired: the next request probes the node
        since = due if due > self.progress_t else self.progress_t
        self.overdue_at = since
        return now - since if now > since else 0.0

    def spans_stall(self, since: float, now: float) -> bool:
        """Whether work timed from ``since`` to ``now`` overlaps a stall: a silence
        past a due prompt of STALL_S or more, the last one seen to end or one
        still going on.

        Such a sample times the stall, not the node's speed: a piece of decode
        across a 2 s pause reads 3x slow on a node as fast as its peers. The
        router already dodges a stall as it happens (:meth:`overdue_s`); the
        outlier detector, counting it again as slowness, weighted a node that
        paused 2 s in every 10 at a third of its worth. Overlap, not only
        spanning: a driver that reads a stream's tokens on a clock (the
        simulator's ticks) may end a piece inside the stall and begin the next
        there. A node that decodes on through a silence of its prompts alone
        (a stuck prefill) has those pieces left out too.
        """
        if since < self.stall_to and now > self.stall_from:
            return True
        # overdue_at is never later than the silence's start: most calls end here.
        if now - self.overdue_at < STALL_S:
            return False
        silent = self.overdue_s(now)
        return silent >= STALL_S and silent >= self._stall_limit()

    def _stall_limit(self) -> float:
        """How long a silence past the oldest waiting prompt's due time makes a stall
        (STALL_S): at least twice that prompt's allowance (its due less its dispatch)."""
        q = self.awaited
        if not q:  # a debt (Node.owed_due) alone: the absolute bound
            return STALL_S
        w = OVERDUE_FACTOR * q[0].allowance
        return w if w > STALL_S else STALL_S

    def _trim(self) -> deque[Awaited]:
        """Drop the requests at the front that are no longer waiting."""
        q = self.awaited
        while q and (q[0].t_first >= 0.0 or q[0].released or q[0].presumed):
            q.popleft()
        return q

    def awaits(self, req: Awaited) -> None:
        """A request dispatched here waits for its first token (Node.overdue_s)."""
        if not self.awaited:
            self.overdue_at = -math.inf
            if self.decoding <= 0 and self.prefilling <= 0:
                self.debt_due = math.inf  # idle since: it owed nothing meanwhile
        self.awaited.append(req)

    def slot_freed(self, now: float) -> None:
        """A request that held an engine slot ended: the oldest prompt waiting for
        one starts its wait for its first token now.

        A prompt sent to a node whose slots were all taken waits for a running
        answer to end, a wait the roofline does not price: due at its dispatch,
        a llama.cpp server with two slots at a third of its speed had its queued
        prompts late by seconds at every answer, each taken for a stall, and the
        decode that would have caught it left out of the evidence.
        """
        for req in self.awaited:
            if req.due == math.inf and req.t_first < 0.0 and not req.released \
                    and not req.presumed:
                req.due = now + req.allowance
                return

    def progressed(self, now: float) -> None:
        """A first token or a good finish: the node is answering (Node.overdue_s)."""
        q = self.awaited
        due, limit = self.debt_due, self.debt_limit
        if q and q[0].due <= due:  # the front may be the one answering now: its due counts
            due, limit = q[0].due, self._stall_limit()
        since = due if due > self.progress_t else self.progress_t
        if now - since >= STALL_S and now - since >= limit:
            self.stall_from, self.stall_to = since, now
            self.stalls += 1
            self.stalled_s += now - since
        self.debt_due = math.inf
        self.progress_t = now
        self.owed_due = math.inf
        self.overdue_at = -math.inf
        self._trim()  # bounded by what is in flight, whether or not a policy reads it

    def left_unanswered(self, due: float, now: float, allowance: float = 0.0) -> None:
        """A request was cancelled before its first token at ``now`` (``due``: its
        due time, ``allowance``: due less dispatch), or (``due`` inf) failed or was
        taken as prefilled without one."""
        if due < now and due < self.owed_due:
            self.owed_due = due
            self.owed_until = now + OWED_S
        if due < now and due < self.debt_due and (self.decoding > 0 or self.prefilling > 0):
            self.debt_due = due
            w = OVERDUE_FACTOR * allowance
            self.debt_limit = w if w > STALL_S else STALL_S
        self.overdue_at = -math.inf
        self._trim()

    def __repr__(self) -> str:
        return f"Node({self.id}, {self.spec.gpu_class}, in_flight={self.in_flight}, {self.state.value})"
