"""Per-node adaptive concurrency limits toward the pool's TPOT and TTFT SLO.

A weak GPU must run a smaller batch than a strong one to keep its time per
output token (TPOT) inside the SLO. The gateway sets each node's effective
batch through how many requests it lets run there at once: a :class:`Limiter`
per node hands out permits (held by the balancer's ``Ticket``, so each ends
exactly once: success, ignored or dropped) up to a limit that a :class:`Limit`
algorithm adapts from samples.

The algorithms follow Netflix's concurrency-limits library (see
``docs/sources.md``), with the latency signal replaced by the request's TPOT and
TTFT on the node measured against the pool's SLO, instead of a plain round
trip time against its no-load minimum:

* ``fixed``: the planned limit, never changed.
* ``aimd``: on a drop or a sample slower than the SLO,
  ``limit = max(min, min(limit - 1, floor(backoff * limit)))``; otherwise
  ``limit + 1`` while at least half of it is in use.
* ``gradient`` (Gradient2-style, the default): every ``update_every`` samples,
  take a recent high percentile ``pq`` of TPOT (and of the node-side TTFT)
  over a window of ``window`` samples. ``percentile`` defaults to 0.99, not
  0.9: the SLO is judged on the tail, and on a weak GPU the tail comes from
  short answers that shared their few steps with other requests' prefill
  chunks, which a p90 does not see. The gradient is the factor by which the
  batch should change for ``pq`` to meet its target. A decode step streams
  the weights once and each sequence's KV cache, so TPOT is close to
  ``floor + slope * batch`` with a large ``floor`` (the no-load TPOT; Netflix
  Gradient's "no-load RTT"), and the factor is the excess over it::

      gradient = min((target_tpot - floor) / (pq_tpot - floor),
                     target_ttft / pq_ttft)

  ``floor`` is the roofline's batch-1 decode step (the balancer passes it),
  or the fastest TPOT measured when that is lower; without it the first
  term is Gradient2's plain ``target / pq``. Over target the new limit is
  ``limit * max(gradient, 0.5)``. Under target, and while at least half the
  limit is in use, it grows by ``min(sqrt(limit), limit * (gradient - 1))``
  (the slack, at most Gradient2's queue allowance) times
  ``min(1, pi / (1 - pi))``, where ``pi`` is the probability that the
  window's percentile exceeds the target although exactly ``1 - percentile``
  of the samples do (a binomial tail: 0.33 for a 40-sample window and p99).
  Cuts then balance growth where the percentile sits at the target, not
  above it. The result is smoothed, ``limit = (1 - smoothing) * limit + smoothing
  * new``, and bounded to ``[min_limit, max_limit]``. A drop (upstream 429,
  timeout, or the engine reporting queued requests with its KV cache
  nearly full) cuts the limit by ``backoff`` at once.

  Why both: on a weak card the no-load step is already close to the SLO, so
  the plain ratio of target to p99 asks for a cut of a few percent where the
  batch must shrink by a third or more; and where the chunked-prefill budget
  caps a step near the SLO, the p99 saturates there and a cut can never
  outweigh a ``sqrt(limit)`` growth. With the plain ratio alone the limits
  rested with the p99 TPOT at the SLO instead of at the target
  (``benchmarks/README.md``, limits).

Slow start (gradient, ``slow_start: true`` by default; TCP's, RFC 5681): a
cold node starts below its plan, at the typical prompts it can prefill within
the TTFT target or half the plan, whichever is more, and grows by one per
sample within both targets while at least half of it is in use (so it doubles
every round trip of its permits) until it reaches the plan (the threshold), a
window's percentile goes over target (the gradient rule then cuts from where
slow start got to) or a drop. Starting at the plan, a cold fleet admits a
whole plan's worth of prompts at once: their prefill fills every engine step
for seconds, and the first requests miss TTFT and TPOT. The first wave (the
``start`` permits taken at once) is not judged: its prompts prefilled
together, which never recurs while permits free one at a time, so its
latencies neither grow the limit nor end slow start and do not enter the
windows; only a drop does. (Judged, the wave ended slow start on an A100
after 4 s at about half its plan, from where the gradient's growth took ~60 s
to reach its resting point.) A reloaded node keeps no slow start (it is
warm). The partitioned reserve of higher priorities is sized on the
threshold (:attr:`Limiter.ceiling`), so it does not shrink while the limit
ramps.

The initial limit comes from the roofline model (:func:`planned_limit`): the
largest batch whose step time, including its share of chunked prefill,
stays within ``target * slo_tpot`` at the workload's typical context, capped
by the KV cache.

Worked example (gradient, smoothing 0.2, target 0.9, SLO TPOT 100 ms, a
40-sample window, floor 75 ms): a node at limit 30 reports a window whose
p99 TPOT is 100 ms: gradient = (90 - 75) / (100 - 75) = 0.6, new = 18,
smoothed 30 * 0.8 + 18 * 0.2 = 27.6. Once p99 is back at 85 ms with 20 of
27.6 in flight, gradient = 15 / 10 = 1.5, the slack step is
min(sqrt(27.6), 27.6 * 0.5) = 5.25, scaled by pi / (1 - pi) = 0.495 to
2.60, and the limit climbs to 27.6 + 0.2 * 2.60 = 28.12.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

LIMIT_KINDS = ("gradient", "aimd", "fixed")

# Gradient2's bounds on one update's multiplicative change.
_MIN_GRADIENT = 0.5


@dataclass(frozen=True, slots=True)
class LimitConfig:
    """The ``limits:`` section of a scenario or of a fleet file's pool."""

    kind: str = "gradient"
    initial: int | None = None  # None: planned from the roofline model
    min_limit: int = 1
    max_limit: int | None = None  # None: the node's slots (max_num_seqs, KV)
    target: float = 0.9  # share of the SLO the recent percentile aims at
    percentile: float = 0.99  # the gradient's signal: this percentile of the window
    window: int = 40  # samples in the percentile window
    update_every: int = 10  # samples between gradient updates
    smoothing: float = 0.2
    backoff: float = 0.9
    kv_full: float = 0.95  # engine KV use that, with a queue, counts as a drop
    # The workload's typical prompt and answer lengths for the plan; None:
    # the pool's running means when the node registers.
    input_tokens: float | None = None
    output_tokens: float | None = None
    # Gradient only: a cold node starts at the prompts it can prefill within
    # the TTFT target and grows by one per good sample up to the plan.
    slow_start: bool = True


