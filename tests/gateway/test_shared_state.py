"""Gateway replicas sharing fleet state through a real redis-server (adapters/shared_state.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aiohttp
import pytest
from gateway_fakes import FakeEngine, fleet_doc, wait_for
from redis_server import RedisServer, redis_server

from tailguard.config.fleet import parse_fleet
from tailguard.core.events import Event
from tailguard.core.fleet import NodeState
from tailguard.core.replay import replay
from tailguard.errors import ConfigError
from tailguard.gateway.app import RunningGateway, run_gateway

# Its bars are wall-clock times (a share expiring within its TTL, a leader moving):
# `make test` runs it alone, after the rest has run two at a time.
pytestmark = pytest.mark.solo

TOKEN = "shared-test-token"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(autouse=True)
def admin_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TG_SHARED_TOKEN", TOKEN)


def doc(engines: list[FakeEngine], redis: RedisServer, replica: str, **shared: Any) -> Any:
    return fleet_doc(engines, admin={"token_env": "TG_SHARED_TOKEN"},
                     shared_state={"url": redis.url, "replica": replica, "period_s": 0.1,
                                   "ttl_s": 1.0, "timeout_s": 0.2, **shared})


@asynccontextmanager
async def replicas(engines: list[FakeEngine], redis: RedisServer,
                   names: tuple[str, ...] = ("a", "b"),
                   **extra: Any) -> AsyncIterator[list[RunningGateway]]:
    async with AsyncExitStack() as stack:
        gws = []
        for name in names:
            d = doc(engines, redis, name)
            d.update(extra)
            gws.append(await stack.enter_async_context(run_gateway(parse_fleet(d))))
        await wait_for(lambda: all(g.fleet.shared is not None and g.fleet.shared.replicas ==
                                   len(names) for g in gws), timeout=5.0, what="replicas met")
        yield gws


async def stream(session: aiohttp.ClientSession, gw: RunningGateway, tokens: int = 40) -> int:
    async with session.post(gw.url + "/v1/chat/completions",
                            json={"model": "m", "messages": MSG, "max_tokens": tokens,
                                  "stream": True}) as r:
        await r.read()
        return r.status


async def admin(session: aiohttp.ClientSession, gw: RunningGateway, path: str) -> int:
    async with session.post(gw.url + path, headers={"Authorization": f"Bearer {TOKEN}"}) as r:
        return r.status


def test_config_is_checked() -> None:
    for bad, where in (({"url": "http://x"}, "shared_state.url"),
                       ({"url": "redis://h:1/0", "ttl_s": 0.1, "period_s": 0.25},
                        "shared_state.ttl_s"),
                       ({"url": "redis://h:1/0", "replica": "a b"}, "shared_state.replica"),
                       ({"url": "redis://h:1/0", "bogus": 1}, "shared_state.bogus")):
        with pytest.raises(ConfigError) as err:
            parse_fleet({"nodes": [{"id": "n", "url": "http://127.0.0.1:1", "gpu": "L4",
                                    "models": ["m"]}], "shared_state": bad})
        assert err.value.field == where


def test_replicas_see_each_others_load_and_cordons_within_a_second() -> None:
    async def body() -> None:
        engines = [await FakeEngine(n).start() for n in ("e0", "e1")]
        for e in engines:
            e.behavior.token_delay_s = 0.05  # 40 tokens: two seconds a stream
        try:
            with redis_server() as redis:
                async with replicas(engines, redis) as (a, b), aiohttp.ClientSession() as s:
                    assert sum(g.fleet.shared.leader for g in (a, b)) == 1  # type: ignore[union-attr]
                    streams = [asyncio.create_task(stream(s, a)) for _ in range(4)]
                    await wait_for(lambda: a.fleet.in_flight() == 4, what="a's streams")
                    # b counts a's four (two a node, least request) within a sync or two
                    await wait_for(lambda: sum(n.remote_in_flight for n in
                                               b.fleet.balancer.nodes.values()) == 4,
                                   timeout=1.0, what="b sees a's load")
                    # so b's next requests go where a's are fewer
                    a_e0 = a.fleet.balancer.nodes["e0"].in_flight
                    assert a_e0 == 2
                    # a cordon through a is obeyed by b within 1 s
                    loop = asyncio.get_running_loop()
                    t0 = loop.time()
                    assert await admin(s, a, "/admin/nodes/e0/cordon") == 200
                    await wait_for(lambda: b.fleet.balancer.nodes["e0"].state is
                                   NodeState.CORDONED, timeout=1.0, what="b obeys the cordon")
                    took = loop.time() - t0
                    assert took < 1.0
                    assert all(st == 200 for st in await asyncio.gather(*streams))
                    # what b routes now avoids e0
                    got = await asyncio.gather(*(stream(s, b, 2) for _ in range(6)))
                    assert got == [200] * 6
                    assert b.fleet.balancer.nodes["e0"].dispatched_total == 0
                    # budgets: each may borrow half the other's balance (two replicas)
                    ba, bb = a.fleet.balancer.pools["m"].budget, b.fleet.balancer.pools["m"].budget
                    assert ba.balance > 0.5 and bb.balance > 0.5
                    await wait_for(lambda: abs(bb.lent - ba.balance / 2) < 1e-6
                                   and abs(ba.lent - bb.balance / 2) < 1e-6,
                                   timeout=1.0, what="budgets lent")
                    assert await admin(s, b, "/admin/nodes/e0/uncordon") == 200
                    await wait_for(lambda: a.fleet.balancer.nodes["e0"].state is
                                   NodeState.HEALTHY, timeout=1.0, what="a obeys the uncordon")
                    # the admin API and the metrics show the shared view
                    async with s.get(b.url + "/admin/nodes",
                                     headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                        view = await r.json()
                    assert view["shared_state"]["replicas"] == ["a", "b"]
                    assert view["shared_state"]["up"] is True
                    async with s.get(b.url + "/metrics") as r:
                        text = await r.text()
                    assert "tailguard_shared_state_up 1.0" in text
                    assert "tailguard_shared_state_replicas 2.0" in text
        finally:
            for e in engines:
                await e.stop()

    asyncio.run(body())


def test_redis_killed_mid_run_loses_no_request_and_resyncs() -> None:
    async def body() -> None:
        engines = [await FakeEngine(n).start() for n in ("e0", "e1")]
        for e in engines:
            e.behavior.token_delay_s = 0.005
        try:
            with redis_server() as redis:
                async with replicas(engines, redis) as gws, aiohttp.ClientSession() as s:
                    statuses: list[int] = []
                    stop = asyncio.Event()

                    async def client(i: int) -> None:
                        while not stop.is_set():
                            statuses.append(await stream(s, gws[i % 2], 8))

                    clients = [asyncio.create_task(client(i)) for i in range(6)]
                    await asyncio.sleep(0.5)
                    redis.kill()
                    await wait_for(lambda: not any(g.fleet.shared.up for g in gws),  # type: ignore[union-attr]
                                   timeout=2.0, what="both notice")
                    await asyncio.sleep(1.5)  # past ttl_s: each decides alone
                    assert all(g.fleet.balancer.outliers.authority for g in gws)  # type: ignore[union-attr]
                    async with s.get(gws[0].url + "/metrics") as r:
                        assert "tailguard_shared_state_up 0.0" in await r.text()
                    served_while_down = len(statuses)
                    redis.start()  # same port, empty: everything is republished
                    await wait_for(lambda: all(g.fleet.shared.up and g.fleet.shared.replicas
                                               == 2 for g in gws),  # type: ignore[union-attr]
                                   timeout=3.0, what="resync")
                    assert sum(g.fleet.shared.leader for g in gws) == 1  # type: ignore[union-attr]
                    await asyncio.sleep(0.3)
                    stop.set()
                    await asyncio.gather(*clients)
                    assert served_while_down > 20
                    assert set(statuses) == {200}, sorted(set(statuses))
        finally:
            for e in engines:
                await e.stop()

    asyncio.run(body())


def test_a_silent_replica_expires_and_the_leader_moves() -> None:
    async def body() -> None:
        engines = [await FakeEngine("e0").start()]
        engines[0].behavior.token_delay_s = 0.05
        try:
            with redis_server() as redis:
                async with replicas(engines, redis) as (a, b), aiohttp.ClientSession() as s:
                    leader, follower = (a, b) if a.fleet.shared.leader else (b, a)  # type: ignore[union-attr]
                    streams = [asyncio.create_task(stream(s, leader, 60)) for _ in range(3)]
                    await wait_for(lambda: follower.fleet.balancer.nodes["e0"].remote_in_flight
                                   == 3, timeout=1.0, what="follower sees the load")
                    # the leader freezes (as a killed process would: no goodbye)
                    shared = leader.fleet.shared
                    assert shared is not None and shared._task is not None
                    shared._task.cancel()
                    loop = asyncio.get_running_loop()
                    t0 = loop.time()
                    await wait_for(lambda: follower.fleet.balancer.nodes["e0"].remote_in_flight
                                   == 0, timeout=2.0, what="its share expires")
                    assert loop.time() - t0 < 1.0 + 0.5  # ttl_s plus a sync or two
                    await wait_for(lambda: follower.fleet.shared.leader,  # type: ignore[union-attr]
                                   timeout=2.0, what="the follower leads")
                    assert follower.fleet.balancer.outliers.authority  # type: ignore[union-attr]
                    for t in streams:
                        t.cancel()
                    await asyncio.gather(*streams, return_exceptions=True)
        finally:
            for e in engines:
                await e.stop()

    asyncio.run(body())


def test_a_remediation_runs_once_fleet_wide(tmp_path: Any) -> None:
    async def body() -> None:
        engines = [await FakeEngine("e0").start()]
        marker = tmp_path / "ran"
        rules = {"rules": [{"on": "quarantined", "command": ["sh", "-c", f"echo x >> {marker}"]}],
                 "cooldown_s": 60}
        try:
            with redis_server() as redis:
                async with replicas(engines, redis, names=("a", "b", "c"),
                                    remediation=rules) as gws:
                    ev = Event(0.0, "e0", "state", "quarantined", "test")
                    for g in gws:  # every replica hears of the quarantine
                        g.fleet.publish_event(ev)
                    await wait_for(lambda: sum(
                        1 for g in gws for e in g.fleet.event_log.since()
                        if e.get("kind") == "action") == 3, timeout=5.0, what="all decided")
                    results = sorted(e["result"] for g in gws for e in g.fleet.event_log.since()
                                     if e.get("kind") == "action")
                    assert results == ["elsewhere", "elsewhere", "ok"]
                    assert marker.read_text().count("x") == 1
        finally:
            for e in engines:
                await e.stop()

    asyncio.run(body())


def test_without_shared_state_nothing_changes() -> None:
    """A fleet file without shared_state starts no sync and needs no Redis."""
    async def body() -> None:
        engines = [await FakeEngine("e0").start()]
        try:
            async with run_gateway(parse_fleet(fleet_doc(engines))) as gw, \
                    aiohttp.ClientSession() as s:
                assert gw.fleet.shared is None
                assert await stream(s, gw, 2) == 200
                async with s.get(gw.url + "/metrics") as r:
                    text = await r.text()
                assert "# TYPE tailguard_shared_state_up gauge" in text  # documented family,
                assert "\ntailguard_shared_state_up " not in text  # with no sample
        finally:
            for e in engines:
                await e.stop()

    asyncio.run(body())


def test_a_replica_recording_with_the_others_reports_replays_exactly(tmp_path: Any) -> None:
    """The merged reports are recorded inputs: a replica's run replays with zero differences."""
    record = tmp_path / "a.jsonl"

    async def body() -> None:
        engines = [await FakeEngine(n).start() for n in ("e0", "e1", "e2")]
        for e in engines:
            e.behavior.token_delay_s = 0.01
        try:
            with redis_server() as redis:
                async with AsyncExitStack() as stack:
                    d = doc(engines, redis, "a")
                    d["pools"]["m"]["policy"] = "tailguard"
                    d["pools"]["m"]["limits"] = {"kind": "gradient"}
                    a = await stack.enter_async_context(run_gateway(parse_fleet(d),
                                                                    record=record))
                    d = doc(engines, redis, "b")
                    d["pools"]["m"]["policy"] = "tailguard"
                    d["pools"]["m"]["limits"] = {"kind": "gradient"}
                    b = await stack.enter_async_context(run_gateway(parse_fleet(d)))
                    await wait_for(lambda: a.fleet.shared is not None
                                   and a.fleet.shared.replicas == 2, what="met")
                    async with aiohttp.ClientSession() as s:
                        got = await asyncio.gather(*(stream(s, (a, b)[i % 2], 5 + i % 20)
                                                     for i in range(60)))
                    assert got.count(200) > 30  # the rest: 429 at the limits (no queue)
                    assert set(got) <= {200, 429}
                    await asyncio.sleep(0.3)
        finally:
            for e in engines:
                await e.stop()

    asyncio.run(asyncio.wait_for(body(), 60))
    records = [json.loads(line) for line in record.read_text().splitlines() if line.strip()]
    peers = [r for r in records if r["op"] == "peers"]
    assert peers and any(r["reports"] for r in peers)
    assert any(n.get("f") for r in peers for rep in r["reports"].values()
               for n in rep["nodes"].values())  # b's load was in a's inputs
    result = replay(records)
    assert result.differences == []
