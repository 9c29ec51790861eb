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
* **stall**: no token for ``stall_factor`` times the longest step its node's
  engine takes when healthy (a decode step that carries a full prompt chunk:
  every stream in it waits that long, and that is no stall), never less than
  ``stall_floor_s``. The stalled copy keeps running and
  races its continuation: whichever sends the next token first wins and the
  other is cancelled, so a stall that ends on its own costs one cancelled
  prefill, never a worse answer.
* **node left service** while the stream ran: its node turned quarantined or
  down (the balancer sends it nothing new either), at least
  ``min_remaining_tokens`` are left to generate, and the move is expected to
  end the answer sooner: what is left at the stream's own pace so far, against
  the pick's predicted first token and pace for it (a hang that has ended
  leaves its node quarantined with streams flowing fast again: moving those
  into a fleet the hang left overloaded made gaps of 10-20 s in the simulator's
  hung-rank runs). Such a stream still flows, so the old copy's next chunk is
  no sign of recovery: it is cut there and the continuation goes on (the stall
  race does not apply). With ``on_degraded``,
  also a node degraded after the stream began: off by default, because a
  degraded node is still serving at a lower weight and moving all its streams
  at once is a burst of re-prefills on the others (a TP-4 replica with one GPU
  at half speed: the fleet's TTFT p99 1.10x with it on against 1.04x off,
  tests/sim/test_gpu_faults.py's fleet).

Bounds: ``max_per_request`` continuations per request, and a budget of
``budget`` continuations per request arrived (plus ``min_per_s`` per second,
as the retry budget) that starts with ``burst`` saved and saves no more, so
that one node's batch can move at once when it dies while a fleet-wide
slowdown, or a node that stalls again and again, cannot become a storm of
re-prefills.

``engine_priority`` (off by default): continuations ask their engine to serve
them ahead of new prompts (vLLM's priority scheduling, which the engine must be
started with). Where a fault leaves the fleet overloaded, a continuation
otherwise waits behind every queued new prompt: in the simulator's hung-rank
runs the worst gap fell from 11.7 s to 3.2 s with it (benchmarks/README.md).

Worked example (the defaults, Llama-3.1-8B): an A100's longest healthy step
(64 streams decoding and a 2,048-token prompt chunk) is about 0.16 s, so a
stream there counts as stalled after 4 x 0.16 = 0.63 s without a token; an
L4's is 0.40 s (1.6 s), an H100's 0.05 s (the 0.5 s floor). A continuation of
a 900-token prompt with 300 tokens answered is a 1,200-token prefill elsewhere
(0.03 s on an idle H100 by the roofline, 0.09 s on an A100), so the client's
longest gap is about 0.7 s instead of the stall's length (live, emulated
A100s frozen for 10 s: 0.53-0.56 s with these short prompts, at the floor). In the simulator's healthy hour (H100, A100, L4
and T4 at load 0.8) no stream went 0.25 s without a token, so the trigger
moves nothing there (benchmarks/README.md, "Migration").

Dynamo migrates on worker failure only (``--migration-limit``); no router
moves a stream because its node became a straggler.
"""

from __future__ import annotations

from dataclasses import dataclass

from tailguard.core.fleet import NodeState
from tailguard.core.retry_budget import RetryBudget

# Node states that end a stream's stay: no new request goes there either.
LEAVE_NOW = frozenset({NodeState.QUARANTINED, NodeState.DOWN})
# The most of its class's learned decode slowdown a stall trigger allows for. A
# class of one node learns its slowdown from that node alone, so a node that
# hangs could teach its own trigger to wait through its hangs. A guard: in the
# simulator's hung-rank runs (a TP-2 H100 alone in its class) the results were
# the same with and without it.
STALL_SLOWDOWN_CAP = 3.0


@dataclass(frozen=True, slots=True)
class MigrationConfig:
    """When a started stream moves to another node (see the module docstring)."""

    enabled: bool = True
    on_failure: bool = True  # a stream that fails after its first byte
    on_stall: bool = True  # no token for stall_after_s
    on_node_state: bool = True  # its node was quarantined or went down while it streamed
    on_degraded: bool = False  # ... or was degraded while it streamed
    stall_factor: float = 4.0  # times the longest step its engine takes when healthy
    stall_floor_s: float = 0.5
    min_remaining_tokens: int = 64  # for a move because of its node's state
    max_per_request: int = 2
    budget: float = 0.02  # continuations per request arrived
    min_per_s: float = 1.0
    # Continuations that may go at once: a node's whole batch when it dies or hangs.
    # The budget starts with this much and saves up no more.
    burst: int = 200
    # The gateway marks a move in the stream with an SSE comment, which clients
    # skip (off: a plain OpenAI stream).
    announce: bool = False
    # The ``priority`` a continuation asks its engine for, ahead of new prompts
    # (vLLM started with ``--scheduling-policy priority``: lower goes first, 0 is
    # the default; an engine without it refuses the field). None: not sent.
    engine_priority: int | None = None

    def new_budget(self) -> RetryBudget:
        budget = RetryBudget(self.budget, self.min_per_s, cap=float(self.burst))
        budget.balance = float(self.burst)
        return budget


__all__ = ["LEAVE_NOW", "STALL_SLOWDOWN_CAP", "MigrationConfig"]
