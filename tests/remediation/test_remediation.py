"""Remediation rules: parsing, triggers, cooldown, rate limit, dry run, the actions."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tailguard.adapters.event_log import EventLog
from tailguard.adapters.remediation import Remediator, parse_remediation
from tailguard.adapters.remediation.actions import delete_pod, run_command
from tailguard.config.fleet import parse_fleet
from tailguard.core.events import Event
from tailguard.errors import ConfigError


class FakeFleet:
    """What the remediator reads of the live fleet: config, node configs, no shared state."""

    def __init__(self, remediation: dict[str, Any]) -> None:
        self.config = parse_fleet({
            "nodes": [{"id": "n1", "url": "http://127.0.0.1:9", "gpu": "L4", "models": ["m"],
                       "labels": {"pod": "vllm-1", "namespace": "inf"}}],
            "remediation": remediation})
        self.nodes = {n.id: n for n in self.config.nodes}
        self.shared = None


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(remediation: dict[str, Any]) -> tuple[Remediator, EventLog, Clock, list[tuple[str, str]]]:
    log = EventLog()
    clock = Clock()
    results: list[tuple[str, str]] = []
    rem = Remediator(FakeFleet(remediation), log,  # type: ignore[arg-type]
                     lambda a, r: results.append((a, r)), clock)
    return rem, log, clock, results


@asynccontextmanager
async def local_server(*routes: web.RouteDef) -> AsyncIterator[int]:
    """An aiohttp app with ``routes`` on a free port of 127.0.0.1; yields the port."""
    app = web.Application()
    app.add_routes(routes)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


def quarantined(t: float = 0.0) -> Event:
    return Event(t, "n1", "state", "quarantined", "5 consecutive failures")


def actions(log: EventLog) -> list[tuple[str, str]]:
    return [(e["trigger"], e["result"]) for e in log.since() if e["kind"] == "action"]


def test_parse_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"remediation.rules\[0\].on"):
        parse_remediation({"rules": [{"on": "sad", "command": ["x"]}]})
    with pytest.raises(ConfigError, match="exactly one action"):
        parse_remediation({"rules": [{"on": "quarantined"}]})
    with pytest.raises(ConfigError, match="command"):
        parse_remediation({"rules": [{"on": "quarantined", "command": "rm -rf /"}]})
    with pytest.raises(ConfigError, match=r"webhook\.url"):
        parse_remediation({"rules": [{"on": "recovered", "webhook": {"url": "ftp://x"}}]})
    with pytest.raises(ConfigError, match="max_actions_per_hour"):
        parse_remediation({"max_actions_per_hour": 0})
    cfg = parse_remediation({"dry_run": True, "rules": [
        {"on": "quarantined_repeatedly", "times": 2, "window_s": 60,
         "kubernetes": {"namespace": "x"}}]})
    assert cfg.dry_run and cfg.rules[0].action == "kubernetes" and cfg.rules[0].times == 2


def test_dry_run_cooldown_repeatedly_and_recovered() -> None:
    async def body() -> None:
        rem, log, clock, results = make({"dry_run": True, "cooldown_s": 100, "rules": [
            {"on": "quarantined", "command": ["/bin/true"]},
            {"on": "quarantined_repeatedly", "times": 2, "window_s": 300,
             "kubernetes": {}},
            {"on": "recovered", "webhook": {"url": "http://127.0.0.1:9/hook"}}]})
        rem.on_event(quarantined())
        assert actions(log) == [("quarantined", "dry_run")]
        assert "would run /bin/true" in log.since()[-1]["detail"]
        clock.t += 50
        rem.on_event(quarantined())  # second within the window: repeatedly fires too
        assert actions(log)[1:] == [("quarantined", "cooldown"),
                                    ("quarantined_repeatedly", "dry_run")]
        assert "would delete pod inf/vllm-1" in log.since()[-1]["detail"]
        rem.on_event(Event(0.0, "n1", "state", "probation", "backoff over"))
        rem.on_event(Event(0.0, "n1", "state", "healthy", "probation passed"))
        assert actions(log)[-1] == ("recovered", "dry_run")
        rem.on_event(Event(0.0, "n1", "state", "healthy", "again"))  # no quarantine since
        assert len(actions(log)) == 4
        assert results.count(("command", "dry_run")) == 1

    asyncio.run(body())


def test_global_rate_limit() -> None:
    async def body() -> None:
        rem, log, clock, _ = make({"dry_run": True, "cooldown_s": 0, "max_actions_per_hour": 2,
                                   "rules": [{"on": "quarantined", "command": ["/bin/true"]}]})
        for _ in range(3):
            rem.on_event(quarantined())
            clock.t += 10
        assert [r for _, r in actions(log)] == ["dry_run", "dry_run", "rate_limited"]
        clock.t += 3600
        rem.on_event(quarantined())
        assert actions(log)[-1][1] == "dry_run"

    asyncio.run(body())


def test_command_gets_the_node_in_its_environment(tmp_path: Path) -> None:
    out = tmp_path / "env.json"
    script = ("import json, os, sys; json.dump({k: v for k, v in os.environ.items() "
              "if k.startswith('TAILGUARD_')}, open(sys.argv[1], 'w'))")

    async def body() -> None:
        rem, _, _, results = make({"rules": [
            {"on": "quarantined", "command": [sys.executable, "-c", script, str(out)]}]})
        rem.on_event(quarantined())
        await rem.stop()
        assert results == [("command", "ok")]

    asyncio.run(body())
    env = json.loads(out.read_text())
    assert env == {"TAILGUARD_NODE_ID": "n1", "TAILGUARD_NODE_URL": "http://127.0.0.1:9",
                   "TAILGUARD_NODE_GPU": "L4", "TAILGUARD_NODE_REASON": "5 consecutive failures",
                   "TAILGUARD_TRIGGER": "quarantined", "TAILGUARD_CAUSE": "",
                   "TAILGUARD_ADVICE": ""}


def test_command_failure_and_timeout_are_recorded() -> None:
    async def body() -> None:
        ok, detail = await run_command((sys.executable, "-c", "import sys; sys.exit(3)"), {}, 5)
        assert not ok and detail.startswith("exit 3")
        ok, detail = await run_command((sys.executable, "-c", "import time; time.sleep(5)"),
                                       {}, 0.3)
        assert not ok and "timed out" in detail
        ok, detail = await run_command(("/nonexistent/tool",), {}, 1)
        assert not ok and "cannot start" in detail

    asyncio.run(body())


def test_webhook_posts_json() -> None:
    got: list[dict[str, Any]] = []

    async def hook(request: web.Request) -> web.Response:
        got.append({"body": await request.json(), "token": request.headers.get("X-Token")})
        return web.Response(text="ok")

    async def body() -> None:
        async with local_server(web.post("/hook", hook)) as port:
            rem, _, _, results = make({"rules": [
                {"on": "quarantined", "webhook": {"url": f"http://127.0.0.1:{port}/hook",
                                                  "headers": {"X-Token": "t"}}}]})
            async with aiohttp.ClientSession() as s:
                rem.session = s
                rem.on_event(quarantined())
                await rem.stop()
            assert results == [("webhook", "ok")]

    asyncio.run(body())
    assert got == [{"body": {"node_id": "n1", "node_url": "http://127.0.0.1:9", "node_gpu": "L4",
                             "node_reason": "5 consecutive failures",
                             "trigger": "quarantined", "cause": "", "advice": ""},
                    "token": "t"}]


def test_kubernetes_without_the_package_fails_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # import kubernetes -> ImportError
    ok, detail = asyncio.run(delete_pod("inf", "vllm-1", 5))
    assert not ok and "not installed" in detail


KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{name: test, cluster: {server: "http://127.0.0.1:%d"}}]
users: [{name: tg, user: {token: secret-token}}]
contexts: [{name: test, context: {cluster: test, user: tg}}]
current-context: test
"""


