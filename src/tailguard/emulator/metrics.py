"""Engine metrics of an emulated node, in the Prometheus text format of a real engine.

The default dialect is vLLM's (names from ``vllm/v1/metrics/loggers.py``, as
listed in ``docs/sources.md``), and a node whose fleet entry says
``engine: sglang``, ``trtllm`` or ``tgi`` speaks that engine's names instead,
so the gateway's scrape adapters can be tested against each one:

========== ============================ ============================ ==============================
what       vllm                         sglang                       trtllm / tgi
========== ============================ ============================ ==============================
running    vllm:num_requests_running    sglang:num_running_reqs      trtllm_num_requests_running /
                                                                     tgi_batch_current_size
waiting    vllm:num_requests_waiting    sglang:num_queue_reqs        trtllm_num_requests_waiting /
                                                                     tgi_queue_size
KV use     vllm:kv_cache_usage_perc     sglang:token_usage           trtllm_kv_cache_utilization
========== ============================ ============================ ==============================

plus token counters, preemptions, the TTFT / inter-token / end-to-end
histograms (vLLM's bucket bounds) and ``cache_config_info`` with
``block_size`` and ``num_gpu_blocks`` labels. Every series carries
``model_name``. ``kv_cache_usage_perc`` is a fraction in [0, 1], as in vLLM
despite its name.

Histograms are plain bucket arrays here, not ``prometheus_client``
histograms: the driver observes inter-token gaps once per step and request
*with a count* (``k`` tokens that arrived in one step share one gap), which
the library cannot do, and a bisect into a list is the cheapest observation
there is. ``prometheus_client`` only renders the text, at scrape time, from a
custom collector, so the exposition format is the library's.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

if TYPE_CHECKING:
    from tailguard.emulator.driver import Pending

# vLLM's bucket bounds (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# name of each series per engine dialect; None: that engine has no such series
_NAMES: dict[str, dict[str, str | None]] = {
    "vllm": {
        "running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
        "kv": "vllm:kv_cache_usage_perc", "preemptions": "vllm:num_preemptions",
        "prompt": "vllm:prompt_tokens", "generation": "vllm:generation_tokens",
        "ttft": "vllm:time_to_first_token_seconds", "itl": "vllm:inter_token_latency_seconds",
        "e2e": "vllm:e2e_request_latency_seconds", "cache": "vllm:cache_config_info",
    },
    "sglang": {
        "running": "sglang:num_running_reqs", "waiting": "sglang:num_queue_reqs",
        "kv": "sglang:token_usage", "preemptions": None,
        "prompt": "sglang:prompt_tokens", "generation": "sglang:generation_tokens",
        "ttft": "sglang:time_to_first_token_seconds", "itl": "sglang:inter_token_latency_seconds",
        "e2e": "sglang:e2e_request_latency_seconds", "cache": "sglang:cache_config_info",
    },
    "trtllm": {
        "running": "trtllm_num_requests_running", "waiting": "trtllm_num_requests_waiting",
        "kv": "trtllm_kv_cache_utilization", "preemptions": None,
        "prompt": "trtllm_prompt_tokens", "generation": "trtllm_generation_tokens",
        "ttft": "trtllm_time_to_first_token_seconds", "itl": "trtllm_inter_token_latency_seconds",
        "e2e": "trtllm_e2e_request_latency_seconds", "cache": None,
    },
    "tgi": {
        "running": "tgi_batch_current_size", "waiting": "tgi_queue_size", "kv": None,
        "preemptions": None, "prompt": None, "generation": None, "ttft": None, "itl": None,
        "e2e": "tgi_request_duration", "cache": None,
    },
}
DIALECTS = tuple(_NAMES)


class Histogram:
    """Cumulative-bucket histogram with weighted observations."""

    __slots__ = ("bounds", "count", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # last slot: above every bound (+Inf)
        self.count = 0
        self.total = 0.0

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += n
        self.count += n
        self.total += value * n

    def buckets(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        acc = 0
        for bound, c in zip(self.bounds, self.counts, strict=False):
            acc += c
            out.append((repr(float(bound)), acc))
        out.append(("+Inf", self.count))
        return out


class EngineGauges(Protocol):
    """What the metrics read from the engine driver at scrape time."""

    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def kv_usage(self) -> float: ...
    @property
    def num_preemptions(self) -> int: ...
    @property
    def prompt_tokens_total(self) -> int: ...
    @property
    def generation_tokens_total(self) -> int: ...
    @property
    def num_gpu_blocks(self) -> int: ...

    def sync(self) -> None: ...


class EngineMetrics:
    """Request histograms (fed by the driver) and the text exposition of one node."""

    def __init__(self, model_name: str, dialect: str = "vllm", block_size: int = 16) -> None:
        self.model_name = model_name
        self.names = _NAMES.get(dialect, _NAMES["vllm"])
        self.block_size = block_size
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.source: EngineGauges | None = None
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(self)

    # ---- observations (hot path: called by the driver)

    def on_first_token(self, p: Pending, now: float) -> None:
        self.ttft.observe(now - p.submitted_at)

    def on_tokens(self, gap: float, n: int) -> None:
        # n tokens surfaced together after ``gap`` seconds: n gaps of gap/n each
        self.itl.observe(gap / n, n)

    def on_finish(self, p: Pending, now: float) -> None:
        self.e2e.observe(now - p.submitted_at)
        if not p.stream and p.output > 1:
            # a non-streaming request is not followed token by token: its mean gap
            self.itl.observe((now - p.first_at) / (p.output - 1), p.output - 1)

    # ---- exposition

    def render(self) -> bytes:
        if self.source is not None:
            self.source.sync()
        out: bytes = generate_latest(self._registry)
        return out

    def collect(self) -> Iterator[Any]:
        src, names, label = self.source, self.names, [self.model_name]
        if src is None:
            return

        def gauge(key: str, doc: str, value: float) -> Iterator[Any]:
            name = names[key]
            if name is not None:
                g = GaugeMetricFamily(name, doc, labels=["model_name"])
                g.add_metric(label, value)
                yield g

        def counter(key: str, doc: str, value: float) -> Iterator[Any]:
            name = names[key]
            if name is not None:
                c = CounterMetricFamily(name, doc, labels=["model_name"])
                c.add_metric(label, value)
                yield c

        def hist(key: str, doc: str, h: Histogram) -> Iterator[Any]:
            name = names[key]
            if name is not None:
                f = HistogramMetricFamily(name, doc, labels=["model_name"])
                f.add_metric(label, h.buckets(), h.total)
                yield f

        yield from gauge("running", "Number of requests in model execution batches.",
                         src.num_running)
        yield from gauge("waiting", "Number of requests waiting to be processed.", src.num_waiting)
        yield from gauge("kv", "KV-cache usage. 1 means 100 percent usage.", src.kv_usage)
        yield from counter("preemptions", "Cumulative number of preemptions from the engine.",
                           src.num_preemptions)
        yield from counter("prompt", "Number of prefill tokens processed.",
                           src.prompt_tokens_total)
        yield from counter("generation", "Number of generation tokens processed.",
                           src.generation_tokens_total)
        yield from hist("ttft", "Histogram of time to first token in seconds.", self.ttft)
        yield from hist("itl", "Histogram of inter-token latency in seconds.", self.itl)
        yield from hist("e2e", "Histogram of end to end request latency in seconds.", self.e2e)
        name = names["cache"]
        if name is not None:
            info = GaugeMetricFamily(name, "Information of the LLMEngine CacheConfig",
                                     labels=["model_name", "block_size", "num_gpu_blocks"])
            info.add_metric([self.model_name, str(self.block_size), str(src.num_gpu_blocks)], 1.0)
            yield info
