"""Limiter planning: each node's starting limit from its prior (the largest
batch whose step stays within the TPOT target), the algorithm a pool's
:class:`~tailguard.core.limits.LimitConfig` names, and the limiter a node gets
from its pools (the balancer sets it when a node joins or a pool reloads)."""

from __future__ import annotations

from collections.abc import Mapping

from tailguard.core.fleet import Node
from tailguard.core.hardware import PerfModel
from tailguard.core.limits import AimdLimit, FixedLimit, GradientLimit, Limit, LimitConfig, Limiter
from tailguard.core.pool import Pool
from tailguard.core.predict import decode_step_s, prefill_s


def planned_limit(perf: PerfModel, tpot_s: float, input_tokens: float, output_tokens: float,
                  cap: int = 4096) -> int:
    """Largest batch whose step, with its share of chunked prefill, stays within ``tpot_s``.

    In steady state every decode token of a request carries ``input/output``
    prompt tokens of other requests' prefill in the same steps, so a batch of
    ``B`` computes ``B * input/output`` prompt tokens a step on top of its
    decode. The result is capped by the KV cache (``kv tokens / (input +
    output)``) and by ``cap``; at least 1.
    """
    ctx = input_tokens + output_tokens * 0.5
    per_seq = input_tokens / max(output_tokens, 1.0)

    def step(b: int) -> float:
        p = b * per_seq
        return perf.step_time(b, b * ctx, int(p), p, p * p * 0.5)

    kv_cap = int(perf.kv_capacity_tokens / max(input_tokens + output_tokens, 1.0))
    hi = max(1, min(cap, kv_cap))
    if step(1) > tpot_s:
        return 1
    lo = 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if step(mid) <= tpot_s:
            lo = mid
        else:
            hi = mid - 1
    return lo


def make_limit(config: LimitConfig, initial: int, max_limit: int, tpot_slo: float,
               ttft_slo: float, floor_tpot: float = 0.0, cold_start: int | None = None) -> Limit:
    """Build the algorithm ``config.kind`` for one node.

    ``floor_tpot`` is the node's no-load TPOT from the prior (0: unknown),
    from which the gradient measures the batch's share of the TPOT.
    ``cold_start`` (None: none) is where the gradient's slow start begins.
    """
    lo = config.min_limit
    hi = max(lo, config.max_limit if config.max_limit is not None else max_limit)
    start = min(max(config.initial if config.initial is not None else initial, lo), hi)
    if config.kind == "fixed":
        return FixedLimit(start)
    if config.kind == "aimd":
        return AimdLimit(start, tpot_slo, lo, hi, config.backoff)
    return GradientLimit(start, config.target * tpot_slo, config.target * ttft_slo,
                         min_limit=lo, max_limit=hi, window=config.window,
                         update_every=config.update_every, smoothing=config.smoothing,
                         backoff=config.backoff, percentile=config.percentile,
                         floor_tpot=floor_tpot,
                         start=cold_start if config.slow_start else None)


def node_limiter(node: Node, pools: Mapping[str, Pool]) -> Limiter | None:
    """The node's limiter for the first of its pools with limits (None if none):
    planned from its prior (:func:`planned_limit`), capped by its slots and KV;
    a reloaded node's permits in flight stay counted."""
    for name in node.spec.models:
        pool = pools.get(name)
        if pool is None or not pool.limited:
            continue
        cfg = pool.config.limits or LimitConfig(kind="fixed")
        slo = pool.config.slo
        prompt = cfg.input_tokens if cfg.input_tokens is not None else pool.mean_prompt
        output = cfg.output_tokens if cfg.output_tokens is not None else pool.mean_output
        cap = min(node.slots, max(1, int(node.perf.kv_capacity_tokens / (prompt + output))))
        initial = planned_limit(node.perf, cfg.target * slo.tpot_s, prompt, output, cap)
        floor = decode_step_s(node.perf, 1, prompt + output * 0.5)
        # A cold node slow-starts (core/limits.py) from the typical prompts
        # it can prefill within the TTFT target, or half the plan when that
        # is more (one doubling, one request lifetime, to reach the plan);
        # a reloaded one is warm already.
        cold = None
        if node.limiter is None:
            wave = int(cfg.target * slo.ttft_s / prefill_s(node.perf, 0, prompt))
            cold = max(1, wave, initial // 2)
        limiter = Limiter(make_limit(cfg, initial, cap, slo.tpot_s, slo.ttft_s, floor, cold),
                          cfg.kv_full)
        if node.limiter is not None:  # a reload: permits in flight stay counted
            limiter.inflight = node.limiter.inflight
        return limiter
    return None
