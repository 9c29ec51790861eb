"""Reading an engine's own load from its Prometheus ``/metrics`` page.

Each engine names the same three quantities differently (``docs/sources.md``);
an :class:`EngineAdapter` maps them:

=========  ===============================  ==============================  ==============================================
engine     running                          waiting                         KV cache use (fraction 0..1)
=========  ===============================  ==============================  ==============================================
vllm       vllm:num_requests_running        vllm:num_requests_waiting       vllm:kv_cache_usage_perc (older: gpu_cache_usage_perc)
sglang     sglang:num_running_reqs          sglang:num_queue_reqs           sglang:token_usage
trtllm     trtllm_num_requests_running      trtllm_num_requests_waiting     trtllm_kv_cache_utilization
           (Triton backend: nv_trt_llm_request_metrics{request_type="scheduled"|"waiting"},
           nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction"})
tgi        tgi_batch_current_size           tgi_queue_size                  (not exported)
llamacpp   llamacpp:requests_processing     llamacpp:requests_deferred      (not exported)
=========  ===============================  ==============================  ==============================================

vLLM also counts the requests it has preempted (``vllm:num_preemptions_total``):
a node whose count rose since the last scrape was short of KV cache, and its
engine's word on that replaces the gateway's own estimate (``Node.note_kv``).

llama.cpp's ``llama-server`` serves this page only with ``--metrics`` (else
501). Its ``prompt_tokens_seconds`` and ``predicted_tokens_seconds`` gauges
are averages since the *previous* scrape, so every scraper resets them for
the others: tailguard reads none of them (its own accounting measures
throughput); the counters (``prompt_tokens_total``,
``prompt_tokens_cached_total``, ``tokens_predicted_total``) are safe to
read by anyone.

A node whose ``engine`` is not configured is detected from the first page
that names one of these families. Values of several label sets (an engine
serving two models) are summed; KV use takes the largest.

The page is scanned line by line with plain string operations instead of
prometheus-client's parser: a vLLM page with its histograms is tens of
kilobytes, scraped twice a second per node, and a full parse of it would cost
the gateway more CPU than the requests it routes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_REQUESTS = 1_000_000  # what one engine can plausibly run or queue


@dataclass(frozen=True, slots=True)
class EngineSample:
    """One scrape: requests running and waiting in the engine, KV use and requests
    preempted since the engine started (-1: unknown)."""

    running: int
    waiting: int
    kv_usage: float
    preemptions: int = -1


@dataclass(frozen=True, slots=True)
class EngineAdapter:
    """Metric names of one engine: family name (optionally ``{label="value"}``) per quantity."""

    name: str
    prefix: tuple[str, ...]  # family-name prefixes that identify this engine
    running: tuple[str, ...]
    waiting: tuple[str, ...]
    kv_usage: tuple[str, ...] = ()
    preemptions: tuple[str, ...] = ()  # a counter: only vLLM exports one


ADAPTERS: dict[str, EngineAdapter] = {
    "vllm": EngineAdapter(
        "vllm", ("vllm:",), ("vllm:num_requests_running",), ("vllm:num_requests_waiting",),
        ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        ("vllm:num_preemptions_total",)),
    "sglang": EngineAdapter(
        "sglang", ("sglang:",), ("sglang:num_running_reqs",), ("sglang:num_queue_reqs",),
        ("sglang:token_usage",)),
    "trtllm": EngineAdapter(
        "trtllm", ("trtllm_", "nv_trt_llm_"),
        ("trtllm_num_requests_running", 'nv_trt_llm_request_metrics{request_type="scheduled"}'),
        ("trtllm_num_requests_waiting", 'nv_trt_llm_request_metrics{request_type="waiting"}'),
        ("trtllm_kv_cache_utilization",
         'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction"}')),
    "tgi": EngineAdapter("tgi", ("tgi_",), ("tgi_batch_current_size",), ("tgi_queue_size",)),
    "llamacpp": EngineAdapter("llamacpp", ("llamacpp:",), ("llamacpp:requests_processing",),
                              ("llamacpp:requests_deferred",)),
}


def detect_engine(text: str) -> str | None:
    """The engine whose metric families appear on the page, if any."""
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        for adapter in ADAPTERS.values():
            if line.startswith(adapter.prefix):
                return adapter.name
    return None


def _split(name: str) -> tuple[str, str | None]:
    """``family{label="v"}`` -> (family, 'label="v"'); a bare family -> (family, None)."""
    brace = name.find("{")
    if brace < 0:
        return name, None
    return name[:brace], name[brace + 1:].rstrip("}")


def parse_engine_metrics(text: str, engine: str) -> EngineSample | None:
    """The sample on ``text`` for ``engine``; None when the page has none of its metrics."""
    adapter = ADAPTERS[engine]
    wanted: dict[str, list[tuple[str | None, int]]] = {}
    for kind, names in enumerate((adapter.running, adapter.waiting, adapter.kv_usage,
                                  adapter.preemptions)):
        for n in names:
            family, label = _split(n)
            wanted.setdefault(family, []).append((label, kind))
    sums = [0.0, 0.0, -1.0, 0.0]
    seen = [False, False, False, False]
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        end = 0
        while end < len(line) and line[end] not in "{ ":
            end += 1
        targets = wanted.get(line[:end])
        if targets is None:
            continue
        # value: first field after the label set (an optional timestamp follows)
        close = line.rfind("}")
        rest = line[close + 1:] if close >= 0 else line[end:]
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if not math.isfinite(value) or value < 0.0:  # NaN: no value yet; the rest: nonsense
            continue
        labels = line[end + 1:close] if close >= 0 else ""
        for label, kind in targets:
            if label is not None and label not in labels:
                continue
            if kind == 2:
                sums[2] = max(sums[2], value)
            else:
                sums[kind] += value
            seen[kind] = True
    if not (seen[0] or seen[1]):
        return None
    kv = sums[2]
    if kv > 1.0:  # a percentage (0..100) from an engine that reports it so
        kv /= 100.0
    # A page is the engine's word, not the gateway's: bounded as the replicas' reports are.
    return EngineSample(int(min(sums[0], MAX_REQUESTS)), int(min(sums[1], MAX_REQUESTS)),
                        min(kv, 1.0) if seen[2] else -1.0,
                        int(min(sums[3], 2**62)) if seen[3] else -1)
