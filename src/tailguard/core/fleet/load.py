"""A node's load as this gateway counts it: requests in flight, still prefilling,
decoding, the prompt tokens waiting for their first token, and the context
its decodes attend to.

The counters change at three moments of a request and nowhere else:
:meth:`Load.dispatched` (a permit taken), :meth:`Load.prompt_done` (its first
token, seen or presumed) and :meth:`Load.released` (its end, whatever it was).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar


class Load:
    """Requests on the node (a part of :class:`~tailguard.core.fleet.Node`)."""

    if not TYPE_CHECKING:  # slots are the node's (mypy would take these as the part's)
        __slots__ = ()
    FIELDS: ClassVar[tuple[str, ...]] = (
        "area_t", "context_tokens", "ctx_area", "dec_area", "decoding", "dispatched_total",
        "in_flight", "prefill_backlog", "prefill_tokens_total", "prefilling")

    in_flight: int  # dispatched and not yet released
    prefilling: int  # ... of which still waiting for their first token
    prefill_backlog: int  # their prompt tokens the engine must compute (uncached part)
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

    def _init_load(self) -> None:
        self.in_flight = self.prefilling = self.prefill_backlog = self.decoding = 0
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

    def dispatched(self, backlog: int, prompt_tokens: int) -> None:
        """A request was sent here with ``backlog`` prompt tokens to compute."""
        self.in_flight += 1
        self.prefilling += 1
        self.prefill_backlog += backlog
        self.prefill_tokens_total += prompt_tokens
        self.dispatched_total += 1

    def prompt_done(self, backlog: int, prompt_tokens: int, now: float) -> None:
        """A request's prompt is computed (its first token, seen or presumed)."""
        self.areas_at(now)
        self.prefilling -= 1
        self.prefill_backlog -= backlog
        self.decoding += 1
        self.context_tokens += prompt_tokens

    def released(self, backlog: int, prefilling: bool, prompt_tokens: int, now: float) -> None:
        """A request ended; ``prefilling``: before its prompt was done."""
        self.in_flight -= 1
        if prefilling:
            self.prefilling -= 1
            self.prefill_backlog -= backlog
        else:
            self.areas_at(now)
            self.decoding -= 1
            self.context_tokens -= prompt_tokens
