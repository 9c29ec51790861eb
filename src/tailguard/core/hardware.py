"""GPU and model catalogs, and the roofline performance model of one engine step.

The model follows the classic roofline argument (Williams et al., 2009) as it is
applied to transformer inference (e.g. the LLM-Viewer and vidur analyses):
a step moves ``bytes`` through HBM and does ``flops`` of arithmetic, and takes
the longer of the two at their *achieved* rates, plus a fixed overhead.

For a step that decodes a batch of ``B`` sequences whose context lengths sum to
``S``, and prefills ``P`` prompt tokens whose attention spans sum to ``A``
(``A = sum_i P_i * (c_i + P_i/2)`` for a chunk of ``P_i`` tokens after ``c_i``
tokens already cached), on ``T``-way tensor parallelism::

    bytes = (N*b + kv * (S + P_ctx)) / T
    flops = (2*N*(B + P) + 4*l*d*(S + A)) / T
    t     = max(bytes / (eta_m*BW), flops / (eta_c*F)) + overhead + allreduce

``kv = 2 * l * n_kv_heads * head_dim * b`` bytes per cached token.

Worked example (Llama-2-70B, TP2, decode at batch 1 on A100-80GB)::

    bytes  = 140e9 / 2            = 70 GB per GPU
    memory = 70e9 / (0.75 * 2039e9) = 45.8 ms
    overhead = 2 ms + 80 * 30 us  =  4.4 ms
    allreduce = 2 * 80 * 25 us    =  4.0 ms       -> 54 ms  (measured: 55 ms)

The calibration points (``docs/sources.md``: 55 ms A100, 37 ms H100,
688 ms for a 2048-token prefill on A100, H100/A100 decode ratio 1.3-1.8) are
checked in ``tests/core/test_hardware.py``.

Sources: GPU numbers are the vendors' dense BF16/FP16 datasheet values; the
efficiencies follow published profiles (eta_m ~0.75 for decode GEMMs, eta_c
~0.7 for large prefill).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar

from tailguard.errors import ConfigError

GB = 1e9


@dataclass(frozen=True, slots=True)
class GPU:
    """One accelerator model. ``tflops`` is dense BF16/FP16 without sparsity."""

    name: str
    tflops: float
    mem_bw_gbps: float
    mem_gb: float
    tdp_w: float
    price_per_hour: float
    interconnect_gbps: float = 0.0  # per-GPU link bandwidth used by TP all-reduce
    aliases: tuple[str, ...] = ()

    @property
    def ridge_flops_per_byte(self) -> float:
        return self.tflops * 1e12 / (self.mem_bw_gbps * GB)


@dataclass(frozen=True, slots=True)
class Model:
    """A dense decoder-only transformer."""

    name: str
    params: float
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    bytes_per_weight: float = 2.0
    max_context: int = 131072
    aliases: tuple[str, ...] = ()

    @property
    def kv_bytes_per_token(self) -> float:
        """Bytes of KV cache per token, summed over all ranks."""
        return 2.0 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_weight

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_weight


# Datasheet values (docs/sources.md). Prices are examples only and are meant
# to be overridden from configuration; interconnect is NVLink/Infinity Fabric
# per-GPU bandwidth, or PCIe for cards without it.
_GPUS: tuple[GPU, ...] = (
    GPU("B200", 2250, 8000, 180, 1000, 9.00, 900, ("NVIDIA B200",)),
    GPU("MI300X", 1307, 5300, 192, 750, 4.00, 448, ("AMD Instinct MI300X",)),
    GPU("H200", 989, 4800, 141, 700, 5.00, 450, ("H200-SXM", "NVIDIA H200")),
    GPU("H100-SXM", 989, 3350, 80, 700, 4.25, 450,
        ("H100", "H100-SXM5", "H100-80GB", "NVIDIA H100 80GB HBM3", "NVIDIA H100")),
    GPU("H100-PCIe", 756, 2000, 80, 350, 3.50, 64, ("H100-PCIE", "NVIDIA H100 PCIe")),
    GPU("A100-80GB", 312, 2039, 80, 400, 2.21, 300,
        ("A100", "A100-SXM", "A100-80G", "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe")),
    GPU("A100-40GB", 312, 1555, 40, 400, 1.80, 300,
        ("A100-40G", "NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB")),
    GPU("L40S", 362, 864, 48, 350, 1.84, 32, ("NVIDIA L40S",)),
    GPU("A10G", 70, 600, 24, 150, 1.01, 32, ("A10", "NVIDIA A10G", "NVIDIA A10")),
    GPU("L4", 121, 300, 24, 72, 0.81, 32, ("NVIDIA L4",)),
    GPU("T4", 65, 320, 16, 70, 0.35, 16, ("Tesla T4", "NVIDIA T4")),
    GPU("V100", 125, 900, 32, 300, 0.90, 150, ("V100-SXM2", "Tesla V100-SXM2-32GB", "V100-32GB")),
    GPU("RTX4090", 165, 1008, 24, 450, 0.40, 32, ("RTX-4090", "NVIDIA GeForce RTX 4090")),
)

# Public model cards (config.json of each model).
_MODELS: tuple[Model, ...] = (
    Model("llama-3.1-8b", 8.03e9, 32, 4096, 8, 128, aliases=("meta-llama/Llama-3.1-8B-Instruct",
          "meta-llama/Meta-Llama-3.1-8B-Instruct", "llama3.1-8b")),
    Model("llama-3.1-70b", 70.6e9, 80, 8192, 8, 128, aliases=("meta-llama/Llama-3.1-70B-Instruct",
          "meta-llama/Meta-Llama-3.1-70B-Instruct", "llama3.1-70b")),
    Model("llama-2-70b", 69.0e9, 80, 8192, 8, 128, max_context=4096,
          aliases=("meta-llama/Llama-2-70b-hf",)),
    Model("llama-3.2-3b", 3.21e9, 28, 3072, 8, 128, aliases=("meta-llama/Llama-3.2-3B-Instruct",)),
    Model("mistral-7b", 7.24e9, 32, 4096, 8, 128, max_context=32768,
          aliases=("mistralai/Mistral-7B-Instruct-v0.3",)),
    Model("qwen2.5-7b", 7.62e9, 28, 3584, 4, 128, max_context=32768,
          aliases=("Qwen/Qwen2.5-7B-Instruct",)),
    Model("qwen2.5-32b", 32.8e9, 64, 5120, 8, 128, max_context=32768,
          aliases=("Qwen/Qwen2.5-32B-Instruct",)),
)


def _norm(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


class Catalog:
    """GPU and model catalogs with alias lookup, extensible from user data."""

    def __init__(self, gpus: tuple[GPU, ...] = _GPUS, models: tuple[Model, ...] = _MODELS) -> None:
        self._gpus: dict[str, GPU] = {}
        self._models: dict[str, Model] = {}
        self._gpu_alias: dict[str, str] = {}
        self._model_alias: dict[str, str] = {}
        for g in gpus:
            self.add_gpu(g)
        for m in models:
            self.add_model(m)

    def add_gpu(self, gpu: GPU) -> None:
        self._gpus[gpu.name] = gpu
        for alias in (gpu.name, *gpu.aliases):
            self._gpu_alias[_norm(alias)] = gpu.name

    def add_model(self, model: Model) -> None:
        self._models[model.name] = model
        for alias in (model.name, *model.aliases):
            self._model_alias[_norm(alias)] = model.name

    @property
    def gpus(self) -> list[GPU]:
        return list(self._gpus.values())

    @property
    def models(self) -> list[Model]:
        return list(self._models.values())

    def find_gpu(self, name: str) -> GPU | None:
        key = self._gpu_alias.get(_norm(name))
        return self._gpus[key] if key else None

    def find_model(self, name: str) -> Model | None:
        key = self._model_alias.get(_norm(name))
        return self._models[key] if key else None

    def gpu(self, name: str, field: str = "gpu") -> GPU:
        found = self.find_gpu(name)
        if found is None:
            raise ConfigError(field, f"unknown GPU {name!r}", sorted(self._gpus))
        return found

    def model(self, name: str, field: str = "model") -> Model:
        found = self.find_model(name)
        if found is None:
            raise ConfigError(field, f"unknown model {name!r}", sorted(self._models))
        return found

    def with_prices(self, prices: Mapping[str, float]) -> Catalog:
        out = Catalog(tuple(self._gpus.values()), tuple(self._models.values()))
        for name, price in prices.items():
            g = out.gpu(name, f"prices.{name}")
            out.add_gpu(replace(g, price_per_hour=float(price)))
        return out

    def extend(self, gpus: Sequence[GPU] = (), models: Sequence[Model] = ()) -> Catalog:
        """A copy with ``gpus`` and ``models`` added; an entry whose name exists replaces it
        (the configuration layer reads them from a file: ``config/catalog.py``)."""
        out = Catalog(tuple(self._gpus.values()), tuple(self._models.values()))
        for g in gpus:
            out.add_gpu(g)
        for m in models:
            out.add_model(m)
        return out


DEFAULT_CATALOG = Catalog()


@dataclass(frozen=True, slots=True)
class PerfParams:
    """Named efficiency factors and overheads of the roofline model.

    eta_mem:  achieved fraction of HBM bandwidth in decode (profiles: ~0.75)
    eta_compute: achieved fraction of dense tensor FLOP/s (large prefill: ~0.7)
    step_overhead_s: fixed cost of one engine step (scheduling, sampling, launch)
    layer_overhead_s: per-layer kernel-launch cost that CUDA graphs do not hide
    allreduce_latency_s: latency of one TP all-reduce (two per layer when T > 1)
    gpu_memory_utilization: share of HBM the engine may use (vLLM default 0.9)
    activation_reserve_gb: memory kept for activations and the CUDA graph pool
    pp_link_gbps, pp_link_latency_s: the link between pipeline stages (core/pipeline.py)
    """

    eta_mem: float = 0.75
    eta_compute: float = 0.70
    step_overhead_s: float = 0.002
    layer_overhead_s: float = 30e-6
    allreduce_latency_s: float = 25e-6
    gpu_memory_utilization: float = 0.90
    activation_reserve_gb: float = 1.0
    # The link between pipeline stages (core/pipeline.py): hosts apart, 200 Gb/s
    # HDR InfiniBand or RoCE per GPU, and one send's latency.
    pp_link_gbps: float = 25.0
    pp_link_latency_s: float = 10e-6


DEFAULT_PERF = PerfParams()


@dataclass(frozen=True, slots=True)
class Roofline:
    """Per-second coefficients of ``layers`` of a model on ``tp`` GPUs of one type:
    a whole replica (:class:`PerfModel`) or one pipeline stage (core/pipeline.py)."""

    weight_s: float  # time to stream the weights once
    kv_s: float  # time to read one cached token's KV
    token_flop_s: float  # dense FLOPs of one token
    attn_flop_s: float  # attention FLOPs per (token x context)
    fixed_s: float  # per-step kernel launches and all-reduce latency (no host overhead)
    allreduce_token_s: float  # all-reduce bytes per token over the link
    kv_capacity_tokens: int  # what the memory left after the weights holds

    def time(self, tokens: float, ctx: float, attn: float) -> float:
        """A step of ``tokens`` tokens reading ``ctx`` cached tokens, ``attn`` the
        attention span (:meth:`PerfModel.step_time`, without the host overhead)."""
        mem = self.weight_s + self.kv_s * ctx
        comp = self.token_flop_s * tokens + self.attn_flop_s * attn
        return (mem if mem > comp else comp) + self.fixed_s + self.allreduce_token_s * tokens


def roofline(gpu: GPU, model: Model, tp: int, p: PerfParams, layers: int,
             speed: float = 1.0) -> Roofline:
    """The coefficients of ``layers`` of ``model`` on ``tp`` x ``gpu``; ``speed``: the
    slowest GPU's (a throttled rank: its GPU-side work takes 1/speed longer)."""
    frac = layers / model.layers
    bw = p.eta_mem * gpu.mem_bw_gbps * GB * speed
    fl = p.eta_compute * gpu.tflops * 1e12 * speed
    fixed = p.layer_overhead_s * layers / speed
    ar_tok = 0.0
    if tp > 1:
        fixed += 2 * layers * p.allreduce_latency_s
        link = max(gpu.interconnect_gbps, 1.0) * GB
        # ring all-reduce moves 2(T-1)/T of the activations, twice per layer
        ar_tok = 2 * layers * model.hidden * 2.0 * 2 * (tp - 1) / tp / link
    kv_tok = model.kv_bytes_per_token * frac / tp
    free = gpu.mem_gb * GB * p.gpu_memory_utilization - model.weight_bytes * frac / tp
    free -= p.activation_reserve_gb * GB
    cap = int(free / kv_tok) if free > 0 and kv_tok > 0 else 0
    return Roofline(model.weight_bytes * frac / tp / bw, kv_tok / bw,
                    2.0 * model.params * frac / tp / fl, 4.0 * layers * model.hidden / tp / fl,
                    fixed, ar_tok, cap)


