"""`tailguard plan`: engine batch settings per GPU type from the roofline model.

For each (GPU, TP degree) of a fleet and one model, with the workload's
typical prompt and answer lengths:

* KV capacity in tokens (``PerfModel.kv_capacity_tokens``: 90% of HBM minus
  weights and an activation reserve, over the model's KV bytes per token);
* the largest batch whose step, with its steady-state share of chunked
  prefill, keeps the TPOT SLO (:func:`tailguard.core.limits.planned_limit`),
  capped by KV capacity: the engine's ``--max-num-seqs``;
* the same at ``target`` (0.9) of the SLO: the gateway's initial per-node
  concurrency limit, which then adapts (``limits: {kind: gradient}``);
* the chunked-prefill token budget that keeps a step of that batch within
  the SLO (Sarathi-Serve's rule; ``docs/sources.md``): ``--max-num-batched-tokens``;
* throughput at the SLO: ``batch / step`` tokens/s, over the mean answer
  length requests/s, and the group's share of the fleet's.

Worked example (llama-3.1-8b, SLO TPOT 0.1 s, 1,000-token prompts and
200-token answers): an L4 streams its 16 GB of weights in ~71 ms a step, so
only a handful of sequences fit in the remaining ~25 ms while an H100-SXM,
at ~7 ms a step, fills its KV capacity first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tailguard.core.hardware import DEFAULT_PERF, GPU, Model, PerfModel, PerfParams
from tailguard.core.limit_plan import planned_limit
from tailguard.engine import EngineConfig

# vLLM refuses a token budget below its sequence limit; a budget under a few
# dozen tokens makes prefill crawl for no TPOT gain.
MIN_CHUNK_TOKENS = 64


@dataclass(frozen=True, slots=True)
class GroupPlan:
    gpu: str
    tp: int
    nodes: int
    fits: bool
    memory_needed_gb: float
    kv_capacity_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int
    initial_limit: int
    tpot_at_batch_s: float
    tokens_per_s: float
    requests_per_s: float
    share: float


def _step(perf: PerfModel, batch: int, input_tokens: float, output_tokens: float) -> float:
    ctx = input_tokens + output_tokens * 0.5
    p = batch * input_tokens / max(output_tokens, 1.0)
    return perf.step_time(batch, batch * ctx, int(p), p, p * p * 0.5)


@dataclass(frozen=True, slots=True)
class EnginePlan:
    """What the roofline says one replica should run with at the TPOT SLO."""

    max_num_seqs: int
    max_num_batched_tokens: int
    initial_limit: int
    tpot_at_batch_s: float
    tokens_per_s: float
    # vLLM's --long-prefill-token-threshold (0: none): the most prompt tokens one
    # request computes in a step. The roofline cannot tell when it pays; the
    # inventory planner measures it (formation.Rater).
    long_prefill_token_threshold: int = 0

    @property
    def engine(self) -> EngineConfig:
        """The engine settings it stands for (chunked prefill on)."""
        return EngineConfig(max_num_seqs=self.max_num_seqs,
                            max_num_batched_tokens=self.max_num_batched_tokens,
                            long_prefill_token_threshold=self.long_prefill_token_threshold)

    @property
    def prompt_budget(self) -> int:
        """The step's tokens left to prompts when every sequence decodes."""
        return self.max_num_batched_tokens - self.max_num_seqs


def engine_plan(perf: PerfModel, slo_tpot: float, input_tokens: float, output_tokens: float,
                target: float = 0.9, max_seqs: int = 1024) -> EnginePlan:
    """The batch, token budget and gateway limit of one replica (see the module docstring)."""
    batch = planned_limit(perf, slo_tpot, input_tokens, output_tokens, max_seqs)
    initial = planned_limit(perf, slo_tpot * target, input_tokens, output_tokens, max_seqs)
    ctx = input_tokens + output_tokens * 0.5
    chunk = perf.chunk_budget_for_tpot(slo_tpot, batch, ctx)
    step = _step(perf, batch, input_tokens, output_tokens)
    return EnginePlan(batch, batch + max(chunk, MIN_CHUNK_TOKENS), initial, step, batch / step)


def plan_groups(groups: Sequence[tuple[GPU, int, int]], model: Model, slo_tpot: float,
                input_tokens: float, output_tokens: float, target: float = 0.9,
                max_seqs: int = 1024, params: PerfParams = DEFAULT_PERF) -> list[GroupPlan]:
    """Plan each ``(gpu, tp, node count)`` group; shares are of the fleet's requests/s."""
    plans: list[GroupPlan] = []
    for gpu, tp, count in groups:
        perf = PerfModel(gpu, model, tp, params)
        if not perf.fits:
            plans.append(GroupPlan(gpu.name, tp, count, False, perf.memory_needed_gb,
                                   perf.kv_capacity_tokens, 0, 0, 0, 0.0, 0.0, 0.0, 0.0))
            continue
        e = engine_plan(perf, slo_tpot, input_tokens, output_tokens, target, max_seqs)
        plans.append(GroupPlan(gpu.name, tp, count, True, perf.memory_needed_gb,
                               perf.kv_capacity_tokens, e.max_num_seqs, e.max_num_batched_tokens,
                               e.initial_limit, e.tpot_at_batch_s, e.tokens_per_s,
                               e.tokens_per_s / max(output_tokens, 1.0), 0.0))
    total = sum(p.requests_per_s * p.nodes for p in plans)
    return [
        GroupPlan(**{**{f: getattr(p, f) for f in GroupPlan.__slots__},
                     "share": p.requests_per_s * p.nodes / total if total > 0 else 0.0})
        for p in plans
    ]


def vllm_flags(p: GroupPlan) -> str:
    return (f"--tensor-parallel-size {p.tp} --max-num-seqs {p.max_num_seqs} "
            f"--max-num-batched-tokens {p.max_num_batched_tokens} --enable-chunked-prefill")


def sglang_flags(p: GroupPlan) -> str:
    return (f"--tp {p.tp} --max-running-requests {p.max_num_seqs} "
            f"--chunked-prefill-size {max(p.max_num_batched_tokens - p.max_num_seqs, 1)}")