class Limit(Protocol):
    """A concurrency-limit algorithm: samples in, ``limit`` out."""

    @property
    def limit(self) -> int: ...

    @property
    def headed_for(self) -> float:
        """The limit it is growing toward while it ramps up (slow start), else 0."""

    def on_sample(self, now: float, tpot: float, ttft: float, inflight: int,
                  dropped: bool, weight: float = 1.0) -> None:
        """One finished request: its TPOT and node-side TTFT (<= 0: unknown),
        the permits in use when it ended and whether it ended in a drop.
        ``weight``: how many of the node's requests it stands for (a gateway
        replica that sees a share ``s`` of them: ``1/s``)."""


class FixedLimit:
    """The planned limit, constant."""

    __slots__ = ("_limit",)

    def __init__(self, limit: int) -> None:
        self._limit = max(1, limit)

    @property
    def limit(self) -> int:
        return self._limit

    headed_for = 0.0  # never ramps

    def on_sample(self, now: float, tpot: float, ttft: float, inflight: int,
                  dropped: bool, weight: float = 1.0) -> None:
        return


class AimdLimit:
    """Netflix AIMD with "slow" meaning a TPOT above the SLO."""

    __slots__ = ("_limit", "backoff", "max_limit", "min_limit", "slow_tpot")

    def __init__(self, initial: int, slow_tpot: float, min_limit: int = 1, max_limit: int = 256,
                 backoff: float = 0.9) -> None:
        self.min_limit, self.max_limit = min_limit, max_limit
        self._limit = min(max(initial, min_limit), max_limit)
        self.slow_tpot = slow_tpot
        self.backoff = backoff

    @property
    def limit(self) -> int:
        return self._limit

    headed_for = 0.0  # never ramps

    def on_sample(self, now: float, tpot: float, ttft: float, inflight: int,
                  dropped: bool, weight: float = 1.0) -> None:
        lim = self._limit
        if dropped or tpot > self.slow_tpot:
            lim = max(self.min_limit, min(lim - 1, math.floor(self.backoff * lim)))
        elif inflight * 2 >= lim:
            lim = min(self.max_limit, lim + 1)
        self._limit = lim


