"""Mid-stream migration with real llama.cpp servers (issue 45).

Two ``llama-server`` processes behind the gateway; one long streamed chat
answer through the official ``openai`` client. After its first tokens the
engine serving it is frozen (SIGSTOP) or killed (SIGKILL). The client must
read one complete, well-formed stream: no error event, one id, one role
delta, one finish reason, one ``[DONE]``, and as many content chunks as the
usage's completion tokens, which are the ``max_tokens`` asked for. llama.cpp
continues the partial assistant message itself (a trailing assistant turn).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import openai
import pytest
from gateway_fakes import wait_for
from llama_servers import MODEL_NAME, LlamaServer, find_engine, fleet_doc

from tailguard.config.fleet import parse_fleet
from tailguard.gateway.app import run_gateway

# Its bars are wall-clock times and live comparisons: `make test` runs it alone,
# after the rest has run two at a time (a second worker's load would move them).
pytestmark = pytest.mark.solo

MAX_TOKENS = 240
MESSAGES = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]


async def _one_stream(servers: list[LlamaServer], fault: Callable[[LlamaServer], None],
                      undo: Callable[[LlamaServer], None] | None) -> dict[str, Any]:
    # idle_s 30: without migration the frozen stream would end in an error only then.
    # The card left unknown (a GPU's shape): a fresh gateway prices a stream's
    # stall threshold at a step carrying a chunk of the pool's prior mean prompt
    # (1,000 tokens, until a few hundred requests have moved it), which on these
    # CPU engines' declared shape is some 40 s, and the health checks take the
    # frozen engine out first (the stream then moves as a failure).
    async with run_gateway(parse_fleet(fleet_doc(servers, idle_s=30.0,
                                                 declared=False))) as gw:
        await wait_for(lambda: all(m.engine == "llamacpp" for m in gw.fleet.monitors.values()),
                       timeout=10.0, what="llama.cpp detected on every node")
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0,
                                    timeout=60)
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=MAX_TOKENS,  # type: ignore[arg-type]
            stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        node = raw.headers["x-tailguard-node"]
        victim = servers[int(node.split("-")[1])]
        seen: dict[str, Any] = {"ids": set(), "roles": 0, "finishes": 0, "content": 0,
                                "text": "", "usage": None, "gap": 0.0}
        last = time.monotonic()
        faulted_at: float | None = None
        async for chunk in raw.parse():
            now = time.monotonic()
            seen["gap"] = max(seen["gap"], now - last)
            last = now
            seen["ids"].add(chunk.id)
            if chunk.usage is not None:
                seen["usage"] = chunk.usage
            for choice in chunk.choices:
                if choice.delta.role:
                    seen["roles"] += 1
                if choice.delta.content:
                    seen["content"] += 1
                    seen["text"] += choice.delta.content
                if choice.finish_reason:
                    seen["finishes"] += 1
            if faulted_at is None and seen["content"] >= 20:
                fault(victim)
                faulted_at = now
        if undo is not None:
            undo(victim)
        await client.close()
        reg = gw.metrics.registry
        seen["moved"] = {c: reg.get_sample_value(
            "tailguard_migrations_total", {"pool": MODEL_NAME, "cause": c, "result": "moved"})
            for c in ("stall", "failure", "down")}
        await wait_for(lambda: gw.fleet.in_flight() == 0, what="nothing in flight")
        assert gw.fleet.balancer.double_release == 0
        return seen


def _check(seen: dict[str, Any]) -> None:
    assert len(seen["ids"]) == 1, seen["ids"]
    assert seen["roles"] == 1 and seen["finishes"] == 1, seen
    usage = seen["usage"]
    assert usage is not None and usage.completion_tokens == seen["content"] == MAX_TOKENS, \
        (usage, seen["content"])
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def _run(fault: Callable[[LlamaServer], None],
         undo: Callable[[LlamaServer], None] | None = None) -> dict[str, Any]:
    binary, model = find_engine()
    servers = [LlamaServer(binary, model) for _ in range(2)]
    try:
        for s in servers:
            s.start()
        return asyncio.run(_one_stream(servers, fault, undo))
    finally:
        for s in servers:
            s.stop()


def test_a_frozen_llama_server_mid_answer() -> None:
    seen = _run(LlamaServer.pause, LlamaServer.resume)
    _check(seen)
    assert seen["moved"]["stall"] == 1, seen["moved"]
    # the stall trigger (1 s floor) and the continuation's first token, not the freeze
    assert seen["gap"] < 5.0, seen["gap"]


def test_a_killed_llama_server_mid_answer() -> None:
    seen = _run(LlamaServer.kill)
    _check(seen)
    assert seen["moved"]["failure"] == 1, seen["moved"]
