"""A node's load as this gateway counts it: requests in flight, still prefilling,
decoding, the prompt tokens waiting for their first token, and the context
its decodes attend to.

The counters change at three moments of a request and nowhere else:
:meth:`Load.dispatched` (a permit taken), :meth:`Load.prompt_done` (its first
token, seen or presumed) and :meth:`Load.released` (its end, whatever it was).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

# The share of a node's KV cache its requests may need before the engine is short
# of it (vLLM preempts at 100%; the gateway's count of the answers is a mean).
KV_SHORT = 0.9
# Once it has room again, the engine recomputes the requests it preempted: prefill
# work the gateway never dispatched. A 100k-token context takes an H100 about 4 s
# (an L40S longer: where the engine reports a preemption, the node is given the
# time its roofline takes to compute the context it holds, Node.report_engine).
KV_RECOVERY_S = 5.0


class Load:
    """Requests on the node (a part of :class:`~tailguard.core.fleet.Node`)."""

    if not TYPE_CHECKING:  # slots are the node's (mypy would take these as the part's)
        __slots__ = ()
    FIELDS: ClassVar[tuple[str, ...]] = (
        "area_t", "awaiting_kv", "context_tokens", "ctx_area", "dec_area", "decoding",
        "dispatched_total", "in_flight", "kv_short_until", "prefill_backlog", "prefill_tokens_total",
        "prefilling")

    in_flight: int  # dispatched and not yet released
    prefilling: int  # ... of which still waiting for their first token
    prefill_backlog: int  # their prompt tokens the engine must compute (uncached part)
    # ... of which computed elsewhere (a disaggregated request's decode leg, the only
    # one with nothing to compute here): waiting for their KV, then one step
    awaiting_kv: int
    decoding: int  # ... of which past their first token
    dispatched_total: int
    prefill_tokens_total: int  # prompt tokens ever dispatched here
    # The prompts (whole, cached part included: a step reads all of their KV) of
    # the decoding requests, and the time integrals of it and of ``decoding``
    # up to ``area_t``: a decode that ran from t0 to t1 attended to
    # (ctx_area(t1) - ctx_area(t0)) / (dec_area(t1) - dec_area(t0)) prompt tokens
    # per sequence on average. A node the router gives the longest prompts
    # steps slower for it, and that is not the node being slow.
    context_tokens: int
    ctx_area: float
    dec_area: float
    area_t: float
    # Until when what the node times is a KV shortage's (the last time it was seen
    # short of KV cache, :meth:`kv_short`, and the recompute after).
    kv_short_until: float

    def _init_load(self) -> None:
        self.kv_short_until = -math.inf
        self.in_flight = self.prefilling = self.prefill_backlog = self.decoding = 0
        self.awaiting_kv = 0
        self.dispatched_total = self.prefill_tokens_total = 0
        self.context_tokens = 0
        self.ctx_area = self.dec_area = 0.0
        self.area_t = -1.0

    def areas_at(self, now: float) -> tuple[float, float]:
        """The integrals of the decodes' prompt tokens and of their count up to ``now``."""
        dt = now - self.area_t
        if dt > 0.0:
            if self.area_t >= 0.0:
                self.ctx_area += self.context_tokens * dt
                self.dec_area += self.decoding * dt
            self.area_t = now
        return self.ctx_area, self.dec_area

    def note_kv(self, now: float, answer_tokens: float, kv_tokens: int, scale: float) -> bool:
        """Whether the requests on the node (``scale`` times this gateway's: the
        fleet's) need ``KV_SHORT`` of its ``kv_tokens`` or more, their answers at
        ``answer_tokens`` each; if so, noted as of ``now``.

        An engine short of KV cache queues prompts and preempts decodes, which
        it then recomputes: a healthy H100 given more long prompts than its
        cache holds read 3-4x slow. That is the load's doing, not the node's,
        and the outlier detector leaves out what it timed (``kv_short_since``).
        """
        demand = (self.context_tokens + self.prefill_backlog + self.in_flight * answer_tokens) \
            * scale
        if demand >= KV_SHORT * kv_tokens:
            self.kv_short(now)
            return True
        return False

    def kv_short(self, at: float, recover_s: float = KV_RECOVERY_S) -> None:
        """The node was loaded past what it serves at ``at``: its engine reported
        requests waiting with its KV cache full, or a preemption, or the router
        spilled an overload here (every node of the pool predicted to miss the
        SLO; ``policies/tailguard.py``, "Overload"). What it times then, and for
        ``recover_s`` after (the recompute of what it preempted), is the load's."""
        if at + recover_s > self.kv_short_until:
            self.kv_short_until = at + recover_s

    def kv_short_since(self, since: float) -> bool:
        """Whether the node was seen short of KV cache at ``since`` or later, or so
        shortly before that it was still recomputing what it had preempted."""
        return self.kv_short_until >= since

    def dispatched(self, backlog: int, prompt_tokens: int) -> None:
        """A request was sent here with ``backlog`` prompt tokens to compute."""
        self.in_flight += 1
        self.prefilling += 1
        self.prefill_backlog += backlog
        if backlog == 0:
            self.awaiting_kv += 1
        self.prefill_tokens_total += prompt_tokens
        self.dispatched_total += 1

    def prompt_done(self, backlog: int, prompt_tokens: int, now: float) -> None:
        """A request's prompt is computed (its first token, seen or presumed)."""
        self.areas_at(now)
        self.prefilling -= 1
        self.prefill_backlog -= backlog
        if backlog == 0:
            self.awaiting_kv -= 1
        self.decoding += 1
        self.context_tokens += prompt_tokens

    def released(self, backlog: int, prefilling: bool, prompt_tokens: int, now: float) -> None:
        """A request ended; ``prefilling``: before its prompt was done."""
        self.in_flight -= 1
        if prefilling:
            self.prefilling -= 1
            self.prefill_backlog -= backlog
            if backlog == 0:
                self.awaiting_kv -= 1
        else:
            self.areas_at(now)
            self.decoding -= 1
            self.context_tokens -= prompt_tokens
