"""Mid-stream migration: when a stream that has started moves to another node.

A committed stream is tied to its node until it ends. When that node stalls
(a thermal event, a hung tensor-parallel rank, an engine pause), dies, or is
found to be a straggler, the client waits or gets half an answer. Migration
sends a *continuation* to another node: the original prompt plus the answer
so far, asking for what is left of ``max_tokens``; the driver splices its
tokens into the same response (:class:`~tailguard.core.exchange.Exchange`
owns the decision, the drivers the bytes).

Triggers (:class:`MigrationConfig`):

* **failure** after the first byte: a reset, an engine error event, an idle
  timeout. Without migration the client gets an SSE error event.
* **stall**: no token for ``stall_factor`` times the stream's expected time per
  token, never less than ``stall_floor_s``. The stalled copy keeps running and
  races its continuation: whichever sends the next token first wins and the
  other is cancelled, so a stall that ends on its own costs one cancelled
  prefill, never a worse answer.
* **node left healthy service** while the stream ran: its node turned
  quarantined or down, or degraded after the stream began, and at least
  ``min_remaining_tokens`` are left to generate (a short remainder finishes
  sooner where it is than a re-prefill elsewhere takes).

Bounds: ``max_per_request`` continuations per request, and a budget of
``budget`` continuations per request arrived (plus ``min_per_s`` per second,
as the retry budget), so a fleet-wide slowdown cannot become a storm of
re-prefills.

Worked example (the defaults): a stream on an A100 whose expected time per
token is 25 ms stalls. 10 x 25 ms = 0.25 s is under the 1 s floor, so the
stall trigger fires 1 s after its last token; a continuation of a 900-token
prompt with 300 tokens answered is a 1,200-token prefill elsewhere (about
0.1 s on an H100), so the client's longest gap is about 1.1 s instead of the
stall's length. The floor is what keeps healthy streams still: in the
simulator's healthy hour no stream of any GPU class went 1 s without a token
(benchmarks/README.md, "Migration").

Dynamo migrates on worker failure only (``--migration-limit``); no router
moves a stream because its node became a straggler.
"""

from __future__ import annotations

from dataclasses import dataclass

from tailguard.core.fleet import NodeState
from tailguard.core.retry_budget import RetryBudget

# Node states that end a stream's stay: no new request goes there either.
LEAVE_NOW = frozenset({NodeState.QUARANTINED, NodeState.DOWN})


@dataclass(frozen=True, slots=True)
class MigrationConfig:
    """When a started stream moves to another node (see the module docstring)."""

    enabled: bool = True
    on_failure: bool = True  # a stream that fails after its first byte
    on_stall: bool = True  # no token for stall_after_s
    on_node_state: bool = True  # its node was quarantined, or degraded while it streamed
    stall_factor: float = 10.0  # times the stream's expected time per token
    stall_floor_s: float = 1.0
    min_remaining_tokens: int = 64  # for a move because of its node's state
    max_per_request: int = 2
    budget: float = 0.05  # continuations per request arrived
    min_per_s: float = 1.0

    def new_budget(self) -> RetryBudget:
        return RetryBudget(self.budget, self.min_per_s)


__all__ = ["LEAVE_NOW", "MigrationConfig"]
