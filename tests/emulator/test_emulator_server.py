"""The emulated engines over real sockets on 127.0.0.1 (free ports, cleaned up)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from tailguard.emulator import EmulatedNode, Emulator, parse_fault, run_emulator
from tailguard.engine import EngineConfig

MODEL = "llama-3.1-8b"


def run(nodes: Sequence[EmulatedNode], body: Callable[[Emulator], Awaitable[None]],
        **options: Any) -> None:
    async def main() -> None:
        async with run_emulator(nodes, **options) as emu:
            await asyncio.wait_for(body(emu), 30)

    asyncio.run(main())


async def scrape(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if not sample.name.endswith("_bucket"):
                out[sample.name] = sample.value
    return out


async def chat(session: aiohttp.ClientSession, url: str, max_tokens: int = 4,
               stream: bool = False, **extra: Any) -> aiohttp.ClientResponse:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": max_tokens, "stream": stream, **extra}
    return await session.post(url + "/v1/chat/completions", json=body)


def test_openai_client_chat_and_completions_exact_tokens() -> None:
    async def body(emu: Emulator) -> None:
        client = AsyncOpenAI(base_url=emu.urls["h100"] + "/v1", api_key="unused")
        try:
            r = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Say hello in French"}],
                max_tokens=17)
            assert r.usage is not None
            assert r.usage.completion_tokens == 17
            assert r.usage.prompt_tokens == 8  # ceil(19/4) + 3
            assert r.choices[0].finish_reason == "length"
            assert r.choices[0].message.content is not None
            assert len(r.choices[0].message.content.split()) == 17

            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=23,
                stream=True, stream_options={"include_usage": True})
            tokens, usage, finish = 0, None, None
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                for c in chunk.choices:
                    tokens += bool(c.delta.content)
                    finish = c.finish_reason or finish
            assert tokens == 23
            assert finish == "length"
            assert usage is not None and usage.completion_tokens == 23

            c = await client.completions.create(model=MODEL, prompt=[1, 2, 3, 4, 5], max_tokens=9)
            assert c.usage is not None
            assert (c.usage.prompt_tokens, c.usage.completion_tokens) == (5, 9)
            assert c.choices[0].text.count("tok") == 9

            cs = await client.completions.create(model=MODEL, prompt="abcd" * 10, max_tokens=6,
                                                 stream=True)
            texts = [ch.choices[0].text async for ch in cs if ch.choices and ch.choices[0].text]
            assert len(texts) == 6

            models = await client.models.list()
            assert [m.id for m in models.data] == [MODEL]
        finally:
            await client.close()

    run([EmulatedNode("h100", "H100")], body, speed=20)


def test_bad_requests_get_openai_errors() -> None:
    async def body(emu: Emulator) -> None:
        url = emu.urls["l4"]
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/chat/completions", data=b"{not json") as r:
                assert r.status == 400
                assert "error" in await r.json()
            async with s.post(url + "/v1/chat/completions",
                              json={"model": "nope", "messages": [{"role": "user"}]}) as r:
                assert r.status == 404
            async with await chat(s, url, max_tokens=10**6) as r:  # over the L4's KV cache
                assert r.status == 400
                assert "maximum context length" in (await r.json())["error"]["message"]
            async with await chat(s, url, max_tokens=0) as r:
                assert r.status == 400
            async with s.get(url + "/health") as r:
                assert r.status == 200

    run([EmulatedNode("l4", "L4")], body, speed=math.inf)


def test_metrics_parse_and_reflect_running_waiting_and_disconnect_frees_slots() -> None:
    # An L4 with two batch slots: four long streams -> two running, two waiting.
    node = EmulatedNode("l4", "L4", engine=EngineConfig(max_num_seqs=2))

    async def body(emu: Emulator) -> None:
        url = emu.urls["l4"]
        session = aiohttp.ClientSession()
        streams: list[aiohttp.ClientResponse] = []
        try:
            for _ in range(4):
                r = await chat(session, url, max_tokens=2000, stream=True)
                assert r.status == 200
                streams.append(r)
            await asyncio.sleep(0.3)
            m = await scrape(url)
            assert m["vllm:num_requests_running"] == 2
            assert m["vllm:num_requests_waiting"] == 2
            assert 0 < m["vllm:kv_cache_usage_perc"] < 1
            assert m["vllm:generation_tokens_total"] > 0
            assert m["vllm:time_to_first_token_seconds_count"] == 2
        finally:
            for r in streams:
                r.close()
            await session.close()
        # the clients went away: their engine slots and KV are freed
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            m = await scrape(url)
            if m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0:
                break
            await asyncio.sleep(0.05)
        assert m["vllm:num_requests_running"] == 0
        assert m["vllm:num_requests_waiting"] == 0
        assert m["vllm:kv_cache_usage_perc"] == 0
        assert emu.server("l4").driver.in_flight == 0
        # a non-streaming request sends nothing until it ends: cancelling its
        # client must still cancel it in the engine (handler cancellation)
        async with aiohttp.ClientSession() as s2:
            task = asyncio.ensure_future(chat(s2, url, max_tokens=2000))
            await asyncio.sleep(0.3)
            assert emu.server("l4").driver.engine.num_running == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        deadline = time.monotonic() + 3
        while emu.server("l4").driver.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert emu.server("l4").driver.in_flight == 0
        assert (await scrape(url))["vllm:num_requests_running"] == 0

    run([node], body)


def test_metrics_families_and_cache_info() -> None:
    async def body(emu: Emulator) -> None:
        async with aiohttp.ClientSession() as s:
            for stream in (False, True):
                async with await chat(s, emu.urls["h100"], max_tokens=5, stream=stream) as r:
                    await r.read()
            async with s.get(emu.urls["h100"] + "/metrics") as r:
                text = await r.text()
            async with s.get(emu.urls["sg"] + "/metrics") as r:
                sg = await r.text()
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                     "vllm:kv_cache_usage_perc", "vllm:num_preemptions", "vllm:prompt_tokens",
                     "vllm:generation_tokens", "vllm:time_to_first_token_seconds",
                     "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
                     "vllm:cache_config_info"):
            assert name in fams, name
        assert fams["vllm:generation_tokens"].samples[0].value == 10
        assert fams["vllm:generation_tokens"].samples[0].labels == {"model_name": MODEL}
        itl = {s.name: s.value for s in fams["vllm:inter_token_latency_seconds"].samples}
        assert itl["vllm:inter_token_latency_seconds_count"] == 8  # 4 gaps per 5-token answer
        e2e = {s.name: s.value for s in fams["vllm:e2e_request_latency_seconds"].samples}
        assert e2e["vllm:e2e_request_latency_seconds_count"] == 2
        info = fams["vllm:cache_config_info"].samples[0].labels
        assert info["block_size"] == "16" and int(info["num_gpu_blocks"]) > 1000
        assert "sglang:num_running_reqs" in sg and "vllm:" not in sg

    run([EmulatedNode("h100", "H100"), EmulatedNode("sg", "H100", dialect="sglang")], body,
        speed=20)


async def stream_timing(session: aiohttp.ClientSession, url: str, tokens: int) -> float:
    """Seconds per output token after the first, measured on the wire."""
    async with await chat(session, url, max_tokens=tokens, stream=True) as r:
        first = last = -1.0
        async for _ in r.content.iter_any():
            last = time.perf_counter()
            if first < 0:
                first = last
    return (last - first) / (tokens - 1)


def test_throttle_fault_slows_tpot() -> None:
    async def body(emu: Emulator) -> None:
        url = emu.urls["h100"]
        async with aiohttp.ClientSession() as s:
            base = await stream_timing(s, url, 40)
            async with s.post(url + "/admin/faults",
                              json={"kind": "throttle", "factor": 0.25, "duration_s": 30}) as r:
                assert r.status == 200
                assert (await r.json())["faults"]["h100"][0]["kind"] == "throttle"
            slow = await stream_timing(s, url, 40)
            async with s.delete(url + "/admin/faults") as r:
                assert r.status == 200
            again = await stream_timing(s, url, 40)
        assert slow / base > 2.5  # 4x in the model; generous for a busy machine
        assert again / base < 1.8

    run([EmulatedNode("h100", "H100")], body, speed=2)


def test_network_fault_delays_every_write_and_loses_no_token() -> None:
    async def body(emu: Emulator) -> None:
        url = emu.urls["a"]

        async def timed(stream: bool) -> tuple[float, bytes]:
            t0 = time.perf_counter()
            async with await chat(s, url, max_tokens=6, stream=stream) as r:
                assert r.status == 200
                raw = await r.read()
            return time.perf_counter() - t0, raw

        async with aiohttp.ClientSession() as s:
            base, _ = await timed(True)
            async with s.post(url + "/admin/faults",
                              json={"kind": "network", "delay_s": 0.3, "duration_s": 30}) as r:
                assert r.status == 200
            slow, raw = await timed(True)
            plain, doc = await timed(False)
            async with s.delete(url + "/admin/faults") as r:
                assert r.status == 200
            again, _ = await timed(True)
        # headers and at least one later write each wait 0.3 s
        assert slow >= base + 0.55, (base, slow)
        assert raw.count(b'"content"') >= 6 and raw.endswith(b"data: [DONE]\n\n")
        assert plain >= 0.3 and b'"completion_tokens":6' in doc.replace(b" ", b"")
        assert again < base + 0.25, (base, again)

    run([EmulatedNode("a", "A100")], body, speed=math.inf)


def test_errors_fault_rate_and_clear() -> None:
    async def body(emu: Emulator) -> None:
        url = emu.urls["a"]
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/admin/faults", json={"kind": "errors", "rate": 0.3}) as r:
                assert r.status == 200

            async def status() -> int:
                async with await chat(s, url, max_tokens=2) as r:
                    await r.read()
                    return r.status

            codes = await asyncio.gather(*(status() for _ in range(300)))
            assert set(codes) == {200, 500}
            assert 60 <= codes.count(500) <= 120  # 90 expected
            async with s.delete(url + "/admin/faults") as r:
                assert r.status == 200
            codes = await asyncio.gather(*(status() for _ in range(50)))
            assert set(codes) == {200}

    run([EmulatedNode("a", "A100")], body, speed=math.inf)


def test_hang_fault_accepts_and_never_answers_until_cleared() -> None:
    async def body(emu: Emulator) -> None:
        url = emu.urls["a"]
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/admin/faults", json={"kind": "hang"}) as r:
                assert r.status == 200
            with pytest.raises(asyncio.TimeoutError):
                async with s.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                                  timeout=aiohttp.ClientTimeout(total=0.3)) as r:
                    await r.read()
            waiting = asyncio.ensure_future(chat(s, url, max_tokens=2))
            await asyncio.sleep(0.1)
            assert not waiting.done()
            async with s.delete(url + "/admin/faults"):
                pass
            async with await waiting as r:
                assert r.status == 200
            # shutting down with a request still hung must not wait for it
            emu.server("a").inject(parse_fault({"kind": "hang"}))
            hung = asyncio.ensure_future(chat(s, url, max_tokens=2))
            await asyncio.sleep(0.05)
            t = time.perf_counter()
            await emu.stop()
            assert time.perf_counter() - t < 0.5
            with pytest.raises(aiohttp.ClientError):
                await hung

    run([EmulatedNode("a", "A100")], body, speed=20)


def test_crash_drops_streams_refuses_connections_and_recovers_through_a_peer() -> None:
    async def body(emu: Emulator) -> None:
        url, peer = emu.urls["a"], emu.urls["b"]
        async with aiohttp.ClientSession() as s:
            r = await chat(s, url, max_tokens=5000, stream=True)
            assert r.status == 200
            await r.content.readline()
            async with s.post(url + "/admin/faults", json={"kind": "crash"}) as resp:
                assert resp.status == 200
            with pytest.raises(aiohttp.ClientError):
                async for _ in r.content.iter_any():
                    pass
            r.close()
            await asyncio.sleep(0.05)
            with pytest.raises(aiohttp.ClientConnectorError):
                async with s.get(url + "/health"):
                    pass
            assert emu.server("a").driver.in_flight == 0
            async with s.delete(peer + "/admin/faults", params={"node": "a"}) as resp:
                assert resp.status == 200
            await asyncio.sleep(0.05)
            async with await chat(s, url, max_tokens=3) as resp:
                assert resp.status == 200

    run([EmulatedNode("a", "A100"), EmulatedNode("b", "A100")], body, speed=20)


def test_scheduled_fault_and_stall() -> None:
    node = EmulatedNode("a", "H100", faults=(
        parse_fault({"kind": "errors", "rate": 1.0, "at_s": 0.5, "duration_s": 1.0}),))

    async def body(emu: Emulator) -> None:
        url = emu.urls["a"]
        async with aiohttp.ClientSession() as s:
            async def status() -> int:
                async with await chat(s, url, max_tokens=2) as r:
                    return r.status

            assert await status() == 200  # at ~0 s
            await asyncio.sleep(0.9)
            assert await status() == 500  # at ~0.9 s, inside [0.5, 1.5)
            await asyncio.sleep(0.9)
            assert await status() == 200  # at ~1.8 s
            emu.server("a").inject(parse_fault({"kind": "stall", "seconds": 0.4}))
            t = time.perf_counter()
            assert await status() == 200
            assert time.perf_counter() - t >= 0.3
            async with s.post(url + "/admin/faults", json={
                    "kind": "stall", "seconds": 0.05, "period_s": 0.2, "duration_s": 0.5}):
                pass
            async with s.get(url + "/admin/faults") as r:
                assert [f["kind"] for f in (await r.json())["faults"]] == ["stall"]
            await asyncio.sleep(0.6)
            async with s.get(url + "/admin/faults") as r:
                assert (await r.json())["faults"] == []

    run([node], body, speed=10)
