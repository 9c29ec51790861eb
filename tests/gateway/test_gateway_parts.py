"""The gateway's pure parts: SSE counting, engine metric adapters, retry budget, request checks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tailguard.adapters.engine_metrics import EngineSample, detect_engine, parse_engine_metrics
from tailguard.adapters.openai_request import (
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    InvalidRequest,
    parse_request,
)
from tailguard.adapters.sse import SseCounter, usage_cached_tokens, usage_completion_tokens
from tailguard.core.retry_budget import RetryBudget

STREAM = (
    b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n\n'
    b'data: {"choices":[{"delta":{"content":"data: not an event"}}]}\n\n'
    b'data: {"choices":[{"delta":{"content":" b"}}]}\n\n'
    b"data: [DONE]\n\n"
)


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 64, 10_000])
def test_sse_counter_is_independent_of_chunking(size: int) -> None:
    c = SseCounter()
    for i in range(0, len(STREAM), size):
        c.feed(STREAM[i:i + size])
    assert c.events == 4
    assert c.output_tokens() == 2  # the role-only first event and [DONE] are not tokens


FIXTURES = Path(__file__).parent / "fixtures"


def counted(raw: bytes, size: int) -> SseCounter:
    c = SseCounter()
    for i in range(0, len(raw), size):
        c.feed(raw[i:i + size])
    return c


@pytest.mark.parametrize(("name", "tokens", "cached"), [
    ("llamacpp_chat_stream.txt", 12, 24),  # no usage chunk: timings, role and finish events
    ("llamacpp_completion_stream.txt", 9, 0),
])
def test_sse_counter_on_real_llamacpp_streams(name: str, tokens: int, cached: int) -> None:
    raw = (FIXTURES / name).read_bytes()
    for size in (7, 100, len(raw)):
        c = counted(raw, size)
        assert (c.output_tokens(), c.cached_tokens(), c.engine_error()) == (tokens, cached, False)
    # The same stream without timings and usage: counted from its events, exactly.
    bare = re.sub(rb',"timings":\{[^}]*\}', b"", raw)
    bare = re.sub(rb',"usage":\{[^{}]*(\{[^{}]*\})?[^{}]*\}', b"", bare)
    c = counted(bare, len(bare))
    assert (c.output_tokens(), c.cached_tokens()) == (tokens, None)


@pytest.mark.parametrize(("name", "tokens", "cached"), [
    # vLLM 0.32.0 on CPU, --enable-prompt-tokens-details: a role event, then the
    # usage chunk; 384 of the 422 prompt tokens (whole KV blocks) were cached
    ("vllm_chat_stream.txt", 24, 384),
    # ended by the model (finish_reason stop): vLLM sends the end-of-sequence token as
    # an empty final event and counts it, 10 in its usage...
    ("vllm_chat_stream_stop.txt", 10, 0),
    # ...and without include_usage the same answer counts its 9 content events: one
    # low, the end-of-sequence step (TPOT over 8 gaps instead of 9: 1% off)
    ("vllm_chat_stream_plain.txt", 9, None),
])
def test_sse_counter_on_real_vllm_streams(name: str, tokens: int, cached: int | None) -> None:
    raw = (FIXTURES / name).read_bytes()
    for size in (7, 100, len(raw)):
        c = counted(raw, size)
        assert (c.output_tokens(), c.cached_tokens(), c.engine_error()) == (tokens, cached, False)


def test_sse_counter_sees_an_engine_error_event() -> None:
    c = SseCounter()
    c.feed(STREAM[:-14])
    c.feed(b'data: {"error": {"message": "out of memory", "code": 500}}\n\n')
    assert c.engine_error()
    assert not SseCounter().engine_error()


def test_sse_counter_reads_the_usage_chunk() -> None:
    c = SseCounter()
    c.feed(STREAM[:-14])
    c.feed(b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":17}}\n\n')
    c.feed(b"data: [DONE]\n\n")
    assert c.output_tokens() == 17


def test_usage_in_a_plain_body() -> None:
    assert usage_completion_tokens(b'{"usage": {"completion_tokens": 42, "x": 1}}') == 42
    assert usage_completion_tokens(b'{"usage": null}') is None


VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama"} 7.0
vllm:num_requests_waiting{engine="0",model_name="llama"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.42
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="llama"} 3.0
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="llama"} 3.0
"""
VLLM_OLD = "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\nvllm:gpu_cache_usage_perc 0.5\n"
SGLANG = "sglang:num_running_reqs{name=\"x\"} 5\nsglang:num_queue_reqs{name=\"x\"} 1\nsglang:token_usage{name=\"x\"} 0.3\n"
TRTLLM = "trtllm_num_requests_running 4\ntrtllm_num_requests_waiting 3\ntrtllm_kv_cache_utilization 0.9\n"
TRITON = (
    'nv_trt_llm_request_metrics{model="e",request_type="scheduled",version="1"} 6\n'
    'nv_trt_llm_request_metrics{model="e",request_type="waiting",version="1"} 2\n'
    'nv_trt_llm_request_metrics{model="e",request_type="max",version="1"} 64\n'
    'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction",model="e"} 0.75\n'
    'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max",model="e"} 1000\n'
)
TGI = "tgi_batch_current_size 8\ntgi_queue_size 5 1712345678000\n"


