"""The engine model's disaggregated roles: a prefill instance holds a finished
prompt's KV until the decode side takes it, and a decode instance admits a
prompt whose KV arrived, computing only its last token."""

from __future__ import annotations

import math

import pytest

from tailguard.core.hardware import perf_model
from tailguard.engine import FINISH, FIRST_TOKEN, Engine, EngineConfig, Event

PERF = perf_model("A100-80GB", "llama-3.1-8b")


def _run(eng: Engine, until: float = math.inf) -> list[Event]:
    out: list[Event] = []
    while eng.next_event_time() <= until and eng.next_event_time() < math.inf:
        out += eng.advance(eng.next_event_time())
    return out


def test_prefill_instance_holds_the_kv_until_released() -> None:
    eng = Engine(PERF, EngineConfig(block_size=16))
    eng.submit(1, 1000, 1, 0.0, hold_kv=True)
    ev = _run(eng)
    assert [(k, r) for _, k, r in ev] == [(FIRST_TOKEN, 1), (FINISH, 1)]
    assert ev[0][0] == pytest.approx(PERF.prefill_time(1000, 2048), rel=1e-12)
    assert eng.num_held == 1 and eng.kv_held_blocks == -(-1000 // 16)
    assert eng.kv_used_blocks == eng.kv_held_blocks  # not free while the decode side pulls it
    with pytest.raises(ValueError, match="still holds KV"):
        eng.submit(1, 10, 1, 1.0)
    assert eng.release_kv(1, 1.0) is True
    assert eng.release_kv(1, 1.0) is False
    assert eng.kv_used_blocks == 0 and eng.num_held == 0


def test_held_kv_blocks_admission_until_released() -> None:
    # Room for one 100-token prompt: the second waits for the first's KV to go.
    cfg = EngineConfig(kv_capacity_tokens=128, block_size=16, max_num_seqs=4,
                       max_num_batched_tokens=128)
    eng = Engine(PERF, cfg)
    eng.submit(1, 100, 1, 0.0, hold_kv=True)
    eng.submit(2, 100, 1, 0.0, hold_kv=True)
    ev = _run(eng)
    assert [(k, r) for _, k, r in ev] == [(FIRST_TOKEN, 1), (FINISH, 1)]
    assert eng.num_waiting == 1 and eng.next_event_time() == math.inf  # idle, not stalled
    eng.release_kv(1, 5.0)
    ev = _run(eng)
    assert [(k, r) for _, k, r in ev] == [(FIRST_TOKEN, 2), (FINISH, 2)]
    assert ev[0][0] == pytest.approx(5.0 + PERF.step_time(0, 0, 100, 100, 100 * 50),
                                     rel=1e-12)
    assert eng.cancel(2, 6.0) is True  # a cancel frees held KV too
    assert eng.kv_used_blocks == 0


def test_decode_instance_computes_only_the_last_prompt_token() -> None:
    eng = Engine(PERF, EngineConfig(block_size=16))
    eng.submit(1, 4000, 10, 2.0, remote_kv=True)
    ev = _run(eng)
    first = PERF.step_time(0, 0, 1, 4000, 1 * (3999 + 0.5))
    assert ev[0] == (pytest.approx(2.0 + first, rel=1e-12), FIRST_TOKEN, 1)
    decode = sum(PERF.step_time(1, 4000 + g) for g in range(1, 10))
    assert ev[1] == (pytest.approx(2.0 + first + decode, rel=1e-12), FINISH, 1)
    local = Engine(PERF, EngineConfig(block_size=16))
    local.submit(1, 4000, 10, 2.0)
    assert _run(local)[0][0] - 2.0 > 20 * first  # the prefill it skipped
    assert eng.cached_tokens(1) == 0  # the engine's prefix cache served none of it


def test_transferred_kv_takes_its_blocks_at_admission() -> None:
    eng = Engine(PERF, EngineConfig(block_size=16))
    eng.submit(1, 4000, 100, 0.0, remote_kv=True)
    eng.advance(0.0)
    assert eng.kv_used_blocks == -(-4000 // 16)


def test_a_preempted_transfer_is_recomputed_locally() -> None:
    # Two transferred prompts outgrow a tiny cache: the later one is preempted,
    # loses its transferred KV and prefills its prompt (and answer so far) here.
    cfg = EngineConfig(kv_capacity_tokens=224, block_size=16, max_num_seqs=4,
                       max_num_batched_tokens=256)
    eng = Engine(PERF, cfg)
    eng.submit(1, 96, 40, 0.0, remote_kv=True)
    eng.submit(2, 96, 40, 0.0, remote_kv=True)
    ev = _run(eng)
    assert eng.num_preemptions >= 1
    assert sorted(r for _, k, r in ev if k == FINISH) == [1, 2]
    assert [r for _, k, r in ev if k == FIRST_TOKEN] == [1, 2]
    assert eng.generation_tokens_total == 80
