"""tailguard: route each request to the node where it would finish earliest, within the SLO.

For every eligible node the policy predicts this request's time to first token
and time per output token *there*, from the node's roofline prior corrected by
what the node has measurably delivered (:class:`~tailguard.core.estimate.CapacityEstimate`)
and from its live load as the gateway counts it:

* batch after admission ``b = in_flight + 1``; the engine runs at most
  ``slots = min(max_num_seqs, KV capacity / tokens per request)`` at once,
  so a node with free slots admits at once while a full one queues;
* ``tpot = step_time(min(b, slots) sequences) * decode_slowdown``, the
  slowdown learned for the node's GPU class (:mod:`tailguard.core.predict`);
* ``ttft = (prompt tokens ahead + this prompt) * prefill cost per token
  * prefill_slowdown + one step``, plus, when the node is full, the time for
  ``b - slots`` requests to drain at ``slots`` per service time;
* finish time ``e2e = ttft + expected_output * tpot``.

The node with the earliest predicted finish wins, among the nodes that keep
both SLOs (with ``slo_headroom``, default 0.9). The finish time weighs TTFT by
``ttft_weight``; its default (``"slo"``) is ``expected_output * slo_tpot /
slo_ttft``, which makes the cost ``out*tpot + w*ttft`` proportional to
``tpot/slo_tpot + ttft/slo_ttft``: a second of waiting for the first token
counts as much, in SLO terms, as the decode time it is compared with. Without
it the router would happily trade a long first-token wait for a slightly
faster decode, which users notice more and which the TTFT SLO forbids. When no node keeps them, the
one that misses them by the least wins. A degraded node's finish time is
divided by its weight scale. With ``sample: k`` the policy looks at ``k``
random nodes instead of all of them (P2C-style), so several gateway replicas
do not herd on the same node.

Worked example (llama-3.1-8b, slo tpot 0.1 s): an idle L4 predicts a step of
75 ms, an H100 with 40 requests in flight a step of 12 ms; for a 200-token
answer the H100 finishes in ~2.4 s against ~15 s on the L4, so the H100 wins
until its own batch pushes its step near the L4's, or near the SLO.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from random import Random
from typing import Any

from tailguard.core.fleet import NodeView
from tailguard.core.policies.base import RequestInfo, Slo
from tailguard.core.predict import decode_step_s, prefill_s

# Cost added per unit of relative SLO excess: any node that keeps the SLO beats
# every node that does not, and among those that do not the smaller miss wins.
_VIOLATION_COST_S = 1e4


class TailguardPolicy:
    name = "tailguard"

    def __init__(self, slo: Slo | None = None, options: Mapping[str, Any] | None = None) -> None:
        opts = dict(options or {})
        self.slo = slo or Slo()
        self.sample = int(opts.pop("sample", 0))
        self.headroom = float(opts.pop("slo_headroom", 0.9))
        weight = opts.pop("ttft_weight", "slo")
        # "slo": weigh a second of TTFT against decode time as the SLOs do.
        self.ttft_weight = None if weight == "slo" else float(weight)
        if opts:
            raise ValueError(f"unknown tailguard policy option(s): {', '.join(sorted(opts))}")
        if self.sample == 1 or self.sample < 0:
            raise ValueError("sample must be 0 (all nodes) or >= 2")

    def choose(
        self, nodes: Sequence[NodeView], req: RequestInfo, now: float, rng: Random
    ) -> str | None:
        if not nodes:
            return None
        cands = nodes
        if self.sample and len(nodes) > self.sample:
            cands = rng.sample(list(nodes), self.sample)
        prompt = req.prompt_tokens
        out = req.expected_output
        if req.max_tokens is not None and req.max_tokens < out:
            out = float(req.max_tokens)
        out = max(out, 1.0)
        ctx = req.mean_prompt + out * 0.5
        footprint = req.mean_prompt + out
        ttft_weight = self.ttft_weight
        if ttft_weight is None:
            ttft_weight = out * self.slo.tpot_s / self.slo.ttft_s
        ttft_limit = self.slo.ttft_s * self.headroom
        tpot_limit = self.slo.tpot_s * self.headroom
        best_id: str | None = None
        best = float("inf")
        for n in cands:
            perf = n.perf
            slots = n.slots
            kv_slots = int(perf.kv_capacity_tokens / footprint)
            if kv_slots < slots:
                slots = kv_slots if kv_slots > 1 else 1
            batch = n.in_flight + 1
            running = batch if batch <= slots else slots
            tpot = decode_step_s(perf, running, ctx) * n.class_decode_slowdown
            ttft = prefill_s(perf, n.prefill_backlog, prompt) * n.class_prefill_slowdown + tpot
            if batch > slots:
                # Queued in the engine: wait for (batch - slots) of the running
                # requests to finish; they complete at about slots per service time.
                ttft += (batch - slots) * (ttft + out * tpot) / slots
            cost = (ttft_weight * ttft + out * tpot) / n.weight_scale
            excess = 0.0
            if ttft > ttft_limit:
                excess += ttft / ttft_limit - 1.0
            if tpot > tpot_limit:
                excess += tpot / tpot_limit - 1.0
            if excess:
                cost += excess * _VIOLATION_COST_S
            if cost < best:
                best, best_id = cost, n.id
        return best_id
