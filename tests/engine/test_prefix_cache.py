"""The engine model's prefix cache: hits skip prefill, blocks outlive their
request, LRU eviction under KV pressure frees the tail of a chain first."""

from __future__ import annotations

import pytest

from tailguard.core.hardware import perf_model
from tailguard.engine import FINISH, FIRST_TOKEN, Engine, EngineConfig
from tailguard.engine.prefix_cache import PrefixCache

PERF = perf_model("A100-80GB", "llama-3.1-8b")
BT = 64


def _run(engine: Engine, t: float) -> tuple[float, dict[int, float], dict[int, float]]:
    """Advance until idle: (time, first token times, finish times)."""
    first: dict[int, float] = {}
    done: dict[int, float] = {}
    while engine.next_event_time() != float("inf"):
        t = engine.next_event_time()
        for when, kind, rid in engine.advance(t):
            (first if kind == FIRST_TOKEN else done if kind == FINISH else {})[rid] = when
    return t, first, done


def _chain(start: int, n: int) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def test_a_repeated_prompt_skips_the_prefill_it_cached() -> None:
    e = Engine(PERF)
    blocks = _chain(1000, 40)  # 2,560 tokens of prompt + answer
    e.submit(1, 2500, 10, 0.0, blocks, BT)
    t, first, _ = _run(e, 0.0)
    assert e.cached_tokens(1) == 0
    e.submit(2, 2500, 10, t, blocks, BT)
    _t2, first2, _ = _run(e, t)
    # 39 whole blocks of the prompt hit (at least its last token is computed again).
    assert e.cached_tokens(2) == 39 * BT
    assert e.cached_tokens(2) == 0  # asked once
    assert first2[2] - t < 0.2 * first[1]
    assert e.prefix_cache_queries_tokens == 5000
    assert e.prefix_cache_hits_tokens == 39 * BT


def test_switched_off_nothing_is_cached() -> None:
    e = Engine(PERF, EngineConfig(enable_prefix_caching=False))
    blocks = _chain(1, 40)
    e.submit(1, 2500, 10, 0.0, blocks, BT)
    t, first, _ = _run(e, 0.0)
    e.submit(2, 2500, 10, t, blocks, BT)
    _, first2, _ = _run(e, t)
    assert e.cached_tokens(2) == 0
    assert first2[2] - t == pytest.approx(first[1])
    assert e.prefix_cache_blocks == 0


def test_the_next_turn_hits_the_previous_answer_too() -> None:
    e = Engine(PERF)
    turn1 = _chain(1, 20)  # prompt 1,000 tokens + answer 300: 20 whole blocks
    e.submit(1, 1000, 300, 0.0, turn1, BT)
    t, _, _ = _run(e, 0.0)
    turn2 = turn1 + _chain(500, 10)  # history (prompt + answer) + a new message
    e.submit(2, 1300 + 200, 50, t, turn2, BT)
    _run(e, t)
    assert e.cached_tokens(2) == 20 * BT


def test_only_a_shared_leading_run_hits() -> None:
    e = Engine(PERF)
    e.submit(1, 1280, 5, 0.0, _chain(1, 20), BT)
    t, _, _ = _run(e, 0.0)
    other = (1, 2, 3, 999, *_chain(5, 16))  # differs at block 3: the rest cannot be used
    e.submit(2, 1280, 5, t, other, BT)
    _run(e, t)
    assert e.cached_tokens(2) == 3 * BT


def test_kv_pressure_evicts_the_least_recent_tail_first() -> None:
    # 64 blocks of 64 tokens of KV: a 2,048-token system prompt + a 1,024-token
    # question, then a big request that needs most of the cache.
    cfg = EngineConfig(kv_capacity_tokens=64 * BT, block_size=16, max_num_batched_tokens=4096)
    e = Engine(PERF, cfg)
    system = _chain(1, 32)
    first_q = system + _chain(100, 16)
    e.submit(1, 48 * BT, 1, 0.0, first_q, BT)
    t, _, _ = _run(e, 0.0)
    assert e.prefix_cache_blocks == 48
    e.submit(2, 40 * BT, 1, t, _chain(5000, 40), BT)  # needs 40 of 64: 24 may stay cached
    t, _, _ = _run(e, t)
    # The question's blocks (the chain's tail) went first; the system prompt stayed.
    e.submit(3, 33 * BT, 1, t, (*system, 7777), BT)
    t, _, _ = _run(e, t)
    assert e.cached_tokens(3) == 24 * BT


def test_a_cancelled_or_crashed_request_leaves_a_consistent_cache() -> None:
    e = Engine(PERF)
    blocks = _chain(1, 30)
    e.submit(1, 1900, 400, 0.0, blocks, BT)
    t, _, _ = _run(e, 0.0)
    e.submit(2, 1900, 400, t, blocks, BT)
    e.advance(t + 0.05)
    assert e.cancel(2, t + 0.05)
    assert e.cached_tokens(2) == 0  # forgotten with the request
    e.submit(3, 1900, 5, t + 0.05, blocks, BT)
    t, _, done = _run(e, t + 0.05)
    assert 3 in done and e.cached_tokens(3) == 29 * BT
    e.crash(t)
    e.restart(t)
    assert e.prefix_cache_blocks == 0
    e.submit(4, 1900, 5, t, blocks, BT)
    _run(e, t)
    assert e.cached_tokens(4) == 0


def test_cache_reference_counts() -> None:
    c = PrefixCache()
    c.acquire((1, 2, 3), BT)
    c.acquire((1, 2), BT)
    assert c.free_tokens == 0 and len(c) == 3
    c.release((1, 2, 3))
    assert c.free_tokens == BT  # 3 is free; 1 and 2 still used by the second request
    c.release((1, 2))
    assert c.free_tokens == 3 * BT
    c.fit(2 * BT)  # the least recently freed goes: 3 (freed first), then the tail of (1, 2)
    assert 3 not in c and 1 in c and 2 in c
    c.fit(BT)
    assert 2 not in c and 1 in c
    assert c.lookup((1, 2, 3), 3) == 1