@pytest.mark.parametrize(("text", "engine", "sample"), [
    (VLLM, "vllm", EngineSample(7, 2, 0.42, 3)),
    (VLLM_OLD, "vllm", EngineSample(1, 0, 0.5)),
    (SGLANG, "sglang", EngineSample(5, 1, 0.3)),
    (TRTLLM, "trtllm", EngineSample(4, 3, 0.9)),
    (TRITON, "trtllm", EngineSample(6, 2, 0.75)),
    (TGI, "tgi", EngineSample(8, 5, -1.0)),
])
def test_engine_adapters(text: str, engine: str, sample: EngineSample) -> None:
    assert detect_engine(text) == engine
    assert parse_engine_metrics(text, engine) == sample


def test_real_llamacpp_metrics_page() -> None:
    """A page saved from llama-server (0.94.0 source, --metrics, -np 4, 8 requests sent)."""
    text = (FIXTURES / "llamacpp_metrics.txt").read_text()
    assert detect_engine(text) == "llamacpp"
    assert parse_engine_metrics(text, "llamacpp") == EngineSample(4, 4, -1.0)


def test_real_vllm_metrics_page_and_answer() -> None:
    """A page saved from vLLM 0.32.0 on CPU (SmolLM2-135M, one stream running while it
    was read, prefix caching on by default), and its non-streamed answer's usage."""
    text = (FIXTURES / "vllm_metrics.txt").read_text()
    assert detect_engine(text) == "vllm"
    sample = parse_engine_metrics(text, "vllm")
    assert sample is not None and (sample.running, sample.waiting) == (1, 0)
    assert sample.kv_usage == pytest.approx(0.011019, abs=1e-6)
    assert sample.preemptions == 0
    body = (FIXTURES / "vllm_chat.json").read_bytes()
    assert (usage_completion_tokens(body), usage_cached_tokens(body)) == (24, 384)


def test_engine_metrics_absent() -> None:
    assert detect_engine("process_cpu_seconds_total 3\n") is None
    assert parse_engine_metrics("process_cpu_seconds_total 3\n", "vllm") is None


def test_two_models_on_one_engine_are_summed() -> None:
    text = VLLM + VLLM.replace("llama", "qwen").replace("0.42", "0.1")
    assert parse_engine_metrics(text, "vllm") == EngineSample(14, 4, 0.42, 6)


def test_retry_budget_bounds_retries() -> None:
    b = RetryBudget(ratio=0.2, min_per_s=0.0)
    for _ in range(10):
        b.deposit()
    assert [b.try_spend(0.0) for _ in range(3)] == [True, True, False]
    trickle = RetryBudget(ratio=0.0, min_per_s=2.0)
    assert [trickle.try_spend(0.0) for _ in range(3)] == [True, True, False]
    assert trickle.try_spend(0.5)  # one more token after half a second at 2/s
    assert not trickle.try_spend(0.5)


def test_request_sizes() -> None:
    r = parse_request(CHAT, b'{"model": "m", "messages": [{"role": "user", '
                            b'"content": "Say hello in French"}], "stream": true, "max_tokens": 9}')
    assert (r.model, r.stream, r.prompt_tokens, r.max_tokens) == ("m", True, 8, 9)
    r = parse_request(COMPLETIONS, b'{"model": "m", "prompt": [1, 2, 3], "max_completion_tokens": 4,'
                                   b' "max_tokens": 10}')
    assert (r.prompt_tokens, r.max_tokens, r.stream) == (3, 4, False)
    r = parse_request(EMBEDDINGS, b'{"model": "m", "input": ["abcd", "efgh"]}')
    assert (r.prompt_tokens, r.stream) == (2, False)


@pytest.mark.parametrize(("endpoint", "body", "code", "param"), [
    (CHAT, b"{", "invalid_json", None),
    (CHAT, b"\xff\xfe", "invalid_json", None),
    (CHAT, b"[1]", "invalid_json", None),
    (CHAT, b'{"messages": []}', "missing_field", "model"),
    (CHAT, b'{"model": 3, "messages": []}', "invalid_value", "model"),
    (CHAT, b'{"model": "m"}', "missing_field", "messages"),
    (CHAT, b'{"model": "m", "messages": "hi"}', "invalid_value", "messages"),
    (CHAT, b'{"model": "m", "messages": [{"content": "x"}]}', "invalid_value", "messages[0]"),
    (CHAT, b'{"model": "m", "messages": [{"role": "user"}], "stream": "yes"}',
     "invalid_value", "stream"),
    (CHAT, b'{"model": "m", "messages": [{"role": "user"}], "max_tokens": 0}',
     "invalid_value", "max_tokens"),
    (COMPLETIONS, b'{"model": "m"}', "missing_field", "prompt"),
    (COMPLETIONS, b'{"model": "m", "prompt": {"a": 1}}', "invalid_value", "prompt"),
    (EMBEDDINGS, b'{"model": "m"}', "missing_field", "input"),
])
def test_invalid_requests(endpoint: str, body: bytes, code: str, param: str | None) -> None:
    with pytest.raises(InvalidRequest) as err:
        parse_request(endpoint, body)
    assert err.value.code == code and err.value.param == param