class GradientLimit:
    """Gradient2-style limit on a recent high percentile of TPOT and TTFT against their targets."""

    __slots__ = ("_estimate", "_growth_scale", "_hold", "_min_tpot", "_n", "_tpots", "_ttfts", "_wave",
                 "backoff", "floor_tpot", "max_limit", "min_limit", "percentile", "smoothing",
                 "ssthresh", "target_tpot", "target_ttft", "update_every", "window")

    def __init__(self, initial: int, target_tpot: float, target_ttft: float, *,
                 min_limit: int = 1, max_limit: int = 256, window: int = 40,
                 update_every: int = 10, smoothing: float = 0.2, backoff: float = 0.9,
                 percentile: float = 0.99, floor_tpot: float = 0.0,
                 start: int | None = None) -> None:
        self.min_limit, self.max_limit = min_limit, max_limit
        self.percentile = percentile
        self._estimate = float(min(max(initial, min_limit), max_limit))
        # Slow start: from ``start`` up to ``initial`` (the threshold), +1 per
        # sample within target, until a window over target or a drop.
        self.ssthresh = 0.0
        self._wave = 0  # samples of the cold start's first wave still to come
        self._hold = 0  # samples until a drop may cut the limit again
        if start is not None and start < self._estimate:
            self.ssthresh = self._estimate
            self._estimate = float(max(start, min_limit))
            self._wave = int(self._estimate)
        self.target_tpot, self.target_ttft = target_tpot, target_ttft
        self.window, self.update_every = window, update_every
        self.smoothing, self.backoff = smoothing, backoff
        # The node's no-load TPOT (the prior's batch-1 decode step; 0: unknown).
        self.floor_tpot = floor_tpot
        self._min_tpot = math.inf  # the fastest TPOT measured: the floor is never above it
        self._tpots: list[float] = []
        self._ttfts: list[float] = []
        self._n = 0.0
        # A window shows its percentile over target with probability pi even
        # when exactly (1 - percentile) of the samples are; growth steps of
        # pi / (1 - pi) times a cut's size make the limit rest where the
        # percentile meets the target, not above it.
        pi = _window_exceed_probability(window, percentile)
        self._growth_scale = min(1.0, pi / (1.0 - pi)) if pi < 1.0 else 1.0

    @property
    def limit(self) -> int:
        return int(self._estimate)

    @property
    def estimate(self) -> float:
        return self._estimate

    def floor(self) -> float:
        """The TPOT floor the gradient measures excess from (0 without a prior)."""
        return min(self.floor_tpot, self._min_tpot) if self.floor_tpot > 0.0 else 0.0

    @property
    def slow_start(self) -> bool:
        """Still in slow start (growing by one per sample toward ``ssthresh``)."""
        return self.ssthresh > 0.0

    @property
    def headed_for(self) -> float:
        return self.ssthresh

    def on_sample(self, now: float, tpot: float, ttft: float, inflight: int,
                  dropped: bool, weight: float = 1.0) -> None:
        if self._hold > 0:
            self._hold -= 1
            if dropped:
                return
        elif dropped:
            # One cut per round of the node's permits, as TCP cuts once per window: a
            # drop signal that lasts (an engine reporting a queue with its KV cache
            # full, scraped every 0.5 s; a burst of 429s) holds for every request
            # ending meanwhile, and a cut for each took an H100's limit from 256 to
            # 5 within seconds in the simulator (goodput 44 req/s against 79).
            self.ssthresh = 0.0
            self._estimate = max(float(self.min_limit), self._estimate * self.backoff)
            self._hold = int(self._estimate)
            return
        if tpot > 0.0 and tpot < self._min_tpot:
            self._min_tpot = tpot
        if self._wave > 0:
            # The first wave's prompts all arrived at once and prefilled
            # together, which never recurs while permits free one at a time:
            # its latencies describe that burst, not the batch.
            self._wave -= 1
            return
        if tpot > 0.0:
            _push(self._tpots, tpot, self.window)
        if ttft > 0.0:
            _push(self._ttfts, ttft, self.window)
        if self.ssthresh > 0.0 and tpot <= self.target_tpot and ttft <= self.target_ttft \
                and inflight * 2 >= self._estimate:
            # TCP slow start: one more permit per good sample doubles the
            # limit every round trip of the node's permits.
            self._estimate += 1.0
            if self._estimate >= self.ssthresh:
                self._estimate = self.ssthresh
                self.ssthresh = 0.0
        # A replica seeing part of the node's requests updates as often, in
        # time, as one gateway seeing them all would.
        self._n += weight
        if self._n < self.update_every:
            return
        self._n = 0.0
        gradient = math.inf
        if self._tpots:
            gradient = _excess_gradient(self.target_tpot,
                                        _quantile(self._tpots, self.percentile), self.floor())
        if self._ttfts:
            gradient = min(gradient, self.target_ttft / _quantile(self._ttfts, self.percentile))
        est = self._estimate
        if self.ssthresh > 0.0:
            if gradient >= 1.0:
                return  # slow start grows per sample
            self.ssthresh = 0.0  # the first window over target ends it
        if gradient >= 1.0:
            # Grow only while the limit is actually used: an idle node's fast
            # samples say nothing about a larger batch. The step is the slack
            # (so the percentile settles at its target rather than above it),
            # at most Gradient2's queue allowance sqrt(limit).
            if inflight * 2 < est:
                return
            new = est + min(math.sqrt(est), est * (gradient - 1.0)) * self._growth_scale
        else:
            new = est * max(gradient, _MIN_GRADIENT)
        est = est * (1.0 - self.smoothing) + new * self.smoothing
        self._estimate = min(max(est, float(self.min_limit)), float(self.max_limit))