@dataclass(frozen=True, slots=True)
class PerfModel:
    """Step-time model of one engine replica: ``model`` on ``tp`` GPUs of ``gpu``.

    All constants are folded at construction so that :meth:`step_time` is a few
    multiplications: it runs once per simulated engine step.
    """

    # Whether a run of identical decode steps follows step_time's one max() of
    # two lines, so the engine model may time it in closed form (engine/segment.py).
    closed_form: ClassVar[bool] = True

    gpu: GPU
    model: Model
    tp: int = 1
    params: PerfParams = DEFAULT_PERF
    # Each GPU's speed (index -> factor; a throttled rank): every rank waits for
    # the slowest at each all-reduce, so its GPU-side work (weights, KV, FLOPs,
    # kernel launches) takes 1/factor longer; the host's step overhead and the
    # link's transfers do not (see slowed()).
    gpu_speed: tuple[tuple[int, float], ...] = ()
    # derived, per-second coefficients (filled in __post_init__)
    weight_s: float = field(init=False)  # time to stream the weights once
    kv_s: float = field(init=False)  # time to read one cached token's KV
    token_flop_s: float = field(init=False)  # dense FLOPs of one token
    attn_flop_s: float = field(init=False)  # attention FLOPs per (token x context)
    fixed_s: float = field(init=False)  # per-step overhead incl. all-reduce latency
    allreduce_token_s: float = field(init=False)  # all-reduce bytes per token over the link
    kv_capacity_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ConfigError("tp", "must be >= 1")
        r = roofline(self.gpu, self.model, self.tp, self.params, self.model.layers,
                     min((f for _, f in self.gpu_speed), default=1.0))
        set_ = object.__setattr__
        set_(self, "weight_s", r.weight_s)
        set_(self, "kv_s", r.kv_s)
        set_(self, "token_flop_s", r.token_flop_s)
        set_(self, "attn_flop_s", r.attn_flop_s)
        set_(self, "fixed_s", self.params.step_overhead_s + r.fixed_s)
        set_(self, "allreduce_token_s", r.allreduce_token_s)
        set_(self, "kv_capacity_tokens", r.kv_capacity_tokens)

    @property
    def gpus(self) -> int:
        """GPUs in the replica."""
        return self.tp

    def slowed(self, gpu_speed: Mapping[int, float]) -> PerfModel:
        """The same replica with GPU ``i`` at ``gpu_speed[i]`` of its speed (empty:
        all at full speed)."""
        return replace(self, gpu_speed=tuple(sorted(gpu_speed.items())))

    @property
    def fits(self) -> bool:
        """Whether the weights fit with room for at least one 2k-token sequence."""
        return self.kv_capacity_tokens >= 2048

    @property
    def memory_needed_gb(self) -> float:
        """HBM per GPU needed for the weights, reserve and one 2k-token sequence."""
        m, p = self.model, self.params
        need = m.weight_bytes / self.tp + p.activation_reserve_gb * GB
        need += 2048 * m.kv_bytes_per_token / self.tp
        return need / p.gpu_memory_utilization / GB

    def step_time(
        self,
        decode_batch: int,
        decode_ctx: float,
        prefill_tokens: int = 0,
        prefill_ctx: float = 0.0,
        prefill_attn: float = 0.0,
    ) -> float:
        """Seconds for one engine step.

        decode_batch: sequences decoding one token each; decode_ctx: the sum of
        their context lengths; prefill_tokens: prompt tokens computed this step;
        prefill_ctx: KV tokens those chunks read (cached prefix + chunk);
        prefill_attn: ``sum P_i * (c_i + P_i/2)`` over the chunks.
        """
        tokens = decode_batch + prefill_tokens
        mem = self.weight_s + self.kv_s * (decode_ctx + prefill_ctx)
        comp = self.token_flop_s * tokens + self.attn_flop_s * (decode_ctx + prefill_attn)
        return (mem if mem > comp else comp) + self.fixed_s + self.allreduce_token_s * tokens

    def decode_step(self, batch: int, mean_ctx: float) -> float:
        return self.step_time(batch, batch * mean_ctx)

    def prefill_time(self, tokens: int, chunk: int = 0) -> float:
        """Seconds to prefill ``tokens`` alone, in chunks of ``chunk`` (0: one step)."""
        if tokens <= 0:
            return 0.0
        chunk = tokens if chunk <= 0 else chunk
        total, done = 0.0, 0
        while done < tokens:
            p = min(chunk, tokens - done)
            total += self.step_time(0, 0.0, p, done + p, p * (done + p / 2))
            done += p
        return total

    def decode_tokens_per_s(self, batch: int, mean_ctx: float) -> float:
        return batch / self.decode_step(batch, mean_ctx)

    def max_batch_for_tpot(self, tpot_s: float, mean_ctx: float, limit: int = 4096) -> int:
        """Largest decode batch whose step time stays within ``tpot_s`` (0 if none)."""
        if self.decode_step(1, mean_ctx) > tpot_s:
            return 0
        lo, hi = 1, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.decode_step(mid, mean_ctx) <= tpot_s:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def chunk_budget_for_tpot(self, tpot_s: float, batch: int, mean_ctx: float) -> int:
        """Largest prefill chunk that keeps a mixed step with ``batch`` decodes within ``tpot_s``."""
        base = batch * mean_ctx
        if self.step_time(batch, base, 1, 1, 0.5) > tpot_s:
            return 0
        lo, hi = 1, 1 << 16
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.step_time(batch, base, mid, mid, mid * mid / 2) <= tpot_s:
                lo = mid
            else:
                hi = mid - 1
        return lo


def perf_model(
    gpu: GPU | str,
    model: Model | str,
    tp: int = 1,
    params: PerfParams = DEFAULT_PERF,
    catalog: Catalog = DEFAULT_CATALOG,
) -> PerfModel:
    g = catalog.gpu(gpu) if isinstance(gpu, str) else gpu
    m = catalog.model(model) if isinstance(model, str) else model
    return PerfModel(g, m, tp, params)


__all__ = [
    "DEFAULT_CATALOG",
    "DEFAULT_PERF",
    "GPU",
    "Catalog",
    "Model",
    "PerfModel",
    "PerfParams",
    "Roofline",
    "perf_model",
    "roofline",
]
