"""Pipeline-parallel replicas: a model's layers in stages, each on its own GPUs.

A PP replica splits the model's ``L`` layers into ``pp`` stages; stage ``s``
holds ``l_s`` layers on ``tp_s`` GPUs of one type (stages may differ in type:
an H100 and an A100 can serve one replica). Every token passes through every
stage in turn, so the stages are synchronous: the slowest sets the pace.

Timing of one iteration (every running sequence gets one token, the prompt
chunks advance), with ``m`` micro-batches in flight (vLLM keeps one per
virtual engine, ``m = pp``; never more than the sequences there are)::

    T_s  = t_s(batch / m) (+ send_s, or max(t_s, send_s) with overlap)
    step = overhead + max(m * max_s T_s, sum_s T_s)

``t_s`` is the roofline of :mod:`tailguard.core.hardware` for the stage's share
of the weights, KV cache and FLOPs (``l_s / L``, over its ``tp_s`` GPUs, plus
its own all-reduces); ``send_s`` moves a micro-batch's activations (tokens x
hidden x 2 bytes) to the next stage over the link between hosts
(``PerfParams.pp_link_gbps``). In steady state every stage works on one of the
``m`` micro-batches at a time, so each does its share ``m`` times per iteration
and the busiest one bounds the rate (``m * max``); a single micro-batch's trip
through all stages bounds it too (``sum``: the pipeline bubble, which sets the
step when there are fewer sequences than stages, or a batch of one). Hand
check, two equal stages of ``t`` each: ``m = 2`` gives ``2t`` per iteration for
twice the sequences a single stage of ``2t`` would carry, the textbook
no-bubble pipeline (GPipe, Huang et al. 2019: ``(m + p - 1)`` stage times for
``m`` micro-batches through ``p`` stages when the pipeline is flushed each
time; here it never is, since decode iterations follow one another).

Overlap: with ``overlap`` a stage sends one micro-batch while computing the
next (NCCL send/recv on their own stream), so a send costs only what exceeds
the compute; without it, the two add.

The layer split is ``even`` (``L / pp``, the remainder to the first stages),
``speed`` (each stage's layers in proportion to its speed, subject to its
memory: the split that minimises the slowest stage's time at a reference
decode step, found by filling the stages to a common time), or given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from tailguard.core.hardware import (
    DEFAULT_PERF,
    GB,
    GPU,
    Model,
    PerfModel,
    PerfParams,
    Roofline,
    roofline,
)
from tailguard.errors import ConfigError

# The decode step the ``speed`` split balances: a moderate batch at a typical
# context (what an SLO-bound replica runs; the split moves by a layer or two
# between a batch of 8 and 128).
SPLIT_BATCH = 32
SPLIT_CTX = 1024.0
# KV room each stage must keep beyond its weights (as PerfModel.fits asks).
MIN_KV_TOKENS = 2048


@dataclass(frozen=True, slots=True)
class StageSpec:
    """One stage: ``tp`` GPUs of ``gpu`` (its layers come from the split)."""

    gpu: GPU
    tp: int = 1


@dataclass(frozen=True, slots=True)
class Layout:
    """How a replica's GPUs form a pipeline."""

    stages: tuple[StageSpec, ...]
    split: str | tuple[int, ...] = "speed"  # "even", "speed" or the layers per stage
    microbatches: int = 0  # 0: one per stage (vLLM's virtual engines)
    overlap: bool = False  # activations sent while the next micro-batch computes
    link_gbps: float = 0.0  # GB/s between stages; 0: PerfParams.pp_link_gbps

    @property
    def name(self) -> str:
        """The replica's GPU class, so that it is compared only with replicas of the
        same layout: its stages' GPUs in order (``H100-SXM+A100-80GB``,
        ``2xA100-80GB+2xL40S``), or ``A100-80GB-PP2`` for stages all alike."""
        parts = [s.gpu.name if s.tp == 1 else f"{s.tp}x{s.gpu.name}" for s in self.stages]
        if len(set(parts)) == 1 and len(parts) > 1:
            return f"{parts[0]}-PP{len(parts)}"
        return "+".join(parts)

    @property
    def gpus(self) -> int:
        return sum(s.tp for s in self.stages)


