"""Latency predictions shared by the router and the learner.

The router predicts a request's TTFT and TPOT on a node; the learner compares
what a finished request measured with what the *same* formulas predicted for
the conditions it met at dispatch. Keeping both in one place is what makes
the learned correction a property of the node's hardware class, not of a
mismatch between two formulas.

The correction is learned per node but *used* per GPU class (the geometric
mean over the class's nodes, see :meth:`Balancer.tick`): identical cards then
share one multiplier, so noise in one node's samples cannot make the router
herd onto its peer. A single node slow for its class is the outlier
detector's business, not the router's.

Worked example (A100, llama-3.1-8b, 40 sequences of ~1,100 tokens): the
roofline decode step is 20.6 ms; if the class has measured TPOTs 1.6 times
that (the prompts it computes between decode tokens), the router predicts
33 ms per token there.
"""

from __future__ import annotations

from tailguard.core.hardware import PerfModel


def prefill_token_s(perf: PerfModel) -> float:
    """Compute seconds per prompt token, excluding attention."""
    return perf.token_flop_s + perf.allreduce_token_s


def prefill_s(perf: PerfModel, tokens_ahead: float, prompt: float) -> float:
    """Compute time of the prompt tokens queued ahead plus this prompt's own."""
    return (tokens_ahead + prompt) * prefill_token_s(perf) + perf.attn_flop_s * prompt * prompt * 0.5


def running_batch(perf: PerfModel, slots: int, batch: int, footprint: float) -> int:
    """Sequences the engine runs at once when ``batch`` are in flight on the node.

    At most ``slots`` (``max_num_seqs``) and what the KV cache holds at
    ``footprint`` tokens per request; the rest wait in the engine. Router and
    learner both cap here: a learner that priced the step at the uncapped batch
    would, once a node queues, read it as faster than it is and invite more load.
    """
    kv_slots = int(perf.kv_capacity_tokens / footprint) if footprint > 0.0 else slots
    if kv_slots < slots:
        slots = kv_slots if kv_slots > 1 else 1
    return batch if batch <= slots else slots


def decode_step_s(perf: PerfModel, batch: int, mean_ctx: float) -> float:
    """Roofline time of one decode step of ``batch`` sequences of ``mean_ctx`` tokens."""
    return perf.step_time(batch, batch * mean_ctx)
