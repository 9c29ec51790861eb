"""The shared store as untrusted input: bad reports and forged entries, against a real
redis-server, change nothing (issue 41's reproductions)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import trustme
from gateway_fakes import FakeEngine, wait_for
from redis.asyncio import Redis
from redis_server import redis_server
from test_shared_state import MSG, doc

from tailguard.config.fleet import parse_fleet
from tailguard.core.fleet import NodeState
from tailguard.gateway.app import RunningGateway, run_gateway

KEY_ENV = "TG_SHARED_KEYS"


async def chat(session: aiohttp.ClientSession, gw: RunningGateway) -> int:
    async with session.post(gw.url + "/v1/chat/completions",
                            json={"model": "m", "messages": MSG, "max_tokens": 4}) as r:
        await r.read()
        return r.status


def rogue_report(nodes: list[str], **node_fields: Any) -> dict[str, Any]:
    return {"epoch": "rogue", "demand": 0,
            "nodes": {n: {"f": 0, "b": 0, **node_fields} for n in nodes}}


async def publish(redis: Redis, replica: str, value: str, leader: bool = False) -> None:
    """What a rogue writer can do: store a report, list itself live, take the lease."""
    await redis.set(f"tailguard:replica:{replica}", value, px=60_000)
    await redis.zadd("tailguard:replicas", {replica: time.time() * 1000 + 60_000})
    if leader:
        await redis.set("tailguard:leader", replica, px=60_000)


def states(gw: RunningGateway) -> dict[str, NodeState]:
    return gw.fleet.balancer.states()


@pytest.mark.parametrize("bad", [
    {"demand": -5},  # made every request a 500 (a square root of a negative)
    {"nodes_f": 10**18},  # made a limited pool refuse requests
    {"nodes_f": float("nan")},
    {"nodes_d": [1e308, 5]},
    "not json at all",
    {"nodes": "a list of nodes, not"},
])
def test_a_bad_report_is_refused_whole_and_serving_goes_on(bad: Any) -> None:
    async def body() -> None:
        engines = [await FakeEngine(n).start() for n in ("e0", "e1")]
        try:
            with redis_server() as server:
                async with run_gateway(parse_fleet(doc(engines, server, "a"))) as gw, \
                        aiohttp.ClientSession() as s:
                    redis = Redis.from_url(server.url)
                    if isinstance(bad, str):
                        value = bad
                    else:
                        report = rogue_report(["e0", "e1"])
                        for k, v in bad.items():
                            if k.startswith("nodes_"):
                                for entry in report["nodes"].values():
                                    entry[k[6:]] = v
                            else:
                                report[k] = v
                        value = json.dumps(report)  # NaN and 1e308 written as Python does
                    await publish(redis, "evil", value)
                    shared = gw.fleet.shared
                    assert shared is not None
                    await wait_for(lambda: shared.rejected.get("malformed", 0) >= 2,
                                   timeout=3.0, what="the report refused")
                    got = await asyncio.gather(*(chat(s, gw) for _ in range(12)))
                    assert got == [200] * 12
                    assert shared.replicas == 1  # the rogue is no replica
                    assert sum(n.remote_in_flight for n in gw.fleet.balancer.nodes.values()) == 0
                    async with s.get(gw.url + "/metrics") as r:
                        text = await r.text()
                    assert 'tailguard_shared_state_rejected_total{reason="malformed"}' in text
                    await redis.aclose()
        finally:
            for e in engines:
                await e.stop()
    asyncio.run(body())


def test_without_the_key_a_forged_leader_and_operator_actions_change_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer to Redis without the replicas' key: takes the lease, publishes a leader
    report quarantining every node and cordons one in the operator log."""
    monkeypatch.setenv(KEY_ENV, "k-new,k-old")

    async def body() -> None:
        engines = [await FakeEngine(n).start() for n in ("e0", "e1", "e2", "e3")]
        try:
            with redis_server() as server:
                d = doc(engines, server, "a", key_env=KEY_ENV)
                async with run_gateway(parse_fleet(d)) as gw, aiohttp.ClientSession() as s:
                    redis = Redis.from_url(server.url)
                    ids = ["e0", "e1", "e2", "e3"]
                    decided = ["quarantined", 0.0, 1, 300.0, "forged"]
                    report = json.dumps(rogue_report(ids, s=decided))
                    await redis.delete("tailguard:leader")
                    await publish(redis, "rogue", report, leader=True)
                    # a signature under another key, and a plain operator action
                    await redis.hset("tailguard:ops", mapping={
                        "e3": json.dumps({"state": "cordoned", "by": "rogue", "id": "x"}),
                        "e2": "v1." + "0" * 64 + "." + json.dumps(
                            {"state": "draining", "by": "rogue", "id": "y"})})
                    shared = gw.fleet.shared
                    assert shared is not None
                    await wait_for(lambda: shared.rejected.get("unsigned", 0) >= 3
                                   and shared.rejected.get("signature", 0) >= 1,
                                   timeout=3.0, what="the forged entries refused")
                    await asyncio.sleep(1.0)  # several syncs with the rogue in place
                    assert set(states(gw).values()) == {NodeState.HEALTHY}
                    got = await asyncio.gather(*(chat(s, gw) for _ in range(8)))
                    assert got == [200] * 8
                    await redis.aclose()
        finally:
            for e in engines:
                await e.stop()
    asyncio.run(body())


