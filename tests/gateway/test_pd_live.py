"""The gateway drives vLLM's P/D over real sockets: a fleet file with prefill and
decode nodes, emulated engines that speak the protocol, the official openai
client. Long prompts are computed on a prefill node and pulled by a decode node;
short ones stay on their decode node; a dead prefill node costs the client
nothing; a decode node that dies or stalls mid-answer hands its streams to
another pair; every permit ends once."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import openai
import pytest
from gateway_fakes import wait_for

from tailguard.bench.loadgen import BenchConfig, run_bench
from tailguard.config.fleet import parse_fleet
from tailguard.core.policies import Slo
from tailguard.emulator import EmulatedNode, parse_fault, run_emulator
from tailguard.emulator.server import Emulator
from tailguard.gateway.app import RunningGateway, run_gateway
from tailguard.traffic.workload import FixedLength

MODEL = "llama-3.1-8b"


def long(i: int) -> list[dict[str, str]]:
    """About 16,000 tokens, no prefix shared with another request's (a repeated one
    is cached where it was decoded, and rightly stays there)."""
    return [{"role": "user", "content": f"question {i}: " + "tell me " * 8000}]

SHORT = [{"role": "user", "content": "hi"}]
ROLES = {"pre0": ("H100-SXM", "prefill"), "pre1": ("H100-SXM", "prefill"),
         "dec0": ("A100-80GB", "decode"), "dec1": ("A100-80GB", "decode")}


@asynccontextmanager
async def pd_fleet(policy: str = "tailguard") -> AsyncIterator[tuple[RunningGateway, Emulator]]:
    os.environ["TG_TEST_PD_TOKEN"] = "tok"
    nodes = [EmulatedNode(nid, gpu, models=(MODEL,)) for nid, (gpu, _) in ROLES.items()]
    async with run_emulator(nodes, speed=10.0) as emu:
        cfg = parse_fleet({
            "listen": "127.0.0.1:0",
            "nodes": [{"id": nid, "url": emu.urls[nid], "gpu": gpu, "models": [MODEL],
                       "role": role} for nid, (gpu, role) in ROLES.items()],
            "pools": {MODEL: {"policy": policy}},
            "admin": {"token_env": "TG_TEST_PD_TOKEN"},
        })
        async with run_gateway(cfg) as gw:
            yield gw, emu


def transfers(emu: Emulator) -> tuple[int, int, int]:
    """KV sent by prefill engines, received and missing on decode engines."""
    s = emu.servers
    return (s["pre0"].kv_sent + s["pre1"].kv_sent, s["dec0"].kv_received + s["dec1"].kv_received,
            s["dec0"].kv_missing + s["dec1"].kv_missing)


async def ask(client: openai.AsyncOpenAI, messages: list[dict[str, str]], stream: bool,
              max_tokens: int = 8) -> int:
    if not stream:
        r = await client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                                 max_tokens=max_tokens)
        assert r.usage is not None
        return r.usage.completion_tokens
    out = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True})
    usage = None
    async for chunk in out:
        usage = chunk.usage or usage
    assert usage is not None
    return usage.completion_tokens


def test_long_prompts_go_through_both_legs_and_short_ones_stay() -> None:
    async def body() -> None:
        async with pd_fleet() as (gw, emu):
            client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
            try:
                got = await asyncio.gather(*(ask(client, long(i), stream=i % 2 == 0)
                                             for i in range(6)))
                assert got == [8] * 6
                # Most prompts are computed on the H100s and pulled by the decode node
                # (the router computes some beside the decodes once the prefill nodes
                # have a backlog); every pulled KV was there to pull.
                sent, received, missing = transfers(emu)
                assert sent == received >= 3 and missing == 0
                assert await ask(client, SHORT, stream=True) == 8
                assert transfers(emu) == (sent, received, 0)  # computed on its decode node
                assert await ask(client, long(0), stream=True) == 8  # cached where decoded
                assert transfers(emu) == (sent, received, 0)
            finally:
                await client.close()
            assert gw.fleet.in_flight() == 0
            assert gw.fleet.balancer.double_release == 0
            for server in emu.servers.values():
                assert server.driver.engine.num_held == 0
            async with aiohttp.ClientSession() as s, \
                    s.get(gw.url + "/admin/nodes", headers={"Authorization": "Bearer tok"}) as r:
                assert r.status == 200, await r.text()
                doc = await r.json()
            nodes = doc["nodes"]
            assert {n["id"]: n["role"] for n in nodes} == {k: v[1] for k, v in ROLES.items()}
            async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
                text = await r.text()
            assert 'tailguard_node_role{gpu="H100-SXM",node="pre0",role="prefill"} 1.0' in text
            # Each leg timed on its own node: every prompt pulled was a prefill leg on
            # a prefill node; the streamed ones' decode sides are timed on decode nodes.
            reg = gw.metrics.registry

            def count(name: str, nodes: tuple[str, ...], gpu: str) -> float:
                return sum(reg.get_sample_value(f"{name}_count", {
                    "pool": MODEL, "node": n, "gpu": gpu}) or 0.0 for n in nodes)

            assert count("tailguard_prefill_leg_seconds", ("pre0", "pre1"), "H100-SXM") == sent
            assert count("tailguard_prefill_leg_seconds", ("dec0", "dec1"), "A100-80GB") == 0
            def handoffs() -> float:
                return count("tailguard_handoff_first_token_seconds", ("dec0", "dec1"),
                             "A100-80GB")

            before = handoffs()
            assert before <= sent
            # One more long prompt, streamed, on an idle fleet: through both legs.
            client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
            try:
                assert await ask(client, long(99), stream=True) == 8
            finally:
                await client.close()
            assert transfers(emu)[0] == sent + 1
            assert handoffs() == before + 1
            assert count("tailguard_prefill_leg_seconds", ("pre0", "pre1"), "H100-SXM") \
                == sent + 1
            assert count("tailguard_handoff_first_token_seconds", ("pre0", "pre1"),
                         "H100-SXM") == 0

    asyncio.run(asyncio.wait_for(body(), 60))


def test_a_dead_prefill_node_costs_the_client_nothing() -> None:
    async def body() -> None:
        async with pd_fleet() as (gw, emu):
            emu.server("pre0").inject(parse_fault({"kind": "crash", "duration_s": 60}))
            client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
            try:
                got = await asyncio.gather(*(ask(client, long(i), stream=True)
                                             for i in range(6)))
                assert got == [8] * 6  # no error: retried on the other pair, or local
            finally:
                await client.close()
            assert gw.fleet.in_flight() == 0
            assert gw.fleet.balancer.double_release == 0
            assert emu.server("pre0").kv_sent == 0

    asyncio.run(asyncio.wait_for(body(), 60))


def test_a_dead_decode_node_and_a_refused_prompt() -> None:
    async def body() -> None:
        async with pd_fleet() as (gw, emu):
            emu.server("dec0").inject(parse_fault({"kind": "crash", "duration_s": 60}))
            client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
            try:
                got = await asyncio.gather(*(ask(client, long(i), stream=True)
                                             for i in range(4)))
                assert got == [8] * 4  # the decode leg retried on the other decode node
                # A prompt no engine can hold: the prefill engine's own 400, passed on.
                too_long = [{"role": "user", "content": "x " * 600_000}]
                try:
                    await ask(client, too_long, stream=True)
                    raise AssertionError("a prompt over the context length was served")
                except openai.BadRequestError as exc:
                    assert "context length" in str(exc)
            finally:
                await client.close()
            assert gw.fleet.in_flight() == 0
            assert gw.fleet.balancer.double_release == 0

    asyncio.run(asyncio.wait_for(body(), 60))


async def watched(client: openai.AsyncOpenAI, i: int, max_tokens: int,
                  chunks: list[int]) -> tuple[int, int, int, int]:
    """A long prompt's stream read to its end: (role deltas, content chunks, finish
    reasons, completion tokens); ``chunks[i]`` counts its chunks as they come."""
    out = await client.chat.completions.create(
        model=MODEL, messages=long(100 + i), max_tokens=max_tokens, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True})
    roles = content = finishes = 0
    usage = None
    async for chunk in out:
        chunks[i] += 1
        usage = chunk.usage or usage
        for choice in chunk.choices:
            roles += bool(choice.delta.role)
            content += bool(choice.delta.content)
            finishes += bool(choice.finish_reason)
    assert usage is not None
    return roles, content, finishes, usage.completion_tokens


ANSWER = 1500


@pytest.mark.parametrize("kind", ["crash", "stall"])
def test_a_decode_node_failing_mid_stream_hands_its_streams_to_another_pair(kind: str) -> None:
    """A decode node crashes (or stalls) under streams that have started: each goes on
    from another decode node, its continuation's prompt (the long prompt plus the
    answer so far) computed on a prefill node and pulled as any other, and the
    client reads one whole answer."""
    async def body() -> None:
        async with pd_fleet() as (gw, emu):
            client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x",
                                        max_retries=0)
            chunks = [0] * 4
            try:
                # long answers (a token is about a millisecond here): the four are
                # still under way when the fault comes
                tasks = [asyncio.create_task(watched(client, i, ANSWER, chunks))
                         for i in range(4)]
                nodes = gw.fleet.balancer.nodes
                while max(nodes["dec0"].decoding, nodes["dec1"].decoding) == 0 \
                        or min(chunks) < 5:
                    await asyncio.sleep(0.01)
                victim = max(("dec0", "dec1"), key=lambda n: nodes[n].decoding)
                other = "dec1" if victim == "dec0" else "dec0"
                pulled = emu.server(other).kv_received
                fault = {"kind": "crash", "duration_s": 60} if kind == "crash" \
                    else {"kind": "stall", "seconds": 20}
                emu.server(victim).inject(parse_fault(fault))
                got = await asyncio.gather(*tasks)
                # one role delta, one finish, every token once (a chunk of the old
                # node after the seam would be one too many)
                assert got == [(1, ANSWER, 1, ANSWER)] * 4, (kind, got)
                assert emu.server(other).kv_received > pulled  # a continuation, P/D
            finally:
                await client.close()
            reg = gw.metrics.registry
            cause = "failure" if kind == "crash" else "stall"
            assert reg.get_sample_value("tailguard_migrations_total", {
                "pool": MODEL, "cause": cause, "result": "moved"}), kind
            async with aiohttp.ClientSession() as s, \
                    s.get(gw.url + "/dashboard/state") as r:
                state = await r.json()
            assert state["pools"][0]["migrations"].get(f"{cause}/moved", 0) >= 1, state
            assert {n["id"]: n["role"] for n in state["nodes"]} == \
                {k: v[1] for k, v in ROLES.items()}
            await wait_for(lambda: gw.fleet.in_flight() == 0, timeout=5.0, what="drained")
            assert gw.fleet.balancer.double_release == 0

    asyncio.run(asyncio.wait_for(body(), 60))


def test_bench_reports_the_prefill_leg_of_each_answer() -> None:
    """``tailguard bench`` against a P/D fleet: each answer names the node that computed
    its prompt and that leg's time (response headers), summed up per run."""
    async def body() -> None:
        async with pd_fleet() as (gw, _):
            cfg = BenchConfig(gw.url, model=MODEL, concurrency=2, duration_s=1.5,
                              input_tokens=FixedLength(16000), output_tokens=FixedLength(8),
                              slo=Slo(5.0, 0.1), max_requests=6)
            doc = await run_bench(cfg)
        r = doc["results"]["bench"]
        assert r["completed"] == r["requests"] >= 2
        pd = r["disaggregated"]
        # long prompts: most go through a prefill node (the router may compute some
        # beside the decodes once the prefill nodes have a backlog)
        assert pd["remote_share"] >= 0.5
        assert set(pd["per_prefill_node"]) <= {"pre0", "pre1"}
        assert 0.0 < pd["prefill_leg_s"]["p50"] < r["ttft_s"]["p50"]
        assert pd["after_prefill_s"]["p50"] > 0.0
        assert set(r["per_node"]) <= {"dec0", "dec1"}  # the answers come from decode nodes

    asyncio.run(asyncio.wait_for(body(), 60))
