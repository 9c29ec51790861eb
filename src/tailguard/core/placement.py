"""Where a request of a queued pool may go now, and where it should wait instead.

A pool with an admission queue (:mod:`tailguard.core.admission`) dispatches a
request at once only to a node that can still meet its TTFT budget; the others
are excluded from the pick, and the request waits in the queue for a permit or
a first token to free one (late binding). Two checks, per node:

* the **backlog**: the prompts queued ahead of it on the node, and its own,
  prefilled at the roofline's speed times the class's learned slowdown, but
  never faster than chunked prefill allows beside the node's running decodes;
* the **priority share** (Netflix concurrency-limits' partitioned limiter):
  lower priorities see part of each node's limit and of the budget (normal
  90%, low 80%), so a high-priority request always finds room and a short
  backlog. The reserve holds only while higher priorities have arrived
  lately: a pool of normal requests alone uses the whole limit.

A node that would miss the budget even idle is excluded too, while some node
could meet it: a long prompt waits for a node that can serve it rather than
land on a slow one, where it would miss anyway and stall the decode steps of
everything running there.

Worked example: an H100 decoding 32 sequences, TPOT SLO 100 ms, limit target
0.9, so a step may take 90 ms; if the step's chunk budget beside 32 decodes is
2,048 tokens, a backlog of 6,000 tokens plus a 2,000-token prompt takes
``ceil(8000 / 2048) = 4`` such steps, 0.36 s, even where the roofline's
prefill alone says 0.1 s: a request with 0.3 s of TTFT budget left waits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tailguard.core.fleet import Node
from tailguard.core.pool import Pool
from tailguard.core.predict import prefill_s

# Share of each node's concurrency limit and of the TTFT budget that requests
# of priority high, normal, low may use when their pool has a queue.
PRIORITY_SHARE = (1.0, 0.9, 0.8)

# (node, decoding sequences, context / 64) -> the chunk a step may carry.
ChunkCache = dict[tuple[str, int, int], int]


def unsuitable(pool: Pool, prompt_tokens: int, priority: int, budget_s: float,
               exclude: Sequence[str], now: float, chunks: ChunkCache) -> Sequence[str]:
    """``exclude`` plus the nodes a queued-pool request should not go to now
    (see the module docstring); ``chunks`` caches chunk budgets across calls."""
    p = min(max(priority, 0), 2)
    share = PRIORITY_SHARE[p]
    queue = pool.queue
    if share < 1.0 and queue is not None and not any(
            queue.arrival_rate(q, now) > 0.01 for q in range(p)):
        share = 1.0
    budget = budget_s * share
    out: list[str] | None = None
    hopeless: list[str] = []  # would miss the budget even idle
    capable = False
    for n in pool.eligible():
        if n.id in exclude:
            continue
        slow = n.class_prefill_slowdown
        if prefill_s(n.perf, 0, prompt_tokens) * slow > budget:
            hopeless.append(n.id)
            continue
        capable = True
        lim = n.limiter
        # The reserve is a number of permits sized on the limit the node
        # is headed for, so it does not shrink while slow start ramps.
        full = (lim is not None and share < 1.0
                and lim.inflight >= lim.allowed - (1.0 - share) * lim.ceiling)
        if full or backlog_prefill_s(pool, n, prompt_tokens, chunks) > budget:
            if out is None:
                out = list(exclude)
            out.append(n.id)
    if capable and hopeless:
        if out is None:
            out = list(exclude)
        out.extend(hopeless)
    return exclude if out is None else out


def backlog_prefill_s(pool: Pool, n: Node, prompt_tokens: int, chunks: ChunkCache) -> float:
    """Time to prefill ``n``'s prompt backlog and this prompt, for the TTFT check.

    The roofline's prefill times the class's learned slowdown, but never
    faster than chunked prefill allows: with ``d`` sequences decoding, a
    step that keeps the TPOT target carries at most the chunk
    :meth:`PerfModel.chunk_budget_for_tpot` gives, so the backlog takes
    ``ceil(tokens / chunk)`` such steps. The slowdown learned from a cold
    node's first wave (prefilled alone, no decodes) cannot see this.
    """
    backlog = n.fleet_backlog
    tokens = backlog + prompt_tokens
    t = prefill_s(n.perf, backlog, prompt_tokens) * n.class_prefill_slowdown
    decoding = n.fleet_in_flight - n.prefilling
    if decoding <= 0:
        return t
    cfg = pool.config
    step = (cfg.limits.target if cfg.limits is not None else 0.9) * cfg.slo.tpot_s
    ctx = pool.mean_prompt + pool.mean_output * 0.5
    key = (n.id, decoding, int(ctx) >> 6)
    chunk = chunks.get(key)
    if chunk is None:
        chunk = n.perf.chunk_budget_for_tpot(step, decoding, ctx)
        if len(chunks) > 4096:
            chunks.clear()
        chunks[key] = chunk
    if chunk <= 0:
        return t
    return max(t, math.ceil(tokens / chunk) * step)


__all__ = ["PRIORITY_SHARE", "backlog_prefill_s", "unsuitable"]
