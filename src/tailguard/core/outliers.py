"""Straggler and failure detection, and the quarantine lifecycle of a node.

A *straggler* is a node slow **for its own hardware**: a T4 running at T4
speed is healthy (the router already prices it by its roofline prior and its
class's learned speed); an A100 running at 40% of what its peers deliver is
not. The detector never compares a node with the fleet's fastest node.

Signal
------
Every first token and every successful finish gives the balancer one latency
sample and what the roofline model expected for it *at the batch and backlog
it met* (:mod:`tailguard.core.predict`). The detector keeps, per node and per
interval (``interval_s``, default 5 s), the mean of ``log(observed/expected)``
separately for prefill (TTFT) and decode (TPOT): O(1) per request. At the end
of an interval each node's value ``x`` is calibrated:

* against the **median of its GPU class** when at least ``min_peers`` (3)
  nodes of the class have samples in the interval: the roofline's systematic
  error (chunked-prefill interference, engine overheads) cancels, because
  identical cards at similar load share it;
* else against the node's **own healthy history** (an EWMA over the
  intervals it spent healthy and unflagged; no verdict before
  ``history_intervals`` of it).

The calibrated slowness is ``s = exp(x - reference)``. Within a class the
spread is judged robustly with the modified z-score of Iglewicz and Hoaglin
(1993), ``M = 0.6745 (x - median) / MAD``; a node is *flagged* for the interval
when ``M > z_threshold`` (3.5) or when ``s > slow_ratio`` (1.5) whatever its
peers do. The MAD is floored at ``mad_floor`` (0.05 in log space, about 5%):
identical SKUs differ by ~8% on average (SC'22, "Not All GPUs Are Created
Equal"), and with a near-zero MAD a 10% card would score as an outlier.

Worked example: four A100s with decode log-ratios 0.47, 0.50, 0.52, 1.42 (the
last throttled to 40%: 2.5x slower). Median 0.51; absolute deviations 0.04,
0.01, 0.01, 0.91, MAD 0.025, floored to 0.05; the throttled node scores
``0.6745 * 0.91 / 0.05 = 12.3 > 3.5`` and its slowness is ``exp(0.91) = 2.5x``;
the node at 0.47 scores -0.5. With speeds spread +-10% the largest deviation is
``log(1.1/0.9) = 0.2``, ``M = 2.7``: not flagged.

Failures (Envoy outlier detection): ``consecutive_failures`` (5) node failures
in a row (connect failure, timeout, 5xx; a 429 or a client's own error says
nothing about the node), a ``failure_ratio`` (0.25) of at least
``failure_min_requests`` (20) requests over the last ``failure_window``
intervals (6: 30 s; Envoy's failure-percentage check, with a threshold low
enough to catch a node failing a third of its requests, and a window long
enough that a node failing 5% does not reach it by chance), or a **hang**: requests
waiting for their first token and no first token nor finish on the node for
``hang_s`` (120 s: the gateway sees no first token of a non-streamed answer,
so a lone long non-streamed generation must not look like a hang).

Lifecycle
---------
::

    healthy --K flagged intervals--> degraded --still >= quarantine_ratio--> quarantined
       ^  \\--failures/hang----------------------------------------------^   |
       |           (recover_intervals clean)                               backoff
       +------------- probation (canary weight, slow-start ramp) <---------+
                          \\--flagged or failing--> quarantined (n+1)

* **degraded**: still routed, ``weight_scale = 1/s`` (the policy divides its
  cost by it, so the node is priced at the speed it really has), refreshed
  every interval; ``recover_intervals`` clean intervals make it healthy (an
  interval without samples multiplies its weight by ``regain_factor``, so
  the router tries it again and it is healthy once the weight is back to 1). A
  slow node still delivers capacity the pool may need: taking a card at 40%
  out of a busy fleet makes every other node's queue longer (measured: P99
  TTFT 16x the no-fault run instead of 1.1x), so only a node at least
  ``quarantine_ratio`` (3x) slow for K more intervals, in decode *and*
  prefill, is quarantined.
* **quarantined**: no new requests (in-flight ones finish); after a backoff of
  ``base_ejection_s * 2^(n-1)`` capped at ``max_ejection_s``, times
  ``1 +- jitter`` from the injected rng (Envoy multiplies linearly; the issue
  asks for exponential), it goes on probation.
* **probation**: ``weight_scale`` ramps from ``canary_weight`` to 1 over
  ``slow_start_s`` (Envoy's slow start), and the balancer sends the node
  ``canary_share`` (2%) of the pool's requests whatever the policy prefers,
  so that probation has samples to judge; a failure trigger or a flagged
  interval at ``quarantine_ratio`` sends it back, ``n + 1`` (a milder flag
  degrades it); ``slow_start_s`` without either makes it healthy.

The **ejection cap** (Envoy's ``max_ejection_percent``, here by capacity):
quarantining a node must not take more than ``max_ejection_share`` (34%) of
any of its pools' nominal decode capacity out of rotation; past it the node
is degraded instead, and the detection is counted as *detected* but not
*enforced*. Nodes an operator cordoned, drained, or the health checks marked
down are left alone.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from random import Random
from typing import Protocol

from tailguard.core.events import Event
from tailguard.core.fleet import Node, NodeState, Outcome

_MAD_SCALE = 0.6745  # Iglewicz-Hoaglin: MAD -> sigma for a normal sample
_CLAMP = 3.0  # one sample's log-ratio is clamped: a single 100x hiccup is one sample


@dataclass(frozen=True, slots=True)
class OutlierConfig:
    """Detection thresholds and lifecycle timings (defaults from the issue and Envoy)."""

    enabled: bool = True
    interval_s: float = 5.0
    consecutive_intervals: int = 2  # K: flagged intervals in a row before acting
    z_threshold: float = 3.5
    slow_ratio: float = 1.5  # absolute bound on calibrated slowness
    # Slow but working nodes are degraded (priced at their measured speed);
    # only this slow are they worth nothing to the pool and quarantined.
    quarantine_ratio: float = 3.0
    mad_floor: float = 0.05  # in log space: the card-to-card spread must not trigger
    min_peers: int = 3
    min_samples: int = 3  # per kind and interval
    history_intervals: int = 3  # own-history calibration needs this many
    history_alpha: float = 0.2
    recover_intervals: int = 3  # clean intervals before a degraded node is healthy
    # A degraded node the router stops using gives no samples to clear it: it
    # regains weight by this factor per interval without samples, healthy at 1.
    regain_factor: float = 1.25
    consecutive_failures: int = 5
    failure_ratio: float = 0.25
    failure_min_requests: int = 20
    failure_window: int = 6  # intervals
    # A non-streamed answer gives the core no first token, only its finish:
    # hang_s must exceed the longest such generation a node may run alone.
    hang_s: float = 120.0
    base_ejection_s: float = 30.0
    max_ejection_s: float = 300.0
    jitter: float = 0.1
    canary_weight: float = 0.1
    # Share of a pool's requests sent to each node on probation whatever the
    # policy says: a policy that prices the canary weight strictly would send it
    # nothing at light load, and probation would then test nothing.
    canary_share: float = 0.02
    slow_start_s: float = 30.0
    max_ejection_share: float = 0.34
    min_weight: float = 0.05


class PoolView(Protocol):
    """What the detector needs of a pool: its nodes, and a cache to drop."""

    @property
    def nodes(self) -> list[Node]: ...

    def invalidate(self) -> None: ...


class _Kind:
    """One interval's samples of one kind (prefill or decode) on one node.

    ``own_n``/``own_total`` count this driver's own samples since it started,
    never reset: what a gateway replica publishes for the others to pool
    (core/shared.py); :meth:`absorb` adds theirs to the interval only.
    """

    __slots__ = ("n", "own_n", "own_total", "total")

    def __init__(self) -> None:
        self.n = 0
        self.total = 0.0
        self.own_n = 0
        self.own_total = 0.0

    def add(self, observed: float, expected: float) -> None:
        if observed <= 0.0 or expected <= 0.0:
            return
        x = math.log(observed / expected)
        x = _CLAMP if x > _CLAMP else (-_CLAMP if x < -_CLAMP else x)
        self.total += x
        self.n += 1
        self.own_total += x
        self.own_n += 1

    def absorb(self, n: int, total: float) -> None:
        self.n += n
        self.total += total

    def mean(self, min_samples: int) -> float | None:
        return self.total / self.n if self.n >= min_samples else None

    def reset(self) -> None:
        self.n = 0
        self.total = 0.0


class NodeHealth:
    """The detector's record of one node."""

    __slots__ = (
        "busy_since",
        "clean_streak",
        "consecutive_failures",
        "decode",
        "eject_until",
        "ejections",
        "failures",
        "flagged_streak",
        "history",
        "known_state",
        "last_progress",
        "own_failures",
        "own_requests",
        "prefill",
        "probation_since",
        "reason",
        "requests",
        "slowness",
        "state_seconds",
        "state_since",
        "window",
    )

    def __init__(self, now: float) -> None:
        self.prefill = _Kind()
        self.decode = _Kind()
        self.requests = 0
        self.failures = 0
        self.own_requests = 0  # this driver's own, never reset (see _Kind)
        self.own_failures = 0
        self.reason = ""  # why the node is in its state (the last transition's reason)
        # (requests, failures) of the last failure_window intervals, current excluded.
        self.window: deque[tuple[int, int]] = deque()
        self.consecutive_failures = 0
        self.flagged_streak = 0
        self.clean_streak = 0
        # Own-history references [prefill, decode]: (EWMA of x, intervals seen).
        self.history: list[tuple[float, int]] = [(0.0, 0), (0.0, 0)]
        self.slowness = 1.0
        self.ejections = 0
        self.eject_until = math.inf
        self.probation_since = 0.0
        self.last_progress = now
        self.busy_since = -1.0
        self.known_state = NodeState.HEALTHY
        self.state_since = now
        self.state_seconds: dict[str, float] = {}


