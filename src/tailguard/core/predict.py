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


# The per-step token budget of an engine's chunked prefill: vLLM's default
# max_num_batched_tokens (the decodes' tokens come out of it).
PREFILL_CHUNK_TOKENS = 2048


def prefill_extra_s(perf: PerfModel, prompt: int, batch: int, mean_ctx: float,
                    chunk: int = PREFILL_CHUNK_TOKENS) -> float:
    """What computing a ``prompt`` beside ``batch`` decodes adds to their steps.

    The prompt rides along in chunks of what the step's token budget leaves;
    each chunk costs the step it joins its marginal time, which is less than
    the chunk alone would take where the decode step was memory-bound (its
    compute fits in the time the weights take to stream). A short prompt beside
    a memory-bound batch is nearly free; a long one costs its compute.
    """
    return prefill_chunks(perf, prompt, batch, mean_ctx, chunk)[0]


def prefill_chunks(perf: PerfModel, prompt: int, batch: int, mean_ctx: float,
                   chunk: int = PREFILL_CHUNK_TOKENS) -> tuple[float, int, float, float]:
    """:func:`prefill_extra_s`, the chunks (engine steps) it takes, the decode step
    each of them joins, and the share of a step its last full chunk takes over
    the share its first does (a chunk attends to the prompt before it, so an
    engine computing a long prompt spends a growing share of its time on it)."""
    if batch < 1:
        batch = 1
    ctx = batch * mean_ctx
    base = perf.step_time(batch, ctx)
    if prompt <= 0:
        return 0.0, 0, base, 1.0
    budget = chunk - batch if chunk - batch > 1 else 1
    total, done, n, first = 0.0, 0, 0, 0.0
    while done < prompt:
        p = prompt - done if prompt - done < budget else budget
        cost = perf.step_time(batch, ctx, p, done + p, p * (done + p * 0.5)) - base
        if n == 0:
            first = cost  # a full chunk where there are two or more
        total += cost
        done += p
        n += 1
    if n < 2:
        return total, n, base, 1.0
    at = prompt - budget
    last = perf.step_time(batch, ctx, budget, at + budget, budget * (at + budget * 0.5)) - base
    ramp = (last / (base + last)) / (first / (base + first)) if first > 0.0 else 1.0
    return total, n, base, ramp


def saturated_step_s(perf: PerfModel, batch: int, mean_ctx: float,
                     chunk: int = PREFILL_CHUNK_TOKENS) -> float:
    """A decode step of ``batch`` sequences that also carries a full prompt chunk:
    what every token takes on an engine that always has prompts waiting."""
    if batch < 1:
        batch = 1
    p = chunk - batch if chunk - batch > 1 else 1
    return perf.step_time(batch, batch * mean_ctx, p, p, p * p * 0.5)


def interleaved_tpot(step: float, duty: float, saturated: float) -> float:
    """Time per output token of a decode that shares the engine with prompts.

    An engine that batches prompts (chunked prefill) with the running decodes
    computes them between decode tokens: over a time ``T`` holding ``W`` seconds
    of prompt work, ``N`` decode steps of ``step`` seconds fit in ``T - W``, so
    each token takes ``T / N = step / (1 - duty)`` with ``duty = W / T``, and at
    most ``saturated`` (:func:`saturated_step_s`: every step carries a chunk), which
    is where an engine that has more prompts than time ends. The roofline step
    alone holds at any rate of arrivals; measured per-token times do not: a node
    given a peer's spilled load runs its decodes at the same batch but slower,
    which neither the router nor the outlier detector may read as the node's own
    speed. ``duty`` comes from ``Node.duty`` (the router) or the
    work computed during a decode (the learner and the detector); the work is each prompt's
    :func:`prefill_extra_s`, so a prompt riding in a memory-bound step's spare
    compute costs what it adds, not its own time.
    """
    if duty <= 0.0:
        return step
    cap = saturated if saturated > step else step
    if duty >= 1.0:
        return cap
    t = step / (1.0 - duty)
    return t if t < cap else cap