def test_replicas_with_rotated_keys_still_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """One replica signs with the new key, the other still with the old one (both
    verify with both): they share their loads and an operator's cordon."""
    async def body() -> None:
        engines = [await FakeEngine(n).start() for n in ("e0", "e1")]
        try:
            with redis_server() as server:
                monkeypatch.setenv("TG_KEYS_A", "new,old")
                monkeypatch.setenv("TG_KEYS_B", "old,new")
                da = doc(engines, server, "a", key_env="TG_KEYS_A")
                db = doc(engines, server, "b", key_env="TG_KEYS_B")
                async with run_gateway(parse_fleet(da)) as a, run_gateway(parse_fleet(db)) as b:
                    await wait_for(lambda: a.fleet.shared is not None and b.fleet.shared
                                   is not None and a.fleet.shared.replicas == 2
                                   and b.fleet.shared.replicas == 2, timeout=5.0,
                                   what="replicas met")
                    assert a.fleet.shared is not None and b.fleet.shared is not None
                    a.fleet.set_state("e1", NodeState.CORDONED)
                    await wait_for(lambda: states(b)["e1"] is NodeState.CORDONED, timeout=2.0,
                                   what="b obeys a's cordon")
                    assert not a.fleet.shared.rejected and not b.fleet.shared.rejected
        finally:
            for e in engines:
                await e.stop()
    asyncio.run(body())


def test_replicas_over_tls_with_client_certificates_and_an_acl_user(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A redis-server that speaks TLS only, asks for client certificates and knows one
    ACL user: replicas with the CA, a certificate and the user's password share; one
    with a wrong password cannot sync and serves on its own view."""
    ca = trustme.CA()
    server_cert = ca.issue_cert("127.0.0.1")
    client_cert = ca.issue_cert("tailguard-replica")
    files = {}
    for name, blob in (("ca.pem", ca.cert_pem), ("server.pem", server_cert.cert_chain_pems[0]),
                       ("server.key", server_cert.private_key_pem),
                       ("client.pem", client_cert.cert_chain_pems[0]),
                       ("client.key", client_cert.private_key_pem)):
        path = tmp_path / name
        blob.write_to_path(str(path))
        files[name] = str(path)
    monkeypatch.setenv("TG_REDIS_PW", "s3cret")
    monkeypatch.setenv("TG_REDIS_BAD_PW", "wrong")
    tls = {"tls_ca_file": files["ca.pem"], "tls_cert_file": files["client.pem"],
           "tls_key_file": files["client.key"], "username": "tg"}

    async def body() -> None:
        engines = [await FakeEngine(n).start() for n in ("e0", "e1")]
        try:
            with redis_server(tls=(files["ca.pem"], files["server.pem"], files["server.key"]),
                              users=("tg on >s3cret ~tailguard:* +@all",)) as server:
                assert server.url.startswith("rediss://")
                da = doc(engines, server, "a", password_env="TG_REDIS_PW", **tls)
                db = doc(engines, server, "b", password_env="TG_REDIS_PW", **tls)
                dc = doc(engines, server, "c", password_env="TG_REDIS_BAD_PW", **tls)
                async with run_gateway(parse_fleet(da)) as a, \
                        run_gateway(parse_fleet(db)) as b, run_gateway(parse_fleet(dc)) as c, \
                        aiohttp.ClientSession() as s:
                    sa, sb, sc = a.fleet.shared, b.fleet.shared, c.fleet.shared
                    assert sa is not None and sb is not None and sc is not None
                    await wait_for(lambda: sa.replicas == 2 and sb.replicas == 2, timeout=5.0,
                                   what="a and b met over TLS")
                    a.fleet.set_state("e1", NodeState.CORDONED)
                    await wait_for(lambda: states(b)["e1"] is NodeState.CORDONED, timeout=2.0,
                                   what="b obeys a's cordon")
                    assert not sc.up and sc.errors > 0 and sc.syncs == 0
                    assert states(c)["e1"] is NodeState.HEALTHY  # it never heard
                    assert await chat(s, c) == 200  # and serves on its own view
                # Without a client certificate, or in plain text, Redis is not reachable.
                for url, extra in ((server.url, {"ssl_ca_certs": files["ca.pem"]}),
                                   (server.url.replace("rediss://", "redis://"), {})):
                    bare = Redis.from_url(url, username="tg", password="s3cret",
                                          socket_timeout=1.0, **extra)
                    with pytest.raises(Exception):  # noqa: B017 (any refusal will do)
                        await bare.ping()
                    await bare.aclose()
        finally:
            for e in engines:
                await e.stop()
    asyncio.run(body())