def _send_s(model: Model, tokens: float, p: PerfParams, link_gbps: float = 0.0) -> float:
    """Seconds to move ``tokens`` tokens' activations to the next stage."""
    bw = (link_gbps or p.pp_link_gbps) * GB
    return p.pp_link_latency_s + tokens * model.hidden * 2.0 / bw


def split_layers(layout: Layout, model: Model, params: PerfParams = DEFAULT_PERF) -> tuple[int, ...]:
    """The layers of each stage under ``layout.split``."""
    pp, n = len(layout.stages), model.layers
    split = layout.split
    if not isinstance(split, str):  # the layers per stage (a list, read back from JSON)
        given = tuple(int(x) for x in split)
        if len(given) != pp or sum(given) != n or min(given) < 1:
            raise ConfigError("split", f"must give {pp} positive layer counts summing to "
                              f"{n} ({model.name}), got {list(given)}")
        return given
    if pp > n:
        raise ConfigError("pp", f"{pp} stages for {n} layers")
    if split == "even":
        q, r = divmod(n, pp)
        return tuple(q + (1 if i < r else 0) for i in range(pp))
    if split != "speed":
        raise ConfigError("split", f"must be even, speed or a list of layers, got {split!r}")
    # Each stage's time at the reference step is a + b * layers (every term of
    # the roofline scales with its layers, the send does not); fill the stages
    # to a common time T, the smallest at which they hold every layer within
    # their memory.
    m = layout.microbatches or pp
    tokens, ctx = SPLIT_BATCH / m, SPLIT_BATCH * SPLIT_CTX / m
    slope, base, most = [], [], []
    for i, st in enumerate(layout.stages):
        slope.append(roofline(st.gpu, model, st.tp, params, 1).time(tokens, ctx, ctx))
        base.append(_send_s(model, tokens, params, layout.link_gbps) if i < pp - 1 else 0.0)
        per_layer = (model.weight_bytes + MIN_KV_TOKENS * model.kv_bytes_per_token) / n / st.tp
        room = st.gpu.mem_gb * GB * params.gpu_memory_utilization
        room -= params.activation_reserve_gb * GB
        most.append(max(0, int(room / per_layer)))
    if sum(most) < n:
        raise ConfigError("stages", f"{model.name} does not fit on {layout.name}")

    def held(t: float) -> list[int]:
        return [max(0, min(c, int((t - b) / a))) for a, b, c in zip(slope, base, most, strict=True)]

    lo, hi = 0.0, max(b + a * n for a, b in zip(slope, base, strict=True))
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(held(mid)) >= n:
            hi = mid
        else:
            lo = mid
    layers = held(hi)
    # Too many by rounding: take them back from the slowest stages first.
    while sum(layers) > n:
        i = max((j for j in range(pp) if layers[j] > 1),
                key=lambda j: base[j] + slope[j] * layers[j])
        layers[i] -= 1
    if min(layers) < 1:  # a stage too slow or small to hold a layer still takes one
        for i in range(pp):
            if layers[i] < 1:
                layers[i] = 1
                j = max(range(pp), key=lambda k: layers[k])
                layers[j] -= 1
    return tuple(layers)


