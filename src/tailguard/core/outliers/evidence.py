"""What the detector keeps per node: each kind's levels and residual evidence
(:class:`Evidence`), the node's record (:class:`NodeHealth`), and an
interval's :class:`Verdict`; the sample buckets and the constants they share."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from tailguard.core.fleet import Node, NodeState
from tailguard.core.outliers.config import OutlierConfig

# One sample's log-ratio is clamped (a single hiccup is one sample), far out: on an
# unknown card (a CPU) the roofline prior is off by 100x before anything is learnt.
_CLAMP = 8.0
_EW_ALPHA = 0.5  # the recent slowness: about the last two or three samples
_VAR_ALPHA = 0.05  # the sample noise: about the last twenty


def decode_bucket(batch: int) -> int:
    """A decode sample's bucket: its running batch in powers of two (1, 2, 3-4, 5-8, ...)."""
    return (batch - 1).bit_length() if batch > 1 else 0


FRESH = 2  # intervals since a peer's last sample in a bucket for it to be a reference
# A level is the mean of a node's last this many samples in a bucket: at tens of
# samples a second, the last second or so. What every node meets at once (a burst
# of load, a shared host's contention) then moves the peers' levels with the
# node's own samples (an emulated fleet's per-token times moved by 1.3x within a
# second, on all nodes together).
_LEVEL_SAMPLES = 16.0
REF_REUSE = 8.0  # samples of a bucket that reuse its reference before it is looked up again
# How far a clean reference may rise per clean interval: a bucket's own history
# (in log, HISTORY_RISE) and a class of one's clean prefill speed
# (OutlierDetector._close_interval). "Clean" is judged at the interval's close,
# when a slowdown's first seconds may not yet have moved the CUSUM past half its
# threshold; taken whole, they became the reference that the rest of the
# slowdown was then judged against (a lone H100 throttled to half speed: its
# history rose 1.27x at the first close). Falling is followed at once.
CLEAN_RISE = 1.1
HISTORY_RISE = math.log(CLEAN_RISE)
_STEP_CAP = 3.0  # at most this much evidence (in sigmas) per sample: h needs two or more
TOKEN_BUCKETS = 25  # prefill buckets per batch bucket (prefill_bucket's range)
QUEUED = 16 * TOKEN_BUCKETS  # added when the request waited for an engine slot
# Added to a lone node's decode bucket where its window was mostly decode (the
# steps alone half its time or more): its own history is kept apart for pieces
# mostly decode and pieces mostly prompt chunks, whose whole ratios part by how
# the model prices the chunks (overloaded, a lone H100 read -0.3 to -0.6 in log
# with a share of 0.31-0.44 and +0.1 to +0.3 with 0.55-0.87, second by second).
MOSTLY_DECODE = 64


def prefill_bucket(tokens: int) -> int:
    """A prefill sample's bucket: the tokens computed before its first token in
    powers of two (0-1, 2-3, 4-7, ..., at most 24)."""
    b = tokens.bit_length()
    return b if b < 24 else 24


class Evidence:
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
        within ``FRESH`` intervals (a peer that stopped running such requests
        half a minute ago says nothing of how they run now), or, given a decode
        ``window``, within it or the one before."""
        lv = self.levels.get(b)
        if lv is None or lv[0] < 2.0 or interval - lv[2] > FRESH:
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
            now: float | None, since: float | None = None, weight: float = 1.0) -> None:
        """``n`` residuals of mean ``r`` (one sample, or a peer replica's batch), seen at
        ``now`` (None: not known, for a peer's batch and for TTFT), measured over
        work begun at ``since`` (None: not known), each carrying ``weight`` of a
        sample's evidence (its recent slowness and CUSUM move that much)."""
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
            self.ew += (1.0 - (1.0 - _EW_ALPHA) ** (n * weight)) * d
        step = (r - allowance) / sigma
        if step > _STEP_CAP:  # one wild sample (a GC pause, a cold cache) is not evidence
            step = _STEP_CAP
        cusum = self.cusum + n * weight * step
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
                last = self.history.get(b)
                self.history[b] = lv[1] if last is None else min(lv[1], last + HISTORY_RISE)
            lv[0] *= decay
            if lv[0] < 0.05:
                del self.levels[b]
        self.refs.clear()
        self.n = 0


class NodeHealth:
    """The detector's record of one node."""

    __slots__ = (
        "busy_since",
        "clean_prefill",
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
        "stalled",
        "state_seconds",
        "state_since",
        "window",
    )

    def __init__(self, now: float, config: OutlierConfig) -> None:
        self.prefill = Evidence(config.prefill_sigma_prior)
        self.decode = Evidence(config.decode_sigma_prior)
        self.requests = 0
        self.failures = 0
        self.own_requests = 0  # this driver's own, never reset (see Evidence)
        self.own_failures = 0
        self.reason = ""  # why the node is in its state (the last transition's reason)
        # (requests, failures) of the last failure_window intervals, current excluded.
        self.window: deque[tuple[int, int]] = deque()
        # The node's stalls so far (Node.stalls, Node.stalled_s) when the record
        # began and at the close of each interval since, the last failure_window
        # of them: the first is where the window of its recent stalls begins.
        self.stalled: deque[tuple[int, float]] = deque()
        self.consecutive_failures = 0
        self.flagged_streak = 0
        self.clean_streak = 0
        self.slowness = 1.0
        self.ejections = 0
        self.eject_until = math.inf
        self.probation_since = 0.0
        self.last_progress = now
        # Decode samples of the detector's open window, by bucket (on_decode):
        # [sum of share x log(observed / expected), count, last seen, earliest
        # since, sum of log(observed / expected), sum of shares]: the window's
        # excess outlived the run's first window when all the work it timed began
        # after that one closed (Evidence.run_spread); the last two are for a node
        # alone in its class (SampleIntake._flush_decode).
        self.pending: dict[int, list[float]] = {}
        self.busy_since = -1.0
        # Its class's learned prefill slowdown when its decode evidence was last
        # clean (0: not yet): what a class of one's decode pieces are priced at
        # (SampleIntake.judged_prefill_slowdown).
        self.clean_prefill = 0.0
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


def first(pair: tuple[float, Node]) -> float:
    return pair[0]


def clamp(x: float) -> float:
    return _CLAMP if x > _CLAMP else (-_CLAMP if x < -_CLAMP else x)


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    mid = n // 2
    return s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])