def _excess_gradient(target: float, observed: float, floor: float) -> float:
    """How far to scale the batch so ``observed`` meets ``target``, for latency linear in batch.

    With ``latency = floor + slope * batch`` the batch that meets the target
    is the current one times ``(target - floor) / (observed - floor)``; with
    ``floor = 0`` this is Gradient2's plain ratio. A floor at or over the
    target (the node cannot meet it even alone) asks for the largest cut.
    """
    if observed <= floor:
        return math.inf if target > floor else 0.0
    if target <= floor:
        return 0.0
    return (target - floor) / (observed - floor)


def _window_exceed_probability(window: int, q: float) -> float:
    """P(the ``q`` quantile of ``window`` samples exceeds the true ``q`` quantile).

    :func:`_quantile` takes the sample of rank ``int(q * window)``; it is over
    the true quantile when at least ``window - rank`` samples are, each with
    probability ``1 - q``: a binomial tail.
    """
    rank = min(window - 1, int(q * window))
    need = window - rank
    p = 1.0 - q
    below = sum(math.comb(window, k) * p ** k * q ** (window - k) for k in range(need))
    return max(0.0, 1.0 - below)


def _push(ring: list[float], value: float, size: int) -> None:
    ring.append(value)
    if len(ring) > size:
        del ring[0]


def _quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


