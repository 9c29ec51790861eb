"""The gateway on real sockets: OpenAI client paths, errors, failover, timeouts, accounting.

Upstreams are the fake engines of ``gateway_fakes`` (to move to the emulator
where it can express the case: see the module docstring there).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import openai
import pytest
from gateway_fakes import fleet_and_gateway, wait_for
from prometheus_client.parser import text_string_to_metric_families

from tailguard.core.fleet import NodeState
from tailguard.gateway.app import RunningGateway

MSG = [{"role": "user", "content": "hello there"}]
RR = {"pools": {"m": {"policy": "round_robin"}}}  # deterministic alternation


def client_for(gw: RunningGateway, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=10)


def metric_values(text: str) -> dict[str, float]:
    """Sum of every sample per sample name (labels folded), from the exposition text."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


async def post(gw: RunningGateway, path: str, body: Any, **kw: Any) -> tuple[int, dict[str, Any],
                                                                             dict[str, str]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with aiohttp.ClientSession() as s, s.post(gw.url + path, data=data, **kw) as r:
        raw = await r.read()
        return r.status, (json.loads(raw) if raw else {}), dict(r.headers)


async def stream_raw(gw: RunningGateway, body: dict[str, Any]) -> tuple[int, bytes, str]:
    async with aiohttp.ClientSession() as s, \
            s.post(gw.url + "/v1/chat/completions", json={**body, "stream": True}) as r:
        return r.status, await r.read(), r.headers.get("x-tailguard-node", "")


def test_openai_client_happy_paths() -> None:
    async def body() -> None:
        async with fleet_and_gateway(["a", "b"]) as (gw, engines):
            client = client_for(gw)
            try:
                raw = await client.chat.completions.with_raw_response.create(
                    model="m", messages=MSG, max_tokens=4)  # type: ignore[arg-type]
                assert raw.headers["x-tailguard-node"] in ("a", "b")
                chat = raw.parse()
                assert chat.choices[0].message.content == " tok" * 4
                assert chat.usage is not None and chat.usage.completion_tokens == 4

                chunks = []
                stream = await client.chat.completions.create(
                    model="m", messages=MSG, max_tokens=6, stream=True,  # type: ignore[arg-type]
                    stream_options={"include_usage": True})
                async for ch in stream:
                    chunks.append(ch)
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                assert text == " tok" * 6
                assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6

                comp = await client.completions.create(model="m", prompt="hi", max_tokens=3)
                assert comp.choices[0].text == " tok" * 3
                comp_stream = await client.completions.create(model="m", prompt="hi",
                                                              max_tokens=5, stream=True)
                pieces = [c.choices[0].text async for c in comp_stream]
                assert "".join(pieces) == " tok" * 5

                emb = await client.embeddings.create(model="m", input="hello")
                assert emb.data[0].embedding == [0.1, 0.2]

                models = await client.models.list()
                assert [m.id for m in models.data] == ["m"]
            finally:
                await client.close()
            assert gw.fleet.in_flight() == 0
            # Tokens: 4 (usage body) + 6 (usage chunk) + 3 (usage body) + 5 (counted events).
            async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
                values = metric_values(await r.text())
            assert values["tailguard_output_tokens_total"] == 18
            assert values["tailguard_requests_total"] == 5
            assert values["tailguard_ttft_seconds_count"] == 2
            assert sum(e.served for e in engines) == 5

    asyncio.run(body())


def test_unknown_fields_and_headers_pass_through() -> None:
    async def body() -> None:
        async with fleet_and_gateway(["a"]) as (gw, (a,)):
            status, data, headers = await post(
                gw, "/v1/chat/completions",
                {"model": "m", "messages": MSG, "max_tokens": 2, "vendor_knob": {"x": [1, 2]}},
                headers={"X-Trace": "t-1", "Authorization": "Bearer user-key",
                         "Connection": "keep-alive"})
            assert status == 200 and headers["x-tailguard-node"] == "a"
            assert data["engine"] == "a"  # the engine's own field came back untouched
            seen = a.seen[-1]
            assert seen.body["vendor_knob"] == {"x": [1, 2]}
            assert seen.headers["X-Trace"] == "t-1"
            assert seen.headers["Authorization"] == "Bearer user-key"  # no gateway keys: passed
            status, raw, _ = await stream_raw(gw, {"model": "m", "messages": MSG, "max_tokens": 2})
            assert status == 200 and raw.endswith(b"data: [DONE]\n\n")
            assert raw.count(b"data: ") == 4  # role, 2 tokens, [DONE]: byte for byte

    asyncio.run(body())


BAD_INPUTS: list[tuple[str, bytes | dict[str, Any], int, str]] = [
    ("/v1/chat/completions", b"{not json", 400, "invalid_json"),
    ("/v1/chat/completions", b"[1, 2]", 400, "invalid_json"),
    ("/v1/chat/completions", {"messages": MSG}, 400, "missing_field"),
    ("/v1/chat/completions", {"model": 7, "messages": MSG}, 400, "invalid_value"),
    ("/v1/chat/completions", {"model": "m"}, 400, "missing_field"),
    ("/v1/chat/completions", {"model": "m", "messages": []}, 400, "invalid_value"),
    ("/v1/chat/completions", {"model": "m", "messages": MSG, "stream": "true"}, 400,
     "invalid_value"),
    ("/v1/chat/completions", {"model": "m", "messages": MSG, "max_tokens": -1}, 400,
     "invalid_value"),
    ("/v1/completions", {"model": "m"}, 400, "missing_field"),
    ("/v1/embeddings", {"model": "m", "input": {"a": 1}}, 400, "invalid_value"),
    ("/v1/chat/completions", {"model": "gpt-9", "messages": MSG}, 404, "model_not_found"),
    ("/v1/chat/completions", {"model": "m", "messages": MSG, "pad": "x" * 5000}, 413,
     "body_too_large"),
    ("/v1/images/generations", {"model": "m"}, 404, "not_found"),
]


def test_bad_inputs_table() -> None:
    async def body() -> None:
        async with fleet_and_gateway(["a"], max_body_bytes=4096) as (gw, (a,)):
            for path, payload, status, code in BAD_INPUTS:
                got, data, _ = await post(gw, path, payload)
                assert got == status, (path, payload, data)
                err = data["error"]
                assert err["code"] == code, (payload, err)
                assert set(err) >= {"message", "type", "code"} and err["message"]
                assert err["type"] == "invalid_request_error"
            # a chunked body over the limit is refused the same way
            async def chunks() -> Any:
                for _ in range(10):
                    yield b"x" * 1000
            async with aiohttp.ClientSession() as s, \
                    s.post(gw.url + "/v1/chat/completions", data=chunks()) as r:
                assert r.status == 413
            assert a.served == 0 and gw.fleet.in_flight() == 0
            # the openai client maps them to its typed errors
            client = client_for(gw)
            try:
                with pytest.raises(openai.NotFoundError):
                    await client.chat.completions.create(model="nope", messages=MSG)  # type: ignore[arg-type]
                with pytest.raises(openai.BadRequestError):
                    await client.chat.completions.create(model="m", messages=[])
            finally:
                await client.close()

    asyncio.run(body())


def test_node_killed_before_a_request_fails_over() -> None:
    async def body() -> None:
        async with fleet_and_gateway(["a", "b"], **RR) as (gw, (a, b)):
            await a.stop()
            client = client_for(gw)
            try:
                for i in range(6):
                    raw = await client.chat.completions.with_raw_response.create(
                        model="m", messages=MSG, max_tokens=2, stream=i % 2 == 1)  # type: ignore[arg-type]
                    assert raw.headers["x-tailguard-node"] == "b"
                    raw.parse()
            finally:
                await client.close()
            assert b.served == 6 and gw.fleet.in_flight() == 0
            async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
                text = await r.text()
            assert 'tailguard_retries_total{origin="connect_failure",pool="m"}' in text
            assert 'tailguard_upstream_errors_total{node="a",origin="connect_failure"}' in text
            # health checks take the dead node out of rotation
            await wait_for(lambda: gw.fleet.balancer.nodes["a"].state is NodeState.DOWN,
                           what="node a down")

    asyncio.run(body())


def test_node_killed_mid_stream() -> None:
    async def body() -> None:
        async with fleet_and_gateway(["a", "b"], **RR) as (gw, engines):
            for e in engines:
                e.behavior.mode = "die_mid_stream"
                e.behavior.die_after = 2
            status, raw, node = await stream_raw(gw, {"model": "m", "messages": MSG,
                                                      "max_tokens": 10})
            assert status == 200
            events = [e for e in raw.split(b"\n\n") if e]
            assert events[1:3] == [events[1]] * 2 and b"tok" in events[1]  # 2 tokens went out
            last = json.loads(events[-1].removeprefix(b"data: "))
            assert last["error"]["code"] == "upstream_disconnected"
            assert node in last["error"]["message"]
            assert gw.fleet.in_flight() == 0
            dead = next(e for e in engines if e.name == node)
            alive = next(e for e in engines if e.name != node)
            await dead.stop()
            alive.behavior.mode = "ok"
            for _ in range(3):
                status, raw, served_by = await stream_raw(gw, {"model": "m", "messages": MSG,
                                                               "max_tokens": 3})
                assert status == 200 and served_by == alive.name
                assert raw.endswith(b"data: [DONE]\n\n")
            assert gw.fleet.in_flight() == 0
            # the openai client surfaces the error event as an APIError
            dead_port = dead.port
            await dead.start(dead_port)
            alive.behavior.mode = dead.behavior.mode = "die_mid_stream"
            client = client_for(gw)
            try:
                stream = await client.chat.completions.create(
                    model="m", messages=MSG, max_tokens=10, stream=True)  # type: ignore[arg-type]
                with pytest.raises(openai.APIError):
                    async for _ in stream:
                        pass
            finally:
                await client.close()
            assert gw.fleet.in_flight() == 0

    asyncio.run(body())


def test_upstream_errors_retry_then_map() -> None:
    async def body() -> None:
        async with fleet_and_gateway(["a", "b"], **RR) as (gw, (a, b)):
            a.behavior.mode = "error500"
            for _ in range(4):
                status, _, headers = await post(gw, "/v1/chat/completions",
                                                {"model": "m", "messages": MSG})
                assert status == 200 and headers["x-tailguard-node"] == "b"
            b.behavior.mode = "error500"
            status, data, headers = await post(gw, "/v1/chat/completions",
                                               {"model": "m", "messages": MSG})
            assert status == 502 and data["error"]["code"] == "upstream_error"
            assert data["error"]["type"] == "server_error"
            a.behavior.mode = b.behavior.mode = "error429"
            status, data, headers = await post(gw, "/v1/chat/completions",
                                               {"model": "m", "messages": MSG})
            assert status == 503 and headers["Retry-After"] == "2"
            assert data["error"]["code"] == "upstream_busy"
            # an engine's own 4xx is the client's problem: passed through, not retried
            a.behavior.mode = b.behavior.mode = "bad_request"
            before = a.served + len(a.seen) + len(b.seen)
            status, data, headers = await post(gw, "/v1/chat/completions",
                                               {"model": "m", "messages": MSG})
            assert status == 400 and data["error"]["message"] == "context too long"
            assert len(a.seen) + len(b.seen) + a.served == before + 1
            assert headers["x-tailguard-node"] in ("a", "b")
            assert gw.fleet.in_flight() == 0

    asyncio.run(body())


def test_timeouts() -> None:
    async def body() -> None:
        timeouts = {"connect_s": 1.0, "first_byte_s": 0.3, "idle_s": 0.3, "total_s": 1.0}
        pools = {"pools": {"m": {"timeouts": timeouts, "retries": {"attempts": 1}}}}
        async with fleet_and_gateway(["a"], **pools) as (gw, (a,)):
            a.behavior.first_delay_s = 2.0
            status, raw, node = await stream_raw(gw, {"model": "m", "messages": MSG})
            assert status == 504 and b"upstream_timeout" in raw and node == "a"
            a.behavior.first_delay_s = 0.0
            a.behavior.token_delay_s = 0.6
            status, raw, _ = await stream_raw(gw, {"model": "m", "messages": MSG, "max_tokens": 3})
            assert status == 200  # the role chunk went out: the error comes in the stream
            assert b'"code": "upstream_timeout"' in raw.split(b"\n\n")[-2]
            # Tokens 0.12 s apart keep a 0.3 s idle timeout alive past 0.3 s in all.
            a.behavior.token_delay_s = 0.12
            status, raw, _ = await stream_raw(gw, {"model": "m", "messages": MSG, "max_tokens": 5})
            assert status == 200 and raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
            a.behavior.token_delay_s = 0.3
            status, data, _ = await post(gw, "/v1/chat/completions",
                                         {"model": "m", "messages": MSG, "max_tokens": 5})
            assert status == 504 and "ran out" in data["error"]["message"]  # total_s 1.0
            assert gw.fleet.in_flight() == 0
            assert gw.fleet.balancer.double_release == 0

    asyncio.run(body())


def test_client_disconnect_releases_the_permit() -> None:
    async def body() -> None:
        async with fleet_and_gateway(["a"]) as (gw, (a,)):
            a.behavior.token_delay_s = 0.05
            req = {"model": "m", "messages": MSG, "max_tokens": 200}
            async with aiohttp.ClientSession() as s:
                r = await s.post(gw.url + "/v1/chat/completions", json={**req, "stream": True})
                await r.content.readany()
                assert gw.fleet.in_flight() == 1
                r.close()
            await wait_for(lambda: gw.fleet.in_flight() == 0, what="stream permit released")
            async with aiohttp.ClientSession() as s:
                # a non-streamed answer: the client gives up before it arrives
                task = asyncio.create_task(s.post(gw.url + "/v1/chat/completions", json=req))
                await wait_for(lambda: gw.fleet.in_flight() == 1, what="dispatch")
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            await wait_for(lambda: gw.fleet.in_flight() == 0, what="permit released")
            assert gw.fleet.balancer.double_release == 0
            async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
                assert 'tailguard_requests_total{code="499",pool="m"} 2.0' in await r.text()

    asyncio.run(body())


def test_api_keys_guard_v1_and_are_not_forwarded() -> None:
    async def body() -> None:
        async with fleet_and_gateway(["a"], api_keys=["sekret", "other"]) as (gw, (a,)):
            req = {"model": "m", "messages": MSG}
            status, data, _ = await post(gw, "/v1/chat/completions", req)
            assert status == 401 and data["error"]["type"] == "authentication_error"
            status, _, _ = await post(gw, "/v1/chat/completions", req,
                                      headers={"Authorization": "Bearer nope"})
            assert status == 401
            client = client_for(gw, key="sekret")
            try:
                out = await client.chat.completions.create(model="m", messages=MSG)  # type: ignore[arg-type]
                assert out.choices[0].message.content
            finally:
                await client.close()
            assert "Authorization" not in a.seen[-1].headers
            async with aiohttp.ClientSession() as s, s.get(gw.url + "/health") as r:
                assert r.status == 200  # probes need no key

    asyncio.run(body())


def test_health_ready_and_no_capacity() -> None:
    async def body() -> None:
        async with fleet_and_gateway(["a", "b"]) as (gw, engines):
            async with aiohttp.ClientSession() as s:
                for path in ("/health", "/ready"):
                    async with s.get(gw.url + path) as r:
                        assert r.status == 200
                for e in engines:
                    e.behavior.health_status = 503
                await wait_for(lambda: not gw.fleet.ready(), what="all nodes down")
                async with s.get(gw.url + "/ready") as r:
                    assert r.status == 503
                async with s.get(gw.url + "/health") as r:
                    assert r.status == 200  # the gateway itself is alive
            status, data, headers = await post(gw, "/v1/chat/completions",
                                               {"model": "m", "messages": MSG})
            assert status == 503 and headers["Retry-After"] == "1"
            assert data["error"]["code"] == "no_capacity"
            engines[1].behavior.health_status = 200
            await wait_for(gw.fleet.ready, what="node b back")
            status, _, headers = await post(gw, "/v1/chat/completions",
                                            {"model": "m", "messages": MSG})
            assert status == 200 and headers["x-tailguard-node"] == "b"

    asyncio.run(body())


def test_engine_metrics_are_scraped_and_go_stale() -> None:
    async def body() -> None:
        async with fleet_and_gateway(["a"]) as (gw, (a,)):
            a.behavior.running, a.behavior.waiting = 3, 1
            node = gw.fleet.balancer.nodes["a"]
            await wait_for(lambda: node.engine.running == 3, what="scrape")
            assert node.engine.waiting == 1 and node.engine.kv_usage == 0.25
            assert gw.fleet.monitors["a"].engine == "vllm"  # detected
            # A preemption since the last scrape: the node is short of KV cache
            # (what it times now is the load's).
            assert node.engine.preemptions == 0 and not node.kv_short_since(time.monotonic())
            a.behavior.preemptions = 2
            await wait_for(lambda: node.engine.preemptions == 2, what="preemptions scraped")
            assert node.kv_short_since(time.monotonic() - 1.0)
            a.behavior.metrics_status = 500
            await wait_for(lambda: gw.fleet.monitors["a"].stale, what="stale")
            assert node.engine.running == -1  # withdrawn from the balancer
            async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
                text = await r.text()
            values = {f.name: f for f in text_string_to_metric_families(text)}
            stale = values["tailguard_node_engine_metrics_stale"].samples[0]
            assert stale.value == 1.0 and stale.labels == {"node": "a", "gpu": "L4"}

    asyncio.run(body())


def test_metrics_parse_and_name_their_units() -> None:
    async def body() -> None:
        async with fleet_and_gateway(["a"]) as (gw, _):
            await post(gw, "/v1/chat/completions", {"model": "m", "messages": MSG})
            await post(gw, "/v1/chat/completions", {"model": "zzz", "messages": MSG})
            await stream_raw(gw, {"model": "m", "messages": MSG})
            async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
                assert r.status == 200
                text = await r.text()
            families = {f.name: f for f in text_string_to_metric_families(text)}
            for name in ("tailguard_requests", "tailguard_ttft_seconds", "tailguard_tpot_seconds",
                         "tailguard_e2e_seconds", "tailguard_in_flight_requests",
                         "tailguard_node_capacity_tokens_per_second", "tailguard_node_state",
                         "tailguard_retries", "tailguard_upstream_errors",
                         "tailguard_output_tokens", "tailguard_node_slots"):
                assert name in families, name
            codes = {(s.labels["pool"], s.labels["code"]): s.value
                     for s in families["tailguard_requests"].samples if s.name.endswith("_total")}
            assert codes == {("m", "200"): 2.0, ("_unknown", "404"): 1.0}
            states = {s.labels["state"]: s.value for s in families["tailguard_node_state"].samples}
            assert states["healthy"] == 1.0 and states["down"] == 0.0
            for fam in families.values():
                for sample in fam.samples:
                    assert set(sample.labels) <= {"pool", "node", "gpu", "code", "origin",
                                                  "state", "kind", "result", "le", "role"}

    asyncio.run(body())


def test_upstream_keepalive_shows_in_metrics() -> None:
    """Sequential requests to one node go over one kept-alive connection, and the
    upstream series say so; a refused connection is counted as a connect error."""
    async def body() -> None:
        async with fleet_and_gateway(["a"]) as (gw, (a,)):
            for i in range(5):
                req = {"model": "m", "messages": MSG, "max_tokens": 3}
                if i % 2:
                    status = (await post(gw, "/v1/chat/completions", req))[0]
                else:
                    status = (await stream_raw(gw, req))[0]
                assert status == 200
            async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
                values = metric_values(await r.text())
            assert values["tailguard_upstream_connections_opened_total"] == 1
            assert values["tailguard_upstream_connection_reuses_total"] == 4
            assert values["tailguard_upstream_idle_connections"] == 1
            assert values["tailguard_upstream_connect_errors_total"] == 0
            await a.stop()  # the engine goes away: its idle connection closes too
            status, _, _ = await post(gw, "/v1/chat/completions",
                                      {"model": "m", "messages": MSG, "max_tokens": 3})
            assert status in (502, 503)
            async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
                values = metric_values(await r.text())
            assert values["tailguard_upstream_connect_errors_total"] >= 1

    asyncio.run(body())


def test_every_response_the_gateway_writes_says_nosniff() -> None:
    """What the gateway writes itself (errors, metrics, the dashboard's state, the model
    list, health) is never sniffed into another type by a browser; an engine's answer
    goes as the engine typed it."""
    async def body() -> None:
        async with fleet_and_gateway(["a"]) as (gw, _), aiohttp.ClientSession() as s:
            status, _, headers = await post(gw, "/v1/chat/completions",
                                            {"model": "m", "messages": MSG, "max_tokens": 2})
            assert status == 200 and headers["Content-Type"].startswith("application/json")
            status, _, headers = await post(gw, "/v1/chat/completions", b"{not json")
            assert status == 400 and headers["X-Content-Type-Options"] == "nosniff"
            for path in ("/metrics", "/dashboard/state", "/v1/models", "/healthz", "/nowhere"):
                async with s.get(gw.url + path) as r:
                    await r.read()
                    assert r.headers.get("X-Content-Type-Options") == "nosniff", path

    asyncio.run(body())
