"""Hedged requests: when to send a duplicate, and the budget that caps them.

From "The Tail at Scale" (Dean and Barroso, 2013): if a request has no answer
after the 95th percentile of its class's recent latency, send one duplicate
to another replica; the first to answer wins and the other is cancelled. A
hedge sent at p95 adds about 5% requests and removes most of the tail that
comes from one replica's hiccup (a stall, a GC pause, a slow link); their
example cut a 1000-key read's p99.9 from 1800 ms to 74 ms for 2% more
requests.

For LLM serving the "answer" is the **first token**: the hedge fires when a
request has produced no first token after ``hedge_after`` (a fixed value, or
the recent ``quantile`` (p95) of the TTFT of the GPU class of the node it went
to), and never once a byte reached the client (the drivers enforce it: a
streamed answer is committed at its first chunk). Whichever copy produces the
first token wins; the driver cancels the other (closes its connection,
releases its permit with ``CLIENT_CANCELLED``).

Refinement (``require_silence``, on by default): the hedge also waits until
the request's *node* has produced nothing (no first token, no finish) for
``hedge_after``. A request slow because its node is busy with a long queue
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

Worked example: an A100 class whose last 200 TTFTs have p95 0.18 s; a request
dispatched to an A100 at t = 10.00 with no first token at t = 10.18 gets a
hedge if the credit is >= 1 (after 20 requests without hedges it is 1.0).

This class is the decision only; the simulator (:mod:`tailguard.sim.hedge`)
and the gateway (:mod:`tailguard.gateway.hedge`) implement the duplicate and
cancel mechanics around it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HedgeConfig:
    """Hedging of one pool (off by default)."""

    enabled: bool = False
    after_s: float = 0.0  # fixed delay; 0: the class's recent TTFT quantile
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


class _ClassTtft:
    __slots__ = ("cached", "fresh", "samples")

    def __init__(self, window: int) -> None:
        self.samples: deque[float] = deque(maxlen=window)
        self.cached = 0.0
        self.fresh = 0  # samples since the quantile was computed


class Hedger:
    """Per-pool hedging decisions: delay per GPU class, budget, counts."""

    def __init__(self, config: HedgeConfig) -> None:
        self.config = config
        self.credit = 1.0
        self.requests = 0
        self.hedges = 0
        self.wins = 0  # hedges whose copy produced the first token first
        self._classes: dict[str, _ClassTtft] = {}
        self._progress: dict[str, float] = {}  # node id -> last first token or finish

    def on_request(self) -> None:
        """Every request routed (not hedges): earns budget credit."""
        self.requests += 1
        c = self.credit + self.config.budget
        self.credit = c if c < self.config.burst else self.config.burst

    def on_ttft(self, gpu_class: str, ttft: float) -> None:
        cls = self._classes.get(gpu_class)
        if cls is None:
            cls = self._classes[gpu_class] = _ClassTtft(self.config.window)
        cls.samples.append(ttft)
        cls.fresh += 1

    def hedge_after(self, gpu_class: str) -> float | None:
        """Seconds without a first token before a hedge; None: not enough data yet."""
        cfg = self.config
        if cfg.after_s > 0.0:
            return cfg.after_s
        cls = self._classes.get(gpu_class)
        if cls is None or len(cls.samples) < cfg.min_samples:
            return None
        # Recomputed every tenth of the window: the sort stays off the per-request path.
        if cls.fresh * 10 >= cfg.window or cls.cached == 0.0:
            s = sorted(cls.samples)
            cls.cached = s[min(len(s) - 1, int(cfg.quantile * len(s)))]
            cls.fresh = 0
        return max(cls.cached, cfg.min_after_s)

    def on_progress(self, node_id: str, now: float) -> None:
        """A first token or a finish on ``node_id``: the node is not stalled."""
        self._progress[node_id] = now

    def silent(self, node_id: str, now: float, after: float) -> bool:
        """Whether ``node_id`` produced nothing for ``after`` seconds."""
        if not self.config.require_silence:
            return True
        return now - self._progress.get(node_id, -1e18) >= after

    def try_hedge(self) -> bool:
        """Spend one credit for a hedge, if there is one."""
        if self.credit < 1.0:
            return False
        self.credit -= 1.0
        self.hedges += 1
        return True