def test_kubernetes_rule_deletes_the_pod_through_the_api(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The real ``kubernetes`` client, from a kubeconfig, against an API server on 127.0.0.1
    that knows one pod: the quarantine deletes it; a second rule naming a pod that does not
    exist reports the API's 404 as a failed action."""
    pytest.importorskip("kubernetes")  # the dev extra installs it
    calls: list[tuple[str, str, str | None]] = []

    async def delete(request: web.Request) -> web.Response:
        ns, name = request.match_info["ns"], request.match_info["name"]
        calls.append((ns, name, request.headers.get("Authorization")))
        if name != "vllm-1":
            return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                      "reason": "NotFound", "code": 404,
                                      "message": f'pods "{name}" not found'}, status=404)
        return web.json_response({"kind": "Pod", "apiVersion": "v1",
                                  "metadata": {"name": name, "namespace": ns}})

    async def body() -> list[tuple[str, str]]:
        async with local_server(web.delete("/api/v1/namespaces/{ns}/pods/{name}", delete)) as port:
            cfg = tmp_path / "kubeconfig"
            cfg.write_text(KUBECONFIG % port)
            monkeypatch.setenv("KUBECONFIG", str(cfg))
            monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a cluster
            rem, _, _, results = make({"rules": [{"on": "quarantined", "kubernetes": {}}]})
            rem.on_event(quarantined())
            await rem.stop()
            ok, detail = await delete_pod("inf", "no-such-pod", 10)
            assert not ok and "404" in detail and "not found" in detail
            return results

    results = asyncio.run(body())
    assert results == [("kubernetes", "ok")]
    assert calls[0] == ("inf", "vllm-1", "Bearer secret-token")
    assert calls[1][:2] == ("inf", "no-such-pod")


