"""A node's load as this gateway counts it: requests in flight, still prefilling,
decoding, and the prompt tokens waiting for their first token.

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
    FIELDS: ClassVar[tuple[str, ...]] = ("decoding", "dispatched_total", "in_flight", "prefill_backlog",
              "prefill_tokens_total", "prefilling")

    in_flight: int  # dispatched and not yet released
    prefilling: int  # ... of which still waiting for their first token
    prefill_backlog: int  # their prompt tokens the engine must compute (uncached part)
    decoding: int  # ... of which past their first token
    dispatched_total: int
    prefill_tokens_total: int  # prompt tokens ever dispatched here

    def _init_load(self) -> None:
        self.in_flight = self.prefilling = self.prefill_backlog = self.decoding = 0
        self.dispatched_total = self.prefill_tokens_total = 0

    def dispatched(self, backlog: int, prompt_tokens: int) -> None:
        """A request was sent here with ``backlog`` prompt tokens to compute."""
        self.in_flight += 1
        self.prefilling += 1
        self.prefill_backlog += backlog
        self.prefill_tokens_total += prompt_tokens
        self.dispatched_total += 1

    def prompt_done(self, backlog: int) -> None:
        """A request's prompt is computed (its first token, seen or presumed)."""
        self.prefilling -= 1
        self.prefill_backlog -= backlog
        self.decoding += 1

    def released(self, backlog: int, prefilling: bool) -> None:
        """A request ended; ``prefilling``: before its prompt was done."""
        self.in_flight -= 1
        if prefilling:
            self.prefilling -= 1
            self.prefill_backlog -= backlog
        else:
            self.decoding -= 1
