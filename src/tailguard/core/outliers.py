"""Straggler and failure detection, and the quarantine lifecycle of a node.

A *straggler* is a node slow **for its own hardware**: a T4 running at T4
speed is healthy (the router already prices it by its roofline prior and its
class's learned speed); an A100 running at 40% of what its peers deliver is
not. The detector never compares a node with the fleet's fastest node.

Signal
------
Every first token and every successful finish gives the balancer one latency
sample and what the roofline model expected for it *at the batch and backlog
it met* (:mod:`tailguard.core.predict`): ``x = log(observed/expected)``,
separately for prefill (TTFT) and decode (TPOT). The roofline is a prior, not
the truth: real engines add fixed per-request overheads (tokenising, HTTP,
scheduling) that dominate a short or cached prompt, and on a CPU the time per
token grows with the batch, which a GPU roofline does not assume (measured on
llama.cpp with one thread: TPOTs at batch 2 1.6-2.5x those at batch 1). So a
sample is never judged against the roofline itself but against the same kind
of sample on healthy peers: each sample falls into a **bucket** (decode: the
running batch in powers of two; prefill: the tokens computed before the
first token, the backlog ahead plus the prompt's uncached part, in powers of
two, times the batch it joined in powers of two, since a short prompt's first
token waits for the step that also computes its neighbours' prompts; a
request that waited for an engine slot, which the roofline does not price,
has buckets of its own), and its residual is

    r = x - reference(bucket)

with the reference

* the **median of the other healthy nodes of its GPU class** in that bucket,
  each node's recent level there (the mean of its last 16 samples there,
  whose weight decays with a half-life of ``level_half_life_s``, 15 s, while
  the bucket is quiet): identical cards at the same batch share the
  roofline's error, and what every node meets at the same moment (a burst of
  load, a shared host's contention), which then cancel, and a node slow *from its first
  request* is compared with its peers from its first request; two nodes are
  enough (the slower one is the outlier: nobody is flagged for being fast);
* else, for decode, the node's **own history** in that bucket: its level the
  last time it was healthy and showed no excess (a class of one; TTFT is
  judged against peers only, see ``prefill_slow_ratio``);
* else nothing: the sample only teaches the node's own level.

Evidence, not a fixed sample count
----------------------------------
Each node keeps, per kind, Page's CUSUM (Page 1954, "Continuous inspection
schemes") of its residuals in units of its own sample noise ``sigma`` (an EWMA
of the spread around its recent mean, floored at ``sigma_floor``):

    S = min(2h, max(0, S + (r - k) / sigma)),   k = 0.75 log(slow_ratio)

so every sample slower than ``exp(k)`` (1.36x at the default ``slow_ratio``
1.5) adds evidence and every faster one removes it, whatever the request rate;
one sample adds at most 3 (a GC pause or a cold cache is one sample, not a
verdict).
The kind is *flagged* when ``S >= h`` (``evidence``, 6), at least
``min_samples`` (2) samples make up the current excess, and the node's recent
slowness ``s = exp(EWMA of r)`` (about the last two or three samples) exceeds
``slow_ratio`` (TTFT: ``prefill_slow_ratio``, 3). The two guards cover each other: the CUSUM needs sustained
evidence, so one slow burst is not enough; the recent slowness makes the flag
fall as soon as the node is fast again (the capped CUSUM alone would take a
dozen samples to drain). At ten samples per interval a node 2.5x slow for its
class (``r = 0.92``, ``sigma`` 0.15) crosses ``h`` in two samples; at under one
request per second the same evidence takes as many seconds as the samples take
to arrive, and an interval with no new sample gives no verdict at all.
Verdicts come at each interval's close and act after K flagged intervals, but a
decode flag (at ``sure_ratio``, by default the flag's own 1.5x) degrades a
healthy node at once when its excess has outlived the requests that showed it
first (a slow sample over work begun after the excess's first sample had ended:
a stall slows every request in flight at once, and the work after it runs at
full speed). TPOT carries no queue; at a few samples a minute the wait for a
second interval was most of the detection time (a llama.cpp server at a third
of its speed, read 2.1x slow beside peers sharing its two cores, took over 20 s
that way; acting at once, the simulated healthy hour still has no detection).

A streamed answer's decode is judged in pieces as it runs (``segment_s``, 1 s,
and at least 8 tokens each, where the driver reports the stream's progress, as
the gateway and the simulator do): a node slowed mid-answer shows within a
second or two of the answers running on it, not when they end. The decode
samples of one node and batch bucket within one such window are one sample
(:meth:`OutlierDetector.on_decode`): they timed the same moments of the node.

Why ``k`` is 0.75 of the threshold and not Page's half: identical SKUs differ by
~8% on average (SC'22, "Not All GPUs Are Created Equal") and a simulated fleet
spreads them +-10%: a card 1.22x slower than its class median must drift
*down*, or a zero-drift CUSUM would reach ``h`` by chance over an hour.

Worked example: an A100 throttled to 40% among three healthy ones, decode
``sigma`` 0.15 (a simulated fleet's). Its residuals are ``log(2.5) = 0.92``; each
would add ``(0.92 - 0.30) / 0.15 = 4.1``, capped at 3, so ``S`` passes ``h`` at
the second sample and is 9 after three, and ``s``, which moves half of the way
per sample, is then ``2.5 ** (1 - 0.5 ** 3) = 2.23x``: flagged. A healthy
peer 10% slower than the median (``r = 0.10``) moves ``S`` by -1.3 per sample
and stays at 0.

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
  interval without samples multiplies its weight by ``regain_factor``, up to
  1, so the router tries it again; only clean samples make it healthy). A
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

# One sample's log-ratio is clamped (a single hiccup is one sample), far out: on an
# unknown card (a CPU) the roofline prior is off by 100x before anything is learnt.
_CLAMP = 8.0


@dataclass(frozen=True, slots=True)
class OutlierConfig:
    """Detection thresholds and lifecycle timings (defaults from the issue and Envoy)."""

    enabled: bool = True
    interval_s: float = 5.0
    consecutive_intervals: int = 2  # K: flagged intervals in a row before acting
    # ...except a decode flag this slow whose excess outlived the requests that
    # showed it first, which acts at once: TPOT carries no queue, and such an
    # excess is neither a burst of contention nor one stall seen by every request
    # in flight. By default every decode flag (slow_ratio); higher asks more.
    sure_ratio: float = 1.5
    # A stream's decode is judged in pieces of at least this long (and
    # MIN_DECODE_TOKENS tokens) as its tokens arrive, where the driver reports them
    # (the gateway and the simulator do): a straggler shows before its answers
    # end; a node's decode samples within one such window count as one. 0: whole
    # answers only, each its own sample.
    segment_s: float = 1.0
    slow_ratio: float = 1.5  # recent slowness for its class that flags a node
    # TTFT carries the queue and, on a shared host, the neighbours' contention:
    # load spilled off a throttled node read 1.5-2.4x on its healthy peers' TTFT
    # (three llama.cpp servers on two cores, CI runs), so a TTFT flag asks the
    # quarantine ratio, and only against class peers (a node's own history is
    # from other conditions); milder slowness is TPOT's to find.
    prefill_slow_ratio: float = 3.0
    # Slow but working nodes are degraded (priced at their measured speed);
    # only this slow are they worth nothing to the pool and quarantined.
    quarantine_ratio: float = 3.0
    evidence: float = 6.0  # h: CUSUM evidence (in sigmas) before a flag
    sigma_floor: float = 0.1  # per-sample noise floor, log space
    # A node's sample noise before it has any, learnt within ~20 samples:
    # cautious for TTFT (a real engine's spreads by 2x and more with what it
    # computes beside it), less for TPOT (0.25-0.3 measured on llama.cpp).
    prefill_sigma_prior: float = 0.5
    decode_sigma_prior: float = 0.3
    min_samples: int = 2  # samples in the current excess before a flag (one is never enough)
    level_half_life_s: float = 15.0  # how fast a quiet bucket's level loses its weight
    recover_intervals: int = 3  # clean intervals before a degraded node is healthy
    # A degraded node the router stops using gives no samples to clear it: it
    # regains weight by this factor per interval without samples (up to 1).
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


_EW_ALPHA = 0.5  # the recent slowness: about the last two or three samples
_VAR_ALPHA = 0.05  # the sample noise: about the last twenty


def decode_bucket(batch: int) -> int:
    """A decode sample's bucket: its running batch in powers of two (1, 2, 3-4, 5-8, ...)."""
    return (batch - 1).bit_length() if batch > 1 else 0