def test_fleet_file_keys_of_the_straggler_work() -> None:
    base: dict[str, Any] = {"nodes": [{"id": "n", "url": "http://127.0.0.1:9", "gpu": "L4",
                                       "models": ["m"]}]}
    cfg = parse_fleet({**base, "outliers": {"slow_ratio": 2, "enabled": True},
                       "pools": {"m": {"hedging": {"enabled": True, "after_s": 0.5}}}})
    assert cfg.outliers.slow_ratio == 2.0 and cfg.pool("m").hedging.after_s == 0.5
    assert not cfg.pool("other").hedging.enabled and not cfg.remediation.rules
    with pytest.raises(ConfigError, match=r"outliers\.slow_ratio"):
        parse_fleet({**base, "outliers": {"slow_ratio": "fast"}})
    with pytest.raises(ConfigError, match=r"pools\.m\.hedging\.quantile"):
        parse_fleet({**base, "pools": {"m": {"hedging": {"quantile": 2}}}})
    with pytest.raises(ConfigError, match=r"remediation\.rules\[0\]"):
        parse_fleet({**base, "remediation": {"rules": [{"on": "quarantined"}]}})


def test_a_rule_with_a_cause_acts_only_on_events_with_that_cause() -> None:
    with pytest.raises(ConfigError, match=r"rules\[0\].cause"):
        parse_remediation({"rules": [{"on": "quarantined", "cause": "cosmic_rays",
                                      "command": ["x"]}]})
    rem, log, clock, _ = make({"dry_run": True, "cooldown_s": 1, "rules": [
        {"on": "quarantined", "cause": "gpu_throttle", "kubernetes": {}},
        {"on": "quarantined", "cause": "gpus_healthy", "command": ["restart-engine"]}]})
    rem.on_event(quarantined())  # no cause known: neither rule
    assert actions(log) == []
    clock.t += 10
    rem.on_event(Event(0.0, "n1", "state", "quarantined", "slow; GPU 1 of 4: hardware thermal "
                       "slowdown", cause="gpu_throttle"))
    got = [e for e in log.since() if e["kind"] == "action"]
    assert [(e["action"], e["cause"]) for e in got] == [("kubernetes", "gpu_throttle")]
    clock.t += 10
    rem.on_event(Event(0.0, "n1", "state", "quarantined", "slow; GPUs healthy",
                       cause="gpus_healthy"))
    got = [e for e in log.since() if e["kind"] == "action"]
    assert [(e["action"], e["cause"]) for e in got][-1] == ("command", "gpus_healthy")
    assert rem._env(Event(0.0, "n1", "state", "quarantined", "r",
                          cause="gpu_xid"))["TAILGUARD_CAUSE"] == "gpu_xid"
