"""The emulated engines speak vLLM's disaggregated prefill/decode protocol over the
OpenAI API, in the request and answer shapes vllm-router 0.1.17 uses (facts.md):
the prefill leg holds the prompt's KV and names it, the decode leg pulls it (the
transfer time over the KV link) and computes only the prompt's last token."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tailguard.emulator import EmulatedNode, Emulator, run_emulator

MODEL = "llama-3.1-8b"
PROMPT = "tell me " * 2000  # about 4,000 tokens
NODES = [EmulatedNode("pre", "H100-SXM", (MODEL,)), EmulatedNode("dec", "A100-80GB", (MODEL,))]
# vllm-router's prefill leg: the client's body, not streamed, one token, and these.
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}


def run(body: Callable[[Emulator], Awaitable[None]], speed: float = 5.0) -> None:
    async def main() -> None:
        async with run_emulator(NODES, speed=speed) as emu:
            await asyncio.wait_for(body(emu), 30)

    asyncio.run(main())


async def kv_counts(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    return {str(sample.labels["direction"]): sample.value
            for fam in text_string_to_metric_families(text)
            if fam.name == "tailguard_emulator_kv_transfers"
            for sample in fam.samples if sample.name.endswith("_total")}


def test_a_prefill_leg_holds_the_kv_and_the_decode_leg_pulls_it() -> None:
    async def body(emu: Emulator) -> None:
        pre, dec = emu.server("pre"), emu.server("dec")
        client = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
                  "max_tokens": 40, "stream": True, "stream_options": {"include_usage": True}}
        leg = {k: v for k, v in client.items() if k != "stream_options"}
        leg.update(stream=False, max_tokens=1, min_tokens=1, kv_transfer_params=REMOTE_DECODE)
        headers = {"X-Request-Id": "r-1"}
        async with aiohttp.ClientSession() as s:
            async with s.post(emu.urls["pre"] + "/v1/chat/completions", json=leg,
                              headers=headers) as r:
                assert r.status == 200
                answer = await r.json()
            assert answer["choices"][0]["finish_reason"] == "length"
            assert answer["usage"]["completion_tokens"] == 1
            params = answer["kv_transfer_params"]
            assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
            assert params["remote_engine_id"] == "pre" and params["tp_size"] == 1
            assert params["remote_port"] == pre.port and len(params["remote_block_ids"]) > 200
            assert pre.driver.engine.num_held == 1  # held for the decode side
            decode_leg = dict(client, kv_transfer_params=params)
            async with s.post(emu.urls["dec"] + "/v1/chat/completions", json=decode_leg,
                              headers=headers) as r:
                assert r.status == 200
                events = [line for line in (await r.text()).splitlines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
            usage = json.loads(events[-1][6:])["usage"]
            assert usage["completion_tokens"] == 40
        assert pre.driver.engine.num_held == 0 and pre.driver.engine.kv_used_blocks == 0
        # The decode engine computed one prompt token of the ~4,000 (its counter counts
        # the prompts that produced a first token, whole).
        assert dec.kv_received == 1 and pre.kv_sent == 1 and dec.kv_missing == 0
        assert await kv_counts(emu.urls["dec"]) == {"sent": 0, "received": 1, "missing": 0}
        assert await kv_counts(emu.urls["pre"]) == {"sent": 1, "received": 0, "missing": 0}

    run(body)


def test_kv_that_is_gone_is_computed_again_locally() -> None:
    async def body(emu: Emulator) -> None:
        gone: dict[str, Any] = {"do_remote_prefill": True, "do_remote_decode": False,
                                "remote_engine_id": "pre", "remote_request_id": "pre-999",
                                "remote_block_ids": [0], "remote_host": "127.0.0.1",
                                "remote_port": 1, "tp_size": 1}
        body_ = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3,
                 "kv_transfer_params": gone}
        async with aiohttp.ClientSession() as s:
            async with s.post(emu.urls["dec"] + "/v1/completions", json=body_) as r:
                assert r.status == 200
                assert (await r.json())["usage"]["completion_tokens"] == 3
            bad = dict(body_, kv_transfer_params=["not", "an", "object"])
            async with s.post(emu.urls["dec"] + "/v1/completions", json=bad) as r:
                assert r.status == 400
                assert "kv_transfer_params" in (await r.json())["error"]["message"]
            # SGLang's P/D request (the same body to both sides, a bootstrap room): refused.
            sglang = {"model": MODEL, "prompt": "hi", "max_tokens": 3,
                      "bootstrap_host": "127.0.0.1", "bootstrap_port": 8998,
                      "bootstrap_room": 12345}
            async with s.post(emu.urls["dec"] + "/v1/completions", json=sglang) as r:
                assert r.status == 400
                assert "SGLang" in (await r.json())["error"]["message"]
        assert emu.server("dec").kv_missing == 1

    run(body)


def test_a_client_gone_before_the_pull_frees_the_kv_at_expiry(monkeypatch: Any) -> None:
    from tailguard.emulator import server as server_module

    monkeypatch.setattr(server_module, "KV_HOLD_S", 0.2)

    async def body(emu: Emulator) -> None:
        leg = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1,
               "kv_transfer_params": REMOTE_DECODE}
        async with aiohttp.ClientSession() as s, \
                s.post(emu.urls["pre"] + "/v1/completions", json=leg) as r:
            assert r.status == 200 and "kv_transfer_params" in await r.json()
        pre = emu.server("pre")
        assert pre.driver.engine.num_held == 1
        await asyncio.sleep(0.4)
        assert pre.driver.engine.num_held == 0 and not pre._held

    run(body)
