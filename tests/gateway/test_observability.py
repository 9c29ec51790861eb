"""Request ids and logs, metric completeness against docs/metrics.md, the dashboard feed."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from gateway_fakes import (
    FakeEngine,
    fleet_and_gateway,
    fleet_doc,
    free_port,
    wait_for,
    wait_serving,
)
from multidict import CIMultiDict

from tailguard.adapters.logs import JsonFormatter, TextFormatter
from tailguard.core.events import Event
from tailguard.core.fleet import Actor, NodeState
from tailguard.gateway.app import DASHBOARD, RunningGateway

MSG = [{"role": "user", "content": "hello"}]
DOCS = Path(__file__).resolve().parents[2] / "docs"
SRC = str(Path(__file__).resolve().parents[2] / "src")


async def post(gw: RunningGateway, body: dict[str, Any],
               headers: dict[str, str] | None = None) -> tuple[int, CIMultiDict[str], bytes]:
    async with aiohttp.ClientSession() as s, \
            s.post(gw.url + "/v1/chat/completions", json=body, headers=headers or {}) as r:
        return r.status, r.headers.copy(), await r.read()


async def get(gw: RunningGateway, path: str) -> tuple[int, str, str]:
    async with aiohttp.ClientSession() as s, s.get(gw.url + path) as r:
        return r.status, r.headers.get("Content-Type", ""), await r.text()


def upstream_id(engine: FakeEngine) -> str:
    return {k.lower(): v for k, v in engine.seen[-1].headers.items()}["x-request-id"]


def test_request_id_in_header_upstream_and_log(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tailguard.request")

    async def body() -> None:
        async with fleet_and_gateway(["a"]) as (gw, engines):
            status, headers, raw = await post(gw, {"model": "m", "messages": MSG, "stream": True,
                                                   "max_tokens": 4,
                                                   "stream_options": {"include_usage": True}})
            assert status == 200 and raw.endswith(b"data: [DONE]\n\n")
            rid = headers["x-request-id"]
            assert re.fullmatch(r"[0-9a-f]{32}", rid)
            assert upstream_id(engines[0]) == rid

            # A client's own sane id is kept; one that could forge log lines is replaced.
            status, headers, _ = await post(gw, {"model": "m", "messages": MSG},
                                            {"x-request-id": "client-42.a:b"})
            assert status == 200 and headers["x-request-id"] == "client-42.a:b"
            assert upstream_id(engines[0]) == "client-42.a:b"
            status, headers, _ = await post(gw, {"model": "m", "messages": MSG},
                                            {"x-request-id": "bad id\tnew line"})
            assert status == 200 and re.fullmatch(r"[0-9a-f]{32}", headers["x-request-id"])

            # Errors carry the id too, and their log line says why.
            engines[0].behavior.mode = "error500"
            status, headers, _ = await post(gw, {"model": "m", "messages": MSG})
            assert status == 502
            failed_id = headers["x-request-id"]
            status, headers, _ = await post(gw, {"model": "nope", "messages": MSG})
            assert status == 404 and "x-request-id" in headers

            records = [r for r in caplog.records if r.name == "tailguard.request"]
            by_id = {r.fields["id"]: r for r in records}  # type: ignore[attr-defined]
            ok = by_id[rid]
            assert ok.levelno == logging.INFO and ok.getMessage() == \
                "POST /v1/chat/completions 200"
            f = ok.fields  # type: ignore[attr-defined]
            assert f["node"] == "a" and f["pool"] == "m" and f["tokens"] == 4
            assert 0 <= f["ttft_s"] <= f["e2e_s"]
            bad = by_id[failed_id]
            assert bad.levelno == logging.WARNING
            assert bad.fields["origin"] == "upstream_5xx"  # type: ignore[attr-defined]
            assert bad.fields["node"] == "a"  # type: ignore[attr-defined]

            text = TextFormatter().format(ok)
            assert f"id={rid} node=a pool=m" in text and "tokens=4" in text
            doc = json.loads(JsonFormatter().format(bad))
            assert doc["level"] == "warning" and doc["id"] == failed_id
            assert doc["origin"] == "upstream_5xx" and doc["msg"].endswith(" 502")

    asyncio.run(body())


def documented_metrics() -> list[str]:
    text = (DOCS / "metrics.md").read_text()
    names = re.findall(r"^\| `(tailguard_[a-z_]+)`", text, re.M)
    assert len(names) >= 30, names
    return names


def test_every_documented_metric_is_exposed() -> None:
    async def body() -> None:
        async with fleet_and_gateway(["a", "b"]) as (gw, _):
            for _ in range(3):
                await post(gw, {"model": "m", "messages": MSG, "stream": True, "max_tokens": 3})
            await wait_for(lambda: all(m.sample is not None for m in gw.fleet.monitors.values()),
                           what="engine metrics scraped")
            status, _, text = await get(gw, "/metrics")
            assert status == 200
            exposed = {n for n in re.findall(r"^# TYPE (tailguard_[a-z_]+) ", text, re.M)
                       if not n.endswith("_created")}  # prometheus_client's own series
            for name in documented_metrics():
                base = re.sub(r"_(total|bucket|count|sum)$", "", name)
                assert name in exposed or base in exposed, f"{name} documented, not exposed"
            undocumented = {n for n in exposed if n not in set(documented_metrics())
                            and f"{n}_total" not in set(documented_metrics())}
            assert not undocumented, f"exposed but not in docs/metrics.md: {undocumented}"
            # Streamed answers are judged against the pool's SLO (2 s / 0.1 s default).
            assert re.search(r'tailguard_slo_requests_total\{gpu="L4",pool="m",result="met"\} 3',
                             text)
            assert 'tailguard_node_limit_requests{gpu="L4",node="a"} 256.0' in text
            assert 'tailguard_pool_nodes{pool="m",state="healthy"} 2.0' in text
            assert 'tailguard_pool_slo_tpot_seconds{pool="m"} 0.1' in text

    asyncio.run(body())


def test_dashboard_page_and_state_feed() -> None:
    async def body() -> None:
        async with fleet_and_gateway(["a", "b"]) as (gw, _):
            status, ctype, html = await get(gw, "/dashboard")
            assert status == 200 and ctype.startswith("text/html")
            # Self-contained: nothing is loaded from another origin.
            assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
            assert "@import" not in html and "fetch(\"dashboard/state\"" in html

            await post(gw, {"model": "m", "messages": MSG, "stream": True, "max_tokens": 3})
            status, ctype, raw = await get(gw, "/dashboard/state")
            state = json.loads(raw)
            assert {n["id"] for n in state["nodes"]} == {"a", "b"}
            assert [c["gpu"] for c in state["classes"]] == ["L4"]
            node = next(n for n in state["nodes"] if n["tpot_s"] is not None)
            assert node["limit"] == 256 and node["slo_tpot_s"] == 0.1
            assert state["pools"][0]["states"] == {"healthy": 2}
            assert state["pools"][0]["migrations"] == {}  # no stream has moved
            assert {n["role"] for n in state["nodes"]} == {"both"}
            assert state["events"] == []

            # A state change made outside the balancer's tick shows up as an event.
            gw.fleet.set_state("b", NodeState.DRAINING)
            dash = gw.app[DASHBOARD]
            await wait_for(lambda: any(e["node"] == "b" for e in dash.events),
                           what="drain event")
            state = json.loads((await get(gw, "/dashboard/state"))[2])
            ev = state["events"][-1]
            assert (ev["node"], ev["kind"], ev["state"]) == ("b", "state", "draining")
            assert ev["reason"] == "was healthy"
            assert state["pools"][0]["states"] == {"healthy": 1, "draining": 1}
            # Removed from the fleet: one more event, and the node is gone from the feed.
            gw.fleet.retire("b", timeout_s=0)
            await wait_for(lambda: dash.events[-1]["kind"] == "removed", what="removed event")
            state = json.loads((await get(gw, "/dashboard/state"))[2])
            assert [n["id"] for n in state["nodes"]] == ["a"]
            assert [(e["node"], e["kind"]) for e in state["events"]] == [("b", "state"),
                                                                        ("b", "removed")]
            # The fleet's event log (core events, remediation results) feeds it too, and a
            # state change it announces is not repeated by the watcher.
            gw.fleet.balancer.set_state("a", NodeState.QUARANTINED, Actor.LEADER)
            gw.fleet.event_log.on_core_event(Event(0.0, "a", "state", "quarantined", "slow 3x"))
            gw.fleet.event_log.add({"node": "a", "kind": "action", "trigger": "quarantined",
                                    "action": "command", "result": "ok", "detail": "exit 0"})
            await wait_for(lambda: dash.events[-1]["kind"] == "action", what="remediation")
            await asyncio.sleep(0.6)  # two more watch cycles
            assert [(e["node"], e["kind"], e["state"], e["reason"])
                    for e in list(dash.events)[2:]] == [
                ("a", "state", "quarantined", "slow 3x"),
                ("a", "action", "ok", "command on quarantined: exit 0")]

    asyncio.run(body())


def test_serve_logs_json_lines(tmp_path: Path) -> None:
    """``tailguard serve --log-format json``: one JSON object per request on stderr."""

    async def body() -> None:
        engine = await FakeEngine("a").start()
        port = free_port()
        path = tmp_path / "fleet.yaml"
        path.write_text(yaml.safe_dump(fleet_doc([engine], listen=f"127.0.0.1:{port}",
                                                 reload={"poll_s": 0})))
        env = {**os.environ, "PYTHONPATH": SRC}
        proc = subprocess.Popen(
            [sys.executable, "-m", "tailguard.cli", "serve", "--config", str(path),
             "--log-format", "json"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        url = f"http://127.0.0.1:{port}"
        try:
            await wait_serving(url, proc, "/ready", timeout=10.0)
            async with aiohttp.ClientSession() as s, \
                    s.post(url + "/v1/chat/completions",
                           json={"model": "m", "messages": MSG, "stream": True},
                           headers={"x-request-id": "json-log-1"}) as r:
                assert r.status == 200 and r.headers["x-request-id"] == "json-log-1"
                await r.read()
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=20)
            await engine.stop()
        lines = [json.loads(line) for line in err.decode().splitlines() if line.startswith("{")]
        mine = [d for d in lines if d.get("id") == "json-log-1"]
        assert len(mine) == 1, err.decode()
        doc = mine[0]
        assert doc["logger"] == "tailguard.request" and doc["level"] == "info"
        assert doc["msg"] == "POST /v1/chat/completions 200"
        assert doc["node"] == "a" and doc["pool"] == "m" and doc["tokens"] >= 1
        assert doc["ts"].endswith("Z") and doc["ttft_s"] <= doc["e2e_s"]

    asyncio.run(body())