@dataclass(frozen=True, slots=True)
class Verdict:
    """One node's calibrated slowness for an interval, and whether it is flagged."""

    slowness: float  # the larger of the prefill and decode slowness
    flagged: bool
    why: str
    # The smaller of the two: what both kinds agree on. TTFT carries the queue a
    # node built before it was caught, so quarantine waits for decode too.
    floor: float = 0.0


class OutlierDetector:
    """Consumes per-request samples and outcomes; ``tick`` moves nodes through the lifecycle."""

    def __init__(self, config: OutlierConfig | None = None) -> None:
        self.config = config or OutlierConfig()
        self.health: dict[str, NodeHealth] = {}
        self.detected_ejections = 0
        self.enforced_ejections = 0
        self._next_eval = -1.0
        self._nominal: dict[str, float] = {}
        self.on_probation = 0  # nodes on probation now: the request path checks it first
        # False on a gateway replica that follows another's decisions
        # (core/shared.py): it keeps pooling samples and learning each node's
        # history, so it can take over, but changes no state itself.
        self.authority = True

    # -- per-request bookkeeping (O(1)) ----------------------------------------

    def _rec(self, node: Node, now: float) -> NodeHealth:
        h = self.health.get(node.id)
        if h is None:
            h = self.health[node.id] = NodeHealth(now)
            h.known_state = node.state
        return h

    # Records are created by tick (every node, every tick): the request path
    # only looks them up, and drops the samples of a node not yet ticked.

    def on_progress(self, node: Node, now: float) -> None:
        """The node produced a first token (its sample may come later)."""
        h = self.health.get(node.id)
        if h is not None:
            h.last_progress = now

    def on_prefill(self, node: Node, ttft: float, expected: float, now: float) -> None:
        h = self.health.get(node.id)
        if h is not None:
            h.last_progress = now
            h.prefill.add(ttft, expected)

    def on_decode(self, node: Node, tpot: float, expected: float) -> None:
        h = self.health.get(node.id)
        if h is not None:
            h.decode.add(tpot, expected)

    def on_outcome(self, node: Node, outcome: Outcome, now: float) -> None:
        h = self.health.get(node.id)
        if h is None:
            return
        h.last_progress = now
        if outcome is Outcome.OK:
            h.requests += 1
            h.own_requests += 1
            h.consecutive_failures = 0
        elif outcome.is_node_failure:
            h.requests += 1
            h.failures += 1
            h.own_requests += 1
            h.own_failures += 1
            h.consecutive_failures += 1

    def absorb(self, node_id: str, prefill: tuple[int, float], decode: tuple[int, float],
               requests: int, failures: int, tail_failures: int) -> None:
        """Samples and outcomes another gateway replica saw on the node since it last said.

        They join the current interval as if seen here (so detection pools
        every replica's samples); ``tail_failures`` is the replica's run of
        node failures since its last success on the node, which continues
        this one's run when every outcome it reports is a failure.
        """
        h = self.health.get(node_id)
        if h is None:
            return
        h.prefill.absorb(*prefill)
        h.decode.absorb(*decode)
        h.requests += requests
        h.failures += failures
        if failures:
            if requests > failures:  # a success among them: the run is the replica's
                h.consecutive_failures = max(h.consecutive_failures, tail_failures)
            else:
                h.consecutive_failures += failures

    def forget(self, node_id: str) -> None:
        h = self.health.pop(node_id, None)
        if h is not None and h.known_state is NodeState.PROBATION:
            self.on_probation -= 1
        self._nominal.pop(node_id, None)

    # -- periodic work -----------------------------------------------------------

    def tick(self, now: float, nodes: Mapping[str, Node], pools: Iterable[PoolView],
             rng: Random) -> list[Event]:
        cfg = self.config
        events: list[Event] = []
        pool_list = list(pools)
        if not self.authority:
            self._follow(now, nodes)
            return events
        for node in nodes.values():
            h = self._rec(node, now)
            self._observe_state(node, h, now)
            if node.state is NodeState.QUARANTINED and now >= h.eject_until:
                self._to_probation(node, h, now, pool_list, events)
            elif node.state is NodeState.PROBATION:
                ramp = min(1.0, (now - h.probation_since) / max(cfg.slow_start_s, 1e-9))
                node.weight_scale = cfg.canary_weight + (1.0 - cfg.canary_weight) * ramp
                if ramp >= 1.0:
                    self._set(node, h, NodeState.HEALTHY, now, pool_list, events,
                              "probation passed")
            if node.state.routable:
                reason = self._failure_reason(node, h, now)
                if reason is not None:
                    self._eject(node, h, now, pool_list, rng, events, reason)
        if now >= self._next_eval:
            if self._next_eval >= 0.0:
                self._evaluate(now, nodes, pool_list, rng, events)
            self._next_eval = now + cfg.interval_s
        return events

    def _follow(self, now: float, nodes: Mapping[str, Node]) -> None:
        """A follower's tick: intervals close and histories learn; states are the leader's."""
        for node in nodes.values():
            self._observe_state(node, self._rec(node, now), now)
        if now < self._next_eval:
            return
        if self._next_eval >= 0.0:
            verdicts = self.verdicts(nodes)
            for node in nodes.values():
                h = self.health[node.id]
                v = verdicts.get(node.id)
                self._push_window(h)
                if v is not None:
                    h.slowness = v.slowness
                self._close_interval(node, h, v)
        self._next_eval = now + self.config.interval_s

    def adopt(self, node: Node, state: NodeState, weight_scale: float, ejections: int,
              eject_in_s: float, reason: str, now: float, pools: Iterable[PoolView],
              events: list[Event]) -> None:
        """The leading replica's decision about ``node``: taken as this detector's own.

        A follower that later leads (its leader gone) carries on from it:
        the quarantine ends when the leader's would, and a node ejected
        again backs off from the leader's count.
        """
        h = self._rec(node, now)
        self._observe_state(node, h, now)
        h.ejections = ejections
        h.eject_until = now + eject_in_s if state is NodeState.QUARANTINED else math.inf
        node.weight_scale = weight_scale
        if state is not node.state:
            if state is NodeState.PROBATION:
                h.probation_since = now
            self._set(node, h, state, now, list(pools), events, reason)
            node.weight_scale = weight_scale

    def decision(self, node_id: str, now: float) -> tuple[int, float, str] | None:
        """What a leader publishes of a node's lifecycle: ejections, seconds left, reason."""
        h = self.health.get(node_id)
        if h is None:
            return None
        left = h.eject_until - now if h.eject_until != math.inf else 0.0
        return h.ejections, max(0.0, left), h.reason

    def _observe_state(self, node: Node, h: NodeHealth, now: float) -> None:
        """Account time per state, and notice changes made outside the detector."""
        if node.state is not h.known_state:
            self._account(h, now)
            if h.known_state is NodeState.PROBATION:
                self.on_probation -= 1
            if node.state is NodeState.PROBATION:
                self.on_probation += 1
                h.probation_since = now
            if node.state is NodeState.HEALTHY:
                # An operator (uncordon/resume) or the health checks put it back.
                node.weight_scale = 1.0
                h.flagged_streak = 0
                h.consecutive_failures = 0
            h.known_state = node.state

    @staticmethod
    def _account(h: NodeHealth, now: float) -> None:
        key = h.known_state.value
        h.state_seconds[key] = h.state_seconds.get(key, 0.0) + (now - h.state_since)
        h.state_since = now

    def _failure_reason(self, node: Node, h: NodeHealth, now: float) -> str | None:
        cfg = self.config
        if h.consecutive_failures >= cfg.consecutive_failures:
            return f"{h.consecutive_failures} consecutive failures"
        if node.prefilling > 0:
            if h.busy_since < 0.0:
                h.busy_since = now
            waited = now - max(h.busy_since, h.last_progress)
            if waited > cfg.hang_s:
                return f"hang: {node.prefilling} requests, no token for {waited:.0f} s"
        else:
            h.busy_since = -1.0
        return None

    # -- interval evaluation -----------------------------------------------------

    def verdicts(self, nodes: Mapping[str, Node]) -> dict[str, Verdict]:
        """Calibrated slowness of every node with samples in the current interval."""
        cfg = self.config
        by_class: dict[str, list[tuple[Node, NodeHealth]]] = {}
        for node in nodes.values():
            h = self.health.get(node.id)
            if h is not None:
                by_class.setdefault(node.spec.gpu_class, []).append((node, h))
        out: dict[str, Verdict] = {}
        for members in by_class.values():
            for k in (0, 1):
                name = "prefill" if k == 0 else "decode"
                xs: list[tuple[Node, NodeHealth, float]] = []
                for node, h in members:
                    x = (h.prefill if k == 0 else h.decode).mean(cfg.min_samples)
                    if x is not None:
                        xs.append((node, h, x))
                peers = len(xs) >= cfg.min_peers
                med = mad = 0.0
                if peers:
                    med = _median([x for _, _, x in xs])
                    mad = max(_median([abs(x - med) for _, _, x in xs]), cfg.mad_floor)
                for node, h, x in xs:
                    if peers:
                        ref, how = med, "class median"
                        z = _MAD_SCALE * (x - med) / mad
                    else:
                        hist, seen = h.history[k]
                        if seen < cfg.history_intervals:
                            continue
                        ref, how, z = hist, "own history", 0.0
                    s = math.exp(x - ref)
                    flagged = z > cfg.z_threshold or s > cfg.slow_ratio
                    why = f"{name} {s:.2f}x {how}" + (f" (z {z:.1f})" if peers else "")
                    prev = out.get(node.id)
                    if prev is None:
                        out[node.id] = Verdict(s, flagged, why, s)
                    else:
                        floor = min(s, prev.floor)
                        if (flagged, s) > (prev.flagged, prev.slowness):
                            out[node.id] = Verdict(s, flagged, why, floor)
                        else:
                            out[node.id] = Verdict(prev.slowness, prev.flagged, prev.why, floor)
        return out

    def _evaluate(self, now: float, nodes: Mapping[str, Node], pools: list[PoolView],
                  rng: Random, events: list[Event]) -> None:
        cfg = self.config
        verdicts = self.verdicts(nodes)
        for node in nodes.values():
            h = self.health[node.id]
            v = verdicts.get(node.id)
            state = node.state
            requests, failures = self._push_window(h)
            if (state.routable and requests >= cfg.failure_min_requests
                    and failures >= cfg.failure_ratio * requests):
                h.window.clear()
                self._eject(node, h, now, pools, rng, events,
                            f"{failures} of {requests} requests failed")
            elif v is not None and state.routable:
                self._judge(node, h, v, now, pools, rng, events)
            elif state is NodeState.DEGRADED and not (h.prefill.n or h.decode.n):
                node.weight_scale = min(1.0, node.weight_scale * cfg.regain_factor)
                if node.weight_scale >= 1.0:
                    self._set(node, h, NodeState.HEALTHY, now, pools, events,
                              "recovered: weight regained without samples")
            self._close_interval(node, h, v)

    def _push_window(self, h: NodeHealth) -> tuple[int, int]:
        """The interval's outcomes into the failure window; the window's totals."""
        h.window.append((h.requests, h.failures))
        if len(h.window) > self.config.failure_window:
            h.window.popleft()
        return sum(r for r, _ in h.window), sum(f for _, f in h.window)

    def _close_interval(self, node: Node, h: NodeHealth, v: Verdict | None) -> None:
        """Learn the node's history from the interval, then start the next one."""
        self._learn_history(node, h, v)
        h.prefill.reset()
        h.decode.reset()
        h.requests = h.failures = 0

    def _judge(self, node: Node, h: NodeHealth, v: Verdict, now: float, pools: list[PoolView],
               rng: Random, events: list[Event]) -> None:
        cfg = self.config
        h.slowness = v.slowness
        if not v.flagged:
            h.flagged_streak = 0
            h.clean_streak += 1
            if node.state is NodeState.DEGRADED:
                if h.clean_streak >= cfg.recover_intervals:
                    self._set(node, h, NodeState.HEALTHY, now, pools, events,
                              f"recovered: {v.why}")
                else:
                    node.weight_scale = max(cfg.min_weight, min(1.0, 1.0 / v.slowness))
            return
        h.clean_streak = 0
        h.flagged_streak += 1
        if node.state is NodeState.PROBATION:
            if v.floor >= cfg.quarantine_ratio:
                self._eject(node, h, now, pools, rng, events, f"slow on probation: {v.why}")
            else:
                node.weight_scale = max(cfg.min_weight, 1.0 / v.slowness)
                self._set(node, h, NodeState.DEGRADED, now, pools, events,
                          f"slow on probation: {v.why}")
        elif node.state is NodeState.DEGRADED:
            node.weight_scale = max(cfg.min_weight, 1.0 / v.slowness)
            if (h.flagged_streak > cfg.consecutive_intervals
                    and v.floor >= cfg.quarantine_ratio):
                self._eject(node, h, now, pools, rng, events, f"slow: {v.why}")
        elif h.flagged_streak >= cfg.consecutive_intervals:
            node.weight_scale = max(cfg.min_weight, 1.0 / v.slowness)
            self._set(node, h, NodeState.DEGRADED, now, pools, events, f"slow: {v.why}")

    def _learn_history(self, node: Node, h: NodeHealth, v: Verdict | None) -> None:
        if node.state is not NodeState.HEALTHY or (v is not None and v.flagged):
            return
        cfg = self.config
        for k, kind in ((0, h.prefill), (1, h.decode)):
            x = kind.mean(cfg.min_samples)
            if x is None:
                continue
            ref, seen = h.history[k]
            a = max(cfg.history_alpha, 1.0 / (seen + 1))
            h.history[k] = (ref + a * (x - ref), seen + 1)

    # -- transitions -------------------------------------------------------------

    def canary(self, nodes: Sequence[Node], rng: Random) -> str | None:
        """A probation node for this request (``canary_share`` each), or None: the policy's."""
        share = self.config.canary_share
        for node in nodes:
            if node.state is NodeState.PROBATION and rng.random() < share:
                return node.id
        return None

    def _set(self, node: Node, h: NodeHealth, state: NodeState, now: float,
             pools: list[PoolView], events: list[Event], reason: str) -> None:
        self._account(h, now)
        if node.state is NodeState.PROBATION:
            self.on_probation -= 1
        if state is NodeState.PROBATION:
            self.on_probation += 1
        node.state = state
        h.known_state = state
        h.reason = reason
        if state is NodeState.HEALTHY:
            node.weight_scale = 1.0
            h.flagged_streak = h.clean_streak = 0
        for pool in pools:
            if node in pool.nodes:
                pool.invalidate()
        events.append(Event(now, node.id, "state", state.value, reason))

    def _nominal_capacity(self, node: Node) -> float:
        cap = self._nominal.get(node.id)
        if cap is None:
            cap = self._nominal[node.id] = node.perf.decode_tokens_per_s(
                max(1, min(node.slots, 64)), 1024.0)
        return cap

    def _cap_allows(self, node: Node, pools: Sequence[PoolView]) -> bool:
        for pool in pools:
            if node not in pool.nodes:
                continue
            total = out = 0.0
            for n in pool.nodes:
                c = self._nominal_capacity(n)
                total += c
                if n is node or n.state is NodeState.QUARANTINED:
                    out += c
            if total > 0.0 and out > self.config.max_ejection_share * total:
                return False
        return True

    def _eject(self, node: Node, h: NodeHealth, now: float, pools: list[PoolView], rng: Random,
               events: list[Event], reason: str) -> None:
        cfg = self.config
        self.detected_ejections += 1
        h.flagged_streak = h.clean_streak = 0
        h.consecutive_failures = 0
        if not self._cap_allows(node, pools):
            node.weight_scale = max(cfg.min_weight, min(node.weight_scale, 1.0 / max(h.slowness,
                                                                                     2.0)))
            if node.state is NodeState.DEGRADED:
                events.append(Event(now, node.id, "detect", "degraded",
                                    f"{reason}; not quarantined: max ejection share reached"))
            else:
                self._set(node, h, NodeState.DEGRADED, now, pools, events,
                          f"{reason}; not quarantined: max ejection share reached")
            return
        self.enforced_ejections += 1
        h.ejections += 1
        backoff = min(cfg.base_ejection_s * 2.0 ** (h.ejections - 1), cfg.max_ejection_s)
        backoff *= 1.0 + cfg.jitter * (2.0 * rng.random() - 1.0)
        h.eject_until = now + backoff
        h.busy_since = -1.0
        self._set(node, h, NodeState.QUARANTINED, now, pools, events,
                  f"{reason}; ejection {h.ejections}, back in {backoff:.0f} s")

    def _to_probation(self, node: Node, h: NodeHealth, now: float, pools: list[PoolView],
                      events: list[Event]) -> None:
        h.eject_until = math.inf
        h.probation_since = now
        h.last_progress = now
        node.weight_scale = self.config.canary_weight
        self._set(node, h, NodeState.PROBATION, now, pools, events, "backoff over: canary")

    # -- reports -------------------------------------------------------------------

    def time_in_states(self, now: float) -> dict[str, dict[str, float]]:
        """Seconds each node spent in each state, up to ``now``."""
        out: dict[str, dict[str, float]] = {}
        for node_id, h in self.health.items():
            d = dict(h.state_seconds)
            key = h.known_state.value
            d[key] = d.get(key, 0.0) + (now - h.state_since)
            out[node_id] = d
        return out


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    mid = n // 2
    return s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])
