"""Hedged requests: when to send a duplicate, and the budget that caps them.

From "The Tail at Scale" (Dean and Barroso, 2013): if a request has no answer
after the 95th percentile of its class's recent latency, send one duplicate
to another replica; the first to answer wins and the other is cancelled. A
hedge sent at p95 adds about 5% requests and removes most of the tail that
comes from one replica's hiccup (a stall, a GC pause, a slow link); their
example cut a 1000-key read's p99.9 from 1800 ms to 74 ms for 2% more
requests.

For LLM serving the "answer" is the **first token**: the hedge fires when a
request has produced no first token after ``hedge_after``, and never once a
byte reached the client (the drivers enforce it: a streamed answer is
committed at its first chunk). Whichever copy produces the first token wins;
the driver cancels the other (closes its connection, releases its permit
with ``CLIENT_CANCELLED``). ``hedge_after`` is a fixed value (``after_s``), or
learned per GPU class of the node the request went to:

* ``per_request: true`` (default): the earlier of the class's recent
  ``quantile`` (p95) of TTFT and this request's *expected* TTFT (the roofline
  prediction for its prompt and the backlog it met at dispatch,
  :meth:`~tailguard.core.balancer.Ticket.expected_ttft`) times the class's
  recent ``quantile`` of observed over expected TTFT. A 50-token prompt on an
  idle node is late long before the class's p95, which longer prompts and
  backlogs set; it is never hedged later than the class rule would.
* ``per_request: false``: the class's recent ``quantile`` of TTFT, one delay
  for every prompt (Dean and Barroso's rule as written).

Measured (benchmarks/stragglers.py stalls, 6 cases): against the class rule,
P99 TTFT 1-3% lower in 5 of 6 cases (0.249 -> 0.241 s where stalls set it),
1% higher in one (0.601 -> 0.606 s), the same 3.0-4.7% extra requests. The
request's own delay alone (not capped by the class's) was worse: long
prompts on a stalled node waited past the class's p95 (P99 0.262 s in the
first case). Tried first with the node's silence judged at the request's own
delay: a short prompt's delay is shorter than the gaps a busy, healthy node
leaves between first tokens, the win rate fell from 87% to 62% and P99 rose;
silence is judged at the class's quantile (see :meth:`Hedger.silent`).

Refinement (``require_silence``, on by default): the hedge also waits until
the request's *node* has produced nothing (no first token, no finish) for
the class's TTFT quantile (``hedge_after`` while it is not known), and until
one of its prompts is overdue (:meth:`~tailguard.core.fleet.Node.overdue_s`:
silent past twice a waiting prompt's expected TTFT). Silence alone passes in
the quiet moments of a healthy node; measured on the stalls benchmark, 4
hedges in 5 went there and the credit was gone when a stall came (waits
over 1 s: 23-166 per case); with the overdue check, 0, for 0.5-2.1% extra
requests instead of 4.6-4.8%. A request slow because its node is busy with a long queue
gains nothing from a duplicate; one stuck on a stalled node gains everything.
Measured on intermittent stalls: without it the p95-tail hedges spend the
whole budget on ordinary slow requests and P99 TTFT does not move.

Budget: each request adds ``budget`` (0.05) hedge credits, a hedge spends one;
credit accumulates up to ``burst`` so that a stall can be hedged from the
credit its calm minutes saved, but over any long stretch hedges stay within
``budget`` of requests. The default ``burst`` of 50 is the credit 1,000
requests earn at the default budget. It must cover one stall: a node that
pauses for ``p`` seconds while the router still sends it ``r`` requests per
second holds about ``r * p`` requests without a first token, and each needs a
hedge. Measured (benchmarks/stragglers.py, stalls of 2 s every 10 s on half
of the fast nodes of a 5-9 node fleet): with a burst of 10 the credit ran out
within each stall and 242 of the 245 requests at or above the P99 were stuck
on a stalled node with no credit left (P99 1.69 s without hedging, 0.87 s
with); with 50, 0.60 s. The cap still matters: without it an hour of calm
traffic would fund thousands of hedges at once when the whole fleet slows
down, doubling its load exactly when it has least room.

Worked example: an A100 class whose last 200 TTFTs have p95 0.18 s; with
``per_request: false`` a request dispatched to an A100 at t = 10.00 with no
first token at t = 10.18 gets a hedge if the credit is >= 1 (after 20 requests
without hedges it is 1.0). With ``per_request: true``, if the class's p95 of
observed/expected is 1.5, a request expected at 0.04 s (a short prompt, empty
backlog) is due at 10.06, one expected at 0.30 s at 10.18 (the class's p95,
not 10.45); either is hedged only if its node has been silent for 0.18 s.

This class is the decision only; the exchange (:mod:`tailguard.core.exchange`)
sends the duplicate, runs the race and cancels the loser, the same way for
every driver.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HedgeConfig:
    """Hedging of one pool (off by default)."""

    enabled: bool = False
    after_s: float = 0.0  # fixed delay; 0: learned per GPU class (below)
    # True: the earlier of the class's TTFT quantile and the request's expected
    # TTFT times the class's quantile of observed over expected TTFT; False: the
    # class's TTFT quantile, for every prompt.
    per_request: bool = True
    quantile: float = 0.95
    budget: float = 0.05  # hedges per request, over the long run
    burst: float = 50.0  # most credit saved up: one stall's worth (see above)
    window: int = 200  # recent TTFT samples kept per GPU class
    min_samples: int = 20  # before the quantile is trusted
    min_after_s: float = 0.005
    # Hedge only when the request's node has also been silent (no first token,
    # no finish for any request) for hedge_after: a node busy answering others
    # is working through a queue a duplicate would only lengthen, while a
    # silent one is stalled. This keeps the budget for the hiccups hedging cures.
    require_silence: bool = True


class _Quantile:
    """A quantile of the last ``window`` samples, re-sorted every tenth of a window."""

    __slots__ = ("cached", "fresh", "samples")

    def __init__(self, window: int) -> None:
        self.samples: deque[float] = deque(maxlen=window)
        self.cached = 0.0
        self.fresh = 0  # samples since the quantile was computed

    def add(self, value: float) -> None:
        self.samples.append(value)
        self.fresh += 1

    def get(self, q: float, window: int) -> float:
        # Recomputed every tenth of the window: the sort stays off the per-request path.
        if self.fresh * 10 >= window or self.cached == 0.0:
            s = sorted(self.samples)
            self.cached = s[min(len(s) - 1, int(q * len(s)))]
            self.fresh = 0
        return self.cached


class Hedger:
    """Per-pool hedging decisions: delay per GPU class, budget, counts."""

    def __init__(self, config: HedgeConfig) -> None:
        self.config = config
        self.credit = 1.0
        self.lent = 0.0  # what this replica may borrow of the others' credit (shared state)
        self.requests = 0
        self.hedges = 0
        self.wins = 0  # hedges whose copy produced the first token first
        self._ttft: dict[str, _Quantile] = {}  # GPU class -> TTFTs
        self._ratio: dict[str, _Quantile] = {}  # GPU class -> observed / expected TTFT
        self._progress: dict[str, float] = {}  # node id -> last first token or finish

    def on_request(self) -> None:
        """Every request routed (not hedges): earns budget credit."""
        self.requests += 1
        c = self.credit + self.config.budget
        self.credit = c if c < self.config.burst else self.config.burst

    def on_ttft(self, gpu_class: str, ttft: float, expected: float | None = None) -> None:
        """A first token ``ttft`` after dispatch on a node of ``gpu_class``;
        ``expected``: its expected TTFT (``Ticket.expected_ttft``), when known."""
        w = self.config.window
        q = self._ttft.get(gpu_class)
        if q is None:
            q = self._ttft[gpu_class] = _Quantile(w)
        q.add(ttft)
        if expected is not None and expected > 0.0:
            r = self._ratio.get(gpu_class)
            if r is None:
                r = self._ratio[gpu_class] = _Quantile(w)
            r.add(ttft / expected)

    def hedge_after(self, gpu_class: str, expected: float | None = None) -> float | None:
        """Seconds without a first token before a hedge; None: not enough data yet.

        ``expected``: the request's expected TTFT, for ``per_request`` delays
        (never later than the class's TTFT quantile, which is used alone
        without it or before enough ratios).
        """
        cfg = self.config
        if cfg.after_s > 0.0:
            return cfg.after_s
        q = self._ttft.get(gpu_class)
        if q is None or len(q.samples) < cfg.min_samples:
            return None
        after = q.get(cfg.quantile, cfg.window)
        if cfg.per_request and expected is not None and expected > 0.0:
            r = self._ratio.get(gpu_class)
            if r is not None and len(r.samples) >= cfg.min_samples:
                own = expected * r.get(cfg.quantile, cfg.window)
                if own < after:
                    after = own
        return after if after > cfg.min_after_s else cfg.min_after_s

    def on_progress(self, node_id: str, now: float) -> None:
        """A first token or a finish on ``node_id``: the node is not stalled."""
        self._progress[node_id] = now

    def silent(self, node_id: str, now: float, after: float,
               gpu_class: str | None = None, overdue: float | None = None) -> bool:
        """Whether ``node_id`` produced nothing for ``after`` seconds.

        With ``gpu_class``, for the class's TTFT quantile instead when it is
        known: silence is the node's property, so it is judged by one delay per
        class even when each request's own delay depends on its prompt (a short
        prompt's delay is shorter than the gaps a busy, healthy node leaves
        between first tokens). ``overdue``: the node's
        :meth:`~tailguard.core.fleet.Node.overdue_s`; at 0 none of its prompts
        is late, so a quiet node is idle or merely between answers, not stalled.
        """
        if not self.config.require_silence:
            return True
        if overdue is not None and overdue <= 0.0:
            return False
        if gpu_class is not None:
            q = self._ttft.get(gpu_class)
            if q is not None and len(q.samples) >= self.config.min_samples:
                after = q.get(self.config.quantile, self.config.window)
        return now - self._progress.get(node_id, -1e18) >= after

    def try_hedge(self) -> bool:
        """Spend one credit for a hedge, if there is one (borrowed ones included)."""
        if self.credit + self.lent < 1.0:
            return False
        self.credit -= 1.0
        self.hedges += 1
        return True

    def refund(self) -> None:
        """The hedge :meth:`try_hedge` paid for could not go anywhere: not spent."""
        self.credit += 1.0
        self.hedges -= 1