@dataclass(frozen=True, slots=True)
class PipelinePerf(PerfModel):
    """The step-time model of a pipeline-parallel replica (see the module docstring).

    ``gpu`` and ``tp`` are its first stage's. The inherited per-token
    coefficients hold the pipeline's steady-state equivalents (the slowest
    stage's, per token of the whole batch), which is what the router's
    backlog estimates read; :meth:`step_time` is exact.
    """

    closed_form: ClassVar[bool] = False  # the engine model times each step (no decode runs)

    layout: Layout = field(default_factory=lambda: Layout(()))
    layers: tuple[int, ...] = field(init=False)
    _stages: tuple[Roofline, ...] = field(init=False)

    def __post_init__(self) -> None:
        lay, m, p = self.layout, self.model, self.params
        if not lay.stages:
            raise ConfigError("stages", "a pipeline needs at least one stage")
        layers = split_layers(lay, m, p)
        # GPUs are numbered stage by stage; a stage runs at its slowest one's speed.
        speed = dict(self.gpu_speed)
        stages, first = [], 0
        for st, n in zip(lay.stages, layers, strict=True):
            slow = min((speed.get(i, 1.0) for i in range(first, first + st.tp)), default=1.0)
            stages.append(roofline(st.gpu, m, st.tp, p, n, slow))
            first += st.tp
        set_ = object.__setattr__
        set_(self, "layers", layers)
        set_(self, "_stages", tuple(stages))
        mb = lay.microbatches or len(stages)
        link = (lay.link_gbps or p.pp_link_gbps) * GB
        send = 0.0 if lay.overlap or len(stages) == 1 else m.hidden * 2.0 / link
        set_(self, "weight_s", mb * max(s.weight_s for s in stages))
        set_(self, "kv_s", max(s.kv_s for s in stages))
        set_(self, "token_flop_s", max(s.token_flop_s for s in stages))
        set_(self, "attn_flop_s", max(s.attn_flop_s for s in stages))
        set_(self, "fixed_s", p.step_overhead_s + mb * max(s.fixed_s for s in stages))
        set_(self, "allreduce_token_s", max(s.allreduce_token_s for s in stages) + send)
        set_(self, "kv_capacity_tokens", min(s.kv_capacity_tokens for s in stages))

    @property
    def gpus(self) -> int:
        return self.layout.gpus

    @property
    def memory_needed_gb(self) -> float:
        """HBM per GPU of the fullest stage (weights, reserve, one 2k-token sequence)."""
        m, p = self.model, self.params
        need = 0.0
        for st, n in zip(self.layout.stages, self.layers, strict=True):
            frac = n / m.layers
            b = (m.weight_bytes + MIN_KV_TOKENS * m.kv_bytes_per_token) * frac / st.tp
            need = max(need, b + p.activation_reserve_gb * GB)
        return need / p.gpu_memory_utilization / GB

    def step_time(
        self,
        decode_batch: int,
        decode_ctx: float,
        prefill_tokens: int = 0,
        prefill_ctx: float = 0.0,
        prefill_attn: float = 0.0,
    ) -> float:
        stages = self._stages
        lay, p = self.layout, self.params
        m = lay.microbatches or len(stages)
        seqs = decode_batch + (1 if prefill_tokens else 0)
        if seqs < m:
            m = seqs if seqs > 1 else 1
        share = 1.0 / m
        tokens = (decode_batch + prefill_tokens) * share
        ctx = (decode_ctx + prefill_ctx) * share
        attn = (decode_ctx + prefill_attn) * share
        last = len(stages) - 1
        send = _send_s(self.model, tokens, p, lay.link_gbps) if last else 0.0
        slowest = total = 0.0
        for i, st in enumerate(stages):
            t = st.time(tokens, ctx, attn)
            if i < last:
                if not lay.overlap:
                    t += send
                elif send > t:
                    t = send
            total += t
            if t > slowest:
                slowest = t
        busy = m * slowest
        return p.step_overhead_s + (busy if busy > total else total)


def pipeline_perf(stages: Sequence[StageSpec], model: Model, *, split: str | tuple[int, ...] = "speed",
                  microbatches: int = 0, overlap: bool = False,
                  params: PerfParams = DEFAULT_PERF) -> PipelinePerf:
    """The performance model of ``model`` pipelined over ``stages``."""
    lay = Layout(tuple(stages), split, microbatches, overlap)
    if not lay.stages:
        raise ConfigError("stages", "a pipeline needs at least one stage")
    return PipelinePerf(lay.stages[0].gpu, model, lay.stages[0].tp, params, layout=lay)


__all__ = ["Layout", "PipelinePerf", "StageSpec", "pipeline_perf", "split_layers"]