_FRESH = 2  # intervals since a peer's last sample in a bucket for it to be a reference
# A level is the mean of a node's last this many samples in a bucket: at tens of
# samples a second, the last second or so. What every node meets at once (a burst
# of load, a shared host's contention) then moves the peers' levels with the
# node's own samples (an emulated fleet's per-token times moved by 1.3x within a
# second, on all nodes together).
_LEVEL_SAMPLES = 16.0
_REF_REUSE = 8.0  # samples of a bucket that reuse its reference before it is looked up again
_STEP_CAP = 3.0  # at most this much evidence (in sigmas) per sample: h needs two or more
_TOKEN_BUCKETS = 25  # prefill buckets per batch bucket (prefill_bucket's range)
_QUEUED = 16 * _TOKEN_BUCKETS  # added when the request waited for an engine slot


def prefill_bucket(tokens: int) -> int:
    """A prefill sample's bucket: the tokens computed before its first token in
    powers of two (0-1, 2-3, 4-7, ..., at most 24)."""
    b = tokens.bit_length()
    return b if b < 24 else 24


class _Evidence:
    """One kind (prefill or decode) of one node: levels, residual evidence, counters.

    ``levels[b]`` = [weight, mean of x, interval of the last sample, decode window
    of the last sample (see :meth:`OutlierDetector.on_decode`)]: the node's
    recent level in bucket b, what its peers are compared with: a running mean of
    its last ``_LEVEL_SAMPLES`` samples there (the weight is their count, capped,
    and decays between intervals, so a quiet bucket's old level gives way to the
    first new samples). ``history[b]``: its level when
    it was last healthy and clean. ``n``: residuals this interval (``absorb``
    adds other replicas'); ``own_n``/``own_total`` count this
    driver's own residuals since it started, never reset: what a gateway
    replica publishes for the others to pool (core/shared.py).
    """

    __slots__ = ("cusum", "ew", "history", "levels", "n", "own_n", "own_total", "peers", "refs",
                 "run", "run_since", "run_spread", "seen", "var")

    def __init__(self, sigma_prior: float) -> None:
        self.levels: dict[int, list[float]] = {}
        self.history: dict[int, float] = {}
        # The reference per bucket and how many more samples may use it.
        self.refs: dict[int, list[float]] = {}
        self.peers = False  # the last reference came from class peers (else own history)
        self.cusum = 0.0
        self.run = 0  # samples since the CUSUM was last at 0
        self.run_since = -math.inf  # when that run began (decode samples say)
        # A slow sample of the run came from work begun after the run's first
        # sample had finished: the excess outlived the requests that showed it
        # first (a stall slows every request in flight at once; a slow node, the next
        # ones too).
        self.run_spread = False
        self.ew = 0.0  # EWMA of the residuals: log of the recent slowness
        self.seen = 0  # residuals ever
        self.var = sigma_prior * sigma_prior
        self.n = 0
        self.own_n = 0
        self.own_total = 0.0

    def level(self, b: int, interval: int, window: int = -1) -> float | None:
        """The recent level in bucket ``b``: at least two samples' worth, the last
        within ``_FRESH`` intervals (a peer that stopped running such requests
        half a minute ago says nothing of how they run now), or, given a decode
        ``window``, within it or the one before."""
        lv = self.levels.get(b)
        if lv is None or lv[0] < 2.0 or interval - lv[2] > _FRESH:
            return None
        if window >= 0 and lv[3] < window - 1:
            return None
        return lv[1]

    def learn(self, b: int, x: float, interval: int, n: float = 1.0, window: int = -1) -> None:
        """``n`` samples of mean ``x`` in bucket ``b`` (a decode window's, see
        :meth:`OutlierDetector.on_decode`, moves the level as its samples would)."""
        lv = self.levels.get(b)
        if lv is None:
            self.levels[b] = [min(n, _LEVEL_SAMPLES), x, float(interval), float(window)]
        else:
            w = lv[0] + n
            if w > _LEVEL_SAMPLES:
                w = _LEVEL_SAMPLES
            lv[0] = w
            lv[1] += (x - lv[1]) * (n / w if n < w else 1.0)
            lv[2] = float(interval)
            lv[3] = float(window)

    def add(self, r: float, n: int, allowance: float, cap: float, floor: float,
            now: float | None, since: float | None = None) -> None:
        """``n`` residuals of mean ``r`` (one sample, or a peer replica's batch), seen at
        ``now`` (None: not known, for a peer's batch and for TTFT), measured over
        work begun at ``since`` (None: not known)."""
        sigma = math.sqrt(self.var)
        if sigma < floor:
            sigma = floor
        if self.seen == 0:
            self.ew = r
        else:
            d = r - self.ew
            if self.cusum < 0.25 * cap:  # in control (under h/2): learn the noise, not the excess
                # winsorised at 2 sigma: the first samples of a fault must not pass for noise
                dd = d * d if d * d < 4.0 * self.var else 4.0 * self.var
                self.var += _VAR_ALPHA * (dd - self.var)
            self.ew += (1.0 - (1.0 - _EW_ALPHA) ** n) * d
        step = (r - allowance) / sigma
        if step > _STEP_CAP:  # one wild sample (a GC pause, a cold cache) is not evidence
            step = _STEP_CAP
        cusum = self.cusum + n * step
        if cusum <= 0.0:
            self.cusum = 0.0
            self.run = 0
        else:
            if self.run == 0:
                self.run_spread = False
                if now is not None:
                    self.run_since = now  # the excess starts here
            elif r > allowance and (since is None or since >= self.run_since):
                self.run_spread = True
            self.cusum = cusum if cusum < cap else cap
            self.run += n
        self.seen += n
        self.n += n

    def restart(self) -> None:
        """Evidence starts afresh (the node was judged anew: healthy, or on probation)."""
        self.cusum = 0.0
        self.run = 0
        self.ew = 0.0
        self.seen = 0

    def close(self, decay: float, clean: bool) -> None:
        """End of an interval: levels decay, and so does the evidence of an interval
        without samples (a node slow a minute ago and not asked since is not known
        to be slow now); a clean healthy node's levels are its history."""
        if self.n == 0:
            self.cusum *= decay
        for b in list(self.levels):
            lv = self.levels[b]
            if clean and lv[0] >= 2.0:
                self.history[b] = lv[1]
            lv[0] *= decay
            if lv[0] < 0.05:
                del self.levels[b]
        self.refs.clear()
        self.n = 0


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
        "known_state",
        "last_progress",
        "own_failures",
        "own_requests",
        "pending",
        "prefill",
        "probation_since",
        "reason",
        "requests",
        "slowness",
        "state_seconds",
        "state_since",
        "window",
    )

    def __init__(self, now: float, config: OutlierConfig) -> None:
        self.prefill = _Evidence(config.prefill_sigma_prior)
        self.decode = _Evidence(config.decode_sigma_prior)
        self.requests = 0
        self.failures = 0
        self.own_requests = 0  # this driver's own, never reset (see _Evidence)
        self.own_failures = 0
        self.reason = ""  # why the node is in its state (the last transition's reason)
        # (requests, failures) of the last failure_window intervals, current excluded.
        self.window: deque[tuple[int, int]] = deque()
        self.consecutive_failures = 0
        self.flagged_streak = 0
        self.clean_streak = 0
        self.slowness = 1.0
        self.ejections = 0
        self.eject_until = math.inf
        self.probation_since = 0.0
        self.last_progress = now
        # Decode samples of the detector's open window, by bucket (on_decode):
        # [sum of log(observed / expected), count, last seen, earliest since]: the
        # window's excess outlived the run's first window when all the work it
        # timed began after that one closed (_Evidence.run_spread).
        self.pending: dict[int, list[float]] = {}
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
        # The records of each GPU class (a node's peers), rebuilt when nodes come or go.
        self._classes: dict[str, list[tuple[Node, NodeHealth]]] = {}
        self._classes_for = -1
        # ...and those of them healthy and not flagged, as of the last tick: the
        # nodes whose levels are references.
        self._references: dict[str, list[tuple[Node, NodeHealth]]] = {}
        self._interval = 0  # intervals closed so far: the age of a node's levels
        # The CUSUM's allowance k (per sample, so set once per tick: a reload may
        # change slow_ratio; records, and so samples, exist only after a tick).
        self._allowance = 0.75 * math.log(self.config.slow_ratio)
        self._window_t = -math.inf  # when the decode window last closed (_flush_decode)
        self._windows = 0  # decode windows closed so far

    # -- per-request bookkeeping (O(1)) ----------------------------------------

    def _rec(self, node: Node, now: float) -> NodeHealth:
        h = self.health.get(node.id)
        if h is None:
            h = self.health[node.id] = NodeHealth(now, self.config)
            h.known_state = node.state
            self._classes_for = -1
        return h

    def _peers(self, nodes: Mapping[str, Node]) -> None:
        if self._classes_for == len(nodes):
            return
        classes: dict[str, list[tuple[Node, NodeHealth]]] = {}
        for node in nodes.values():
            h = self.health.get(node.id)
            if h is not None:
                classes.setdefault(node.spec.gpu_class, []).append((node, h))
        self._classes = classes
        self._classes_for = len(nodes)

    # Records are created by tick (every node, every tick): the request path
    # only looks them up, and drops the samples of a node not yet ticked.

    def on_progress(self, node: Node, now: float) -> None:
        """The node produced a first token (its sample may come later)."""
        h = self.health.get(node.id)
        if h is not None:
            h.last_progress = now

    def on_prefill(self, node: Node, ttft: float, expected: float, now: float,
                   tokens: int = 0, batch: int = 1, queued: bool = False) -> None:
        """A TTFT sample: ``tokens`` the engine had to compute before this first token
        (the backlog ahead plus the prompt's uncached part), ``batch`` requests on the
        node with it at dispatch (a short prompt's first token waits for the step
        that computes the others' prompts too); ``queued``: it found every engine
        slot taken and waited for one, a wait the roofline does not price."""
        h = self.health.get(node.id)
        if h is not None:
            h.last_progress = now
            b = prefill_bucket(tokens) + _TOKEN_BUCKETS * decode_bucket(batch)
            self._sample(node, h, h.prefill, 0, b + _QUEUED if queued else b, ttft, expected,
                         None)

    def on_decode(self, node: Node, tpot: float, expected: float, batch: int = 1,
                  now: float | None = None, since: float | None = None) -> None:
        """A TPOT sample seen at ``now``, over a decode that began at ``since``.

        Where decode is judged in pieces (``segment_s``), the samples one node
        gives in one bucket within a window of ``segment_s`` are one sample,
        their mean (in log), judged at the tick that closes the window
        (:meth:`_flush_decode`): they timed the same moments of the node, the
        pieces of concurrent streams and the ends of the answers finishing
        then alike. Counted one by one, the dozens of streams of a busy node
        gave dozens of samples of each second, and a healthy card 1.2-1.3x its
        peers (the spread of identical SKUs) was degraded whenever one second
        ran a few tenths slower. A window's ``since`` is the earliest of its
        samples': its excess outlived the run's first window (``run_spread``)
        only when all the work it timed began after that window closed, which
        a throttle's third slow window does and the windows a 2 s stall
        touches do not (the work they time began before it).
        """
        h = self.health.get(node.id)
        if h is None or tpot <= 0.0 or expected <= 0.0:
            return
        b = decode_bucket(batch)
        if now is None or self.config.segment_s <= 0.0:
            self._sample(node, h, h.decode, 1, b, tpot, expected, now, since)
            return
        x = math.log(tpot / expected)
        acc = h.pending.get(b)
        if acc is None:
            h.pending[b] = [x, 1.0, now, now if since is None else since]
        else:
            acc[0] += x
            acc[1] += 1.0
            if now > acc[2]:
                acc[2] = now
            if since is not None and since < acc[3]:
                acc[3] = since

    def _flush_decode(self, nodes: Mapping[str, Node], now: float) -> None:
        """Close the decode window (see :meth:`on_decode`) once ``segment_s`` old: every
        node's levels learn the window first, so that each is judged against its
        peers' levels of the same moments (what every node met at once cancels)."""
        if now - self._window_t < 0.99 * self.config.segment_s:  # ticks drift by a hair
            return
        self._window_t = now
        self._windows += 1
        window = self._windows
        closed: list[tuple[Node, _Evidence, int, float, float, float]] = []
        for node in nodes.values():
            h = self.health.get(node.id)
            if h is None or not h.pending:
                continue
            pending, h.pending = h.pending, {}
            for b, (total, n, seen, since) in sorted(pending.items()):
                x = _clamp(total / n)
                h.decode.learn(b, x, self._interval, n, window)
                closed.append((node, h.decode, b, x, seen, since))
        # Each class's peer levels of these moments, by bucket: read once a window
        # (a class of 24 read each other's 24 levels, twice a second live).
        moments: dict[tuple[str, int], list[tuple[float, Node]]] = {}
        for node, ev, b, x, seen, since in closed:
            key = (node.spec.gpu_class, b)
            levels = moments.get(key)
            if levels is None:
                levels = moments[key] = sorted(
                    ((lv, other) for other, oh in self._references.get(key[0], ())
                     if oh.decode.cusum < self.config.evidence
                     and (lv := oh.decode.level(b, self._interval, window)) is not None),
                    key=_first)
            ref = self._window_reference(node, ev, b, levels)
            if ref is not None:
                self._residual(ev, x - ref, seen, since)

    def _window_reference(self, node: Node, ev: _Evidence, b: int,
                          levels: list[tuple[float, Node]]) -> float | None:
        """A decode window's reference: the median of the peers' levels of that window
        or the one before (``levels``, sorted, the node's own among them perhaps),
        else the node's own clean history, and only then the peers' older levels
        (:meth:`_reference`): a healthy A100 running a batch its faster peer had run
        seconds before read 1.6x slow against that peer's moment."""
        others = [lv for lv, other in levels if other is not node]
        if others:
            ev.peers = True
            n = len(others)
            mid = n // 2
            return others[mid] if n % 2 else 0.5 * (others[mid - 1] + others[mid])
        own = ev.history.get(b)
        if own is not None:
            ev.peers = False
            return own
        return self._reference(node, ev, 1, b)

    def _sample(self, node: Node, h: NodeHealth, ev: _Evidence, k: int, b: int,
                observed: float, expected: float, now: float | None,
                since: float | None = None) -> None:
        if observed <= 0.0 or expected <= 0.0:
            return
        x = _clamp(math.log(observed / expected))
        ev.learn(b, x, self._interval)
        cached = ev.refs.get(b)
        if cached is not None and cached[1] > 0.0:
            cached[1] -= 1.0
            ref = cached[0]
        else:
            found = self._reference(node, ev, k, b)
            if found is None:
                return
            ref = found
        self._residual(ev, x - ref, now, since)

    def _residual(self, ev: _Evidence, r: float, now: float | None, since: float | None) -> None:
        """A sample's excess over its reference, as evidence."""
        ev.add(r, 1, self._allowance, 2.0 * self.config.evidence, self.config.sigma_floor, now,
               since)
        ev.own_n += 1
        ev.own_total += r

    def _reference(self, node: Node, ev: _Evidence, k: int, b: int) -> float | None:
        """The median level of the node's healthy, clean class peers in bucket ``b``, else
        the node's own history there; reused for the next ``_REF_REUSE`` samples of
        the bucket (the peers' levels move little per sample; a reference kept for a
        whole interval was seconds stale, and what a host's contention or a burst of
        load does to every node at once then read as one node's slowness)."""
        evidence = self.config.evidence
        # The peers' levels by bucket (_Evidence.level, inlined: the hot path).
        peers = [oev.levels for other, oh in self._references.get(node.spec.gpu_class, ())
                 if other is not node
                 and (oev := oh.prefill if k == 0 else oh.decode).cusum < evidence]
        oldest = self._interval - _FRESH
        levels: list[float] = []
        # The bucket itself, else (prefill) the next octave of tokens at the same
        # batch: at low rates a node's peers may not have run exactly its kind of
        # request. Never another batch: on a CPU a batch of two steps 2x slower.
        near = (b, b - 1, b + 1) if k == 0 else (b,)
        for bb in near:
            if bb // _TOKEN_BUCKETS != b // _TOKEN_BUCKETS:
                continue
            for by_bucket in peers:
                lv = by_bucket.get(bb)
                if lv is not None and lv[0] >= 2.0 and lv[2] >= oldest:
                    levels.append(lv[1])
            if levels:
                break
        if levels:
            ref: float | None = _median(levels)
            ev.peers = True
        else:
            ref = ev.history.get(b) if k == 1 else None  # TTFT: peers only
            ev.peers = False
        if ref is not None:
            ev.refs[b] = [ref, _REF_REUSE]
        return ref

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
        cfg = self.config
        for ev, (n, total) in ((h.prefill, prefill), (h.decode, decode)):
            if n > 0:
                ev.add(total / n, n, self._allowance, 2.0 * cfg.evidence, cfg.sigma_floor, None)
        h.requests += requests
        h.failures += failures
        if failures:
            if requests > failures:  # a success among them: the run is the replica's
                h.consecutive_failures = max(h.consecutive_failures, tail_failures)
            else:
                h.consecutive_failures += failures

    def forget(self, node_id: str) -> None:
        self._classes_for = -1
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
        self._peers(nodes)
        self._allowance = 0.75 * math.log(cfg.slow_ratio)
        self._flush_decode(nodes, now)
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
                elif node.state is NodeState.HEALTHY and h.decode.cusum >= cfg.evidence:
                    self._sure(node, h, now, pool_list, events)
        if now >= self._next_eval:
            if self._next_eval >= 0.0:
                self._evaluate(now, nodes, pool_list, rng, events)
                self._interval += 1
            self._next_eval = now + cfg.interval_s
        self._refresh_references()
        return events

    def _refresh_references(self) -> None:
        """Each class's healthy, unflagged records: whose levels are references."""
        self._references = {
            gpu: [(n, h) for n, h in members
                  if n.state is NodeState.HEALTHY and not h.flagged_streak]
            for gpu, members in self._classes.items()}

    def _follow(self, now: float, nodes: Mapping[str, Node]) -> None:
        """A follower's tick: intervals close and histories learn; states are the leader's."""
        for node in nodes.values():
            self._observe_state(node, self._rec(node, now), now)
        self._refresh_references()
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
            self._interval += 1
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
                h.prefill.restart()
                h.decode.restart()
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

    def _flag(self, name: str, ev: _Evidence) -> tuple[float, bool, str]:
        """One kind's recent slowness, whether it is flagged, and why."""
        cfg = self.config
        s = math.exp(ev.ew)
        bar = cfg.slow_ratio if name == "decode" else cfg.prefill_slow_ratio
        flagged = ev.cusum >= cfg.evidence and ev.run >= cfg.min_samples and s > bar
        how = "class peers" if ev.peers else "own history"
        return s, flagged, f"{name} {s:.2f}x {how} (evidence {ev.cusum:.1f} over {ev.run} samples)"

    def verdicts(self, nodes: Mapping[str, Node]) -> dict[str, Verdict]:
        """Slowness of every node with new evidence in the current interval, and its flag."""
        out: dict[str, Verdict] = {}
        for node in nodes.values():
            h = self.health.get(node.id)
            if h is None:
                continue
            best: Verdict | None = None
            for name, ev in (("prefill", h.prefill), ("decode", h.decode)):
                if ev.n == 0:  # no new sample: no verdict
                    continue
                s, flagged, why = self._flag(name, ev)
                if best is None:
                    best = Verdict(s, flagged, why, s)
                else:
                    floor = min(s, best.floor)
                    if (flagged, s) > (best.flagged, best.slowness):
                        best = Verdict(s, flagged, why, floor)
                    else:
                        best = Verdict(best.slowness, best.flagged, best.why, floor)
            if best is not None:
                out[node.id] = best
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
                # No evidence either way: the weight comes back so the router tries
                # the node again, but only clean samples make it healthy (declared
                # healthy on the weight alone, a throttled node flapped).
                node.weight_scale = min(1.0, node.weight_scale * cfg.regain_factor)
            self._close_interval(node, h, v)

    def _sure(self, node: Node, h: NodeHealth, now: float, pools: list[PoolView],
              events: list[Event]) -> None:
        """Degrade a healthy node at once, between intervals, on conclusive decode
        evidence (flagged at ``sure_ratio`` or slower): at a few samples a minute the
        interval's close would add up to ``interval_s`` for nothing. The only place
        that acts on one flag: it runs every tick, before any interval's verdicts."""
        s, flagged, why = self._flag("decode", h.decode)
        # ...and only once the excess outlived the requests that showed it first: a
        # stall hits every request in flight at once, and their slow TPOTs arrive
        # together as one burst; work begun after it ends runs at full speed.
        if flagged and s >= self.config.sure_ratio and h.decode.run_spread:
            h.slowness = s
            h.flagged_streak = 1
            h.clean_streak = 0
            node.weight_scale = max(self.config.min_weight, 1.0 / s)
            self._set(node, h, NodeState.DEGRADED, now, pools, events, f"slow: {why}")

    def _push_window(self, h: NodeHealth) -> tuple[int, int]:
        """The interval's outcomes into the failure window; the window's totals."""
        h.window.append((h.requests, h.failures))
        if len(h.window) > self.config.failure_window:
            h.window.popleft()
        return sum(r for r, _ in h.window), sum(f for _, f in h.window)

    def _close_interval(self, node: Node, h: NodeHealth, v: Verdict | None) -> None:
        """Levels decay (a clean healthy node's become its history); the next interval starts."""
        cfg = self.config
        decay = 0.5 ** (cfg.interval_s / max(cfg.level_half_life_s, 1e-9))
        clean = node.state is NodeState.HEALTHY and (v is None or not v.flagged)
        half = 0.5 * cfg.evidence
        h.prefill.close(decay, clean and h.prefill.cusum < half)
        h.decode.close(decay, clean and h.decode.cusum < half)
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
        if state is NodeState.HEALTHY or state is NodeState.PROBATION:
            h.prefill.restart()
            h.decode.restart()
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


def _first(pair: tuple[float, Node]) -> float:
    return pair[0]


def _clamp(x: float) -> float:
    return _CLAMP if x > _CLAMP else (-_CLAMP if x < -_CLAMP else x)


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    mid = n // 2
    return s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])