class Limiter:
    """One node's permits under its :class:`Limit`; counts how each permit ended."""

    __slots__ = ("algorithm", "dropped", "fleet_limit", "ignored", "inflight", "kv_full",
                 "remote", "share", "successes")

    def __init__(self, algorithm: Limit, kv_full: float = 0.95) -> None:
        self.algorithm = algorithm
        self.kv_full = kv_full
        self.inflight = 0
        self.successes = 0
        self.ignored = 0
        self.dropped = 0
        # With several gateway replicas (core/shared.py): this replica's share
        # of the node's limit, and the permits the others hold on the node.
        self.share = 1.0
        self.remote = 0
        # The mean of every replica's learned limit for the node (0: this one's alone).
        self.fleet_limit = 0.0

    @property
    def limit(self) -> int:
        """The node's limit, all replicas together (their estimates' mean when shared)."""
        if self.fleet_limit > 0.0:
            return max(1, int(self.fleet_limit))
        return self.algorithm.limit

    @property
    def allowed(self) -> int:
        """The permits this replica may hold: its share of the limit (the whole with one)."""
        share = self.share
        if share >= 1.0:
            return self.limit
        return max(1, round(self.limit * share))

    def has_room(self) -> bool:
        # Within this replica's share alone: the others' last count on top
        # (own + theirs < limit) would block permits they have released since,
        # and shed more at overload for no better TPOT (benchmarks/README.md,
        # replicas).
        return self.inflight < self.allowed

    @property
    def ceiling(self) -> float:
        """This replica's share of the limit the node is headed for (slow start's threshold)."""
        headed = self.algorithm.headed_for
        if headed > 0.0:
            return headed * min(self.share, 1.0)
        return float(self.allowed)

    def _weight(self) -> float:
        # The share of the node's requests this replica sees, as its share of
        # the permits in use (1 with one gateway).
        if self.remote <= 0:
            return 1.0
        return (self.inflight + self.remote) / max(self.inflight, 1)

    def acquire(self) -> Permit:
        """One permit, whatever the room (:meth:`has_room` is the caller's check)."""
        self.inflight += 1
        return Permit(self)

    def _end(self, now: float, ending: int, tpot: float, ttft: float, congested: bool) -> None:
        inflight = self.inflight + self.remote  # the batch the node ran, every replica's
        weight = self._weight()
        self.inflight -= 1
        if ending == _SUCCESS:
            self.successes += 1
            self.algorithm.on_sample(now, tpot, ttft, inflight, congested, weight)
        elif ending == _DROPPED:
            self.dropped += 1
            self.algorithm.on_sample(now, 0.0, 0.0, inflight, True, weight)
        else:
            self.ignored += 1


_SUCCESS, _DROPPED, _IGNORED = 0, 1, 2


class Permit:
    """One request's permit on a node's :class:`Limiter`, which ends exactly once:
    as a success (a sample for the limit), a drop (the node's overload signal) or
    ignored (the ending says nothing of the node's load: a client gone, a failure
    of another kind). A second ending changes nothing and returns False.

    Netflix concurrency-limits' listener (``onSuccess``, ``onDropped``,
    ``onIgnore``), as a value the request holds."""

    __slots__ = ("_limiter", "ended")

    def __init__(self, limiter: Limiter) -> None:
        self._limiter: Limiter | None = limiter
        self.ended = False

    @property
    def limiter(self) -> Limiter | None:
        """The limiter the permit was taken from (None once it ended)."""
        return self._limiter

    def succeeded(self, now: float, tpot: float, ttft: float, congested: bool = False) -> bool:
        """The request was served: its TPOT and node-side TTFT are the limit's sample.
        ``congested`` (the engine reports a queue with a nearly full KV cache) turns
        it into a drop signal for the algorithm."""
        return self._end(now, _SUCCESS, tpot, ttft, congested)

    def dropped(self, now: float) -> bool:
        """The node refused or timed out the request: the limit backs off."""
        return self._end(now, _DROPPED, 0.0, 0.0, False)

    def ignored(self) -> bool:
        """The ending says nothing of the node's load."""
        return self._end(0.0, _IGNORED, 0.0, 0.0, False)

    def _end(self, now: float, ending: int, tpot: float, ttft: float, congested: bool) -> bool:
        limiter = self._limiter
        if limiter is None:
            return False
        self._limiter = None
        self.ended = True
        limiter._end(now, ending, tpot, ttft, congested)
        return True


__all__ = [
    "LIMIT_KINDS",
    "AimdLimit",
    "FixedLimit",
    "GradientLimit",
    "Limit",
    "LimitConfig",
    "Limiter",
]
