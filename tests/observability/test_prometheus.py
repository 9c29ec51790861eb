"""The shipped Prometheus config, alert rules and Grafana dashboard against a real Prometheus.

Starts the ``prometheus`` binary on 127.0.0.1 (temporary storage, 1 s scrape
and evaluation intervals) in front of a gateway serving emulated engines
under load, then demands that every PromQL expression of
``deploy/grafana/tailguard.json`` parses and returns series, and that every
alert of ``deploy/prometheus/alerts.yml`` becomes active once its condition
is produced: a node quarantined, a node down, a pool mostly not healthy, SLO
attainment below target (a TPOT SLO the L4s cannot meet), shedding; and that
retries show (an engine answering 500 for a moment).
Hedges, shedding, remediations, stream migrations and disaggregated legs are
counted through the hooks the hedging, admission, remediation, stream relay
and forwarding code calls.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.error
import urllib.parse
from pathlib import Path
from typing import Any

import yaml
from live_stack import MODEL, LiveStack, free_port, http_json, need_binary

from tailguard.core.events import Event
from tailguard.core.fleet import Actor, NodeState
from tailguard.gateway.app import RunningGateway

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
NODES = (("h100-0", "H100-SXM"), ("a100-0", "A100-80GB"), ("l4-0", "L4"), ("l4-1", "L4"),
         ("l4-2", "L4"))
ALERTS = {"TailguardNodeQuarantined", "TailguardNodeDown", "TailguardPoolSloAttainmentLow",
          "TailguardPoolMostlyDegraded", "TailguardShedding"}


def dashboard_exprs() -> list[str]:
    doc = json.loads((DEPLOY / "grafana" / "tailguard.json").read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]
    for var in doc["templating"]["list"]:
        q = var.get("definition", "")
        m = re.fullmatch(r"label_values\((\w+), *(\w+)\)", q)
        if m:
            exprs.append(f"count by ({m.group(2)}) ({m.group(1)})")
    # Grafana's variables, as "All" expands them.
    return [e.replace("$pool", ".*").replace("$gpu", ".*") for e in exprs]


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def test_promtool_accepts_config_and_rules() -> None:
    promtool = need_binary("promtool")
    for args in (["check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")],
                 ["check", "rules", str(DEPLOY / "prometheus" / "alerts.yml")]):
        out = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
    assert {r["alert"] for r in alert_rules()} == ALERTS


def query(base: str, expr: str) -> list[Any]:
    url = base + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        doc = http_json("GET", url)
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"Prometheus refused {expr!r}: {exc.read().decode()}") from exc
    assert doc["status"] == "success", doc
    result: list[Any] = doc["data"]["result"]
    return result


def produce_incidents(gw: RunningGateway, step: int) -> None:
    """What the alerts watch for; ``step`` 0 early (counters start), 1 later (they grow)."""
    m = gw.metrics
    m.shed_request(MODEL, "queue_full")
    m.hedge(MODEL, "won")
    m.migration(MODEL, "stall", "moved")
    # A disaggregated request's legs (this fleet has no roles: the forwarder's hook).
    m.leg(MODEL, ("h100-0", "H100-SXM", 0.4), ("a100-0", "A100-80GB", 0.05))
    m.remediation("command", "ok")
    m.on_event(Event(0.0, "l4-0", "state", "quarantined", "test"))
    if step == 1:
        gw.fleet.balancer.set_state("l4-0", NodeState.QUARANTINED, Actor.LEADER)
        gw.fleet.set_state("l4-2", NodeState.DRAINING)


def test_dashboard_and_alerts_against_real_prometheus(tmp_path: Path) -> None:
    prometheus = need_binary("prometheus")
    # TPOT SLO 30 ms: the H100 and A100 meet it, the L4s (about 65 ms) do not, so
    # attainment falls below the 0.99 target and both `met` and `missed` exist.
    pool = {"policy": "round_robin", "slo": {"ttft_s": 2.0, "tpot_s": 0.03}}
    with LiveStack(NODES, rate=8.0, pool=pool, max_tokens=12) as st:
        host_port = st.url.removeprefix("http://")
        cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
        cfg["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        cfg["rule_files"] = [str(DEPLOY / "prometheus" / "alerts.yml")]
        cfg["scrape_configs"][0]["static_configs"] = [{"targets": [host_port]}]
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        with open(tmp_path / "prometheus.log", "w") as log:
            proc = subprocess.Popen(
                [prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                 f"--storage.tsdb.path={tmp_path / 'data'}",
                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                stdout=subprocess.DEVNULL, stderr=log)
        try:
            st.call(lambda gw: produce_incidents(gw, 0))
            deadline = time.monotonic() + 30
            while True:
                try:
                    if query(base, 'up{job="tailguard"} == 1'):
                        break
                except (OSError, AssertionError):  # not listening, or 503 while it starts
                    pass
                assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()
                assert time.monotonic() < deadline, "Prometheus never scraped the gateway"
                time.sleep(0.3)
            time.sleep(3)  # a few scrapes with every node healthy and serving
            st.call(lambda gw: produce_incidents(gw, 1))
            st.fault("l4-1", {"kind": "crash", "duration_s": 120})  # health checks: down
            # The H100 answers 500 for a moment: those requests are retried elsewhere.
            st.fault("h100-0", {"kind": "errors", "rate": 1.0, "duration_s": 1.5})

            exprs = dashboard_exprs()
            assert len(exprs) >= 30
            missing: list[str] = exprs
            active: set[str] = set()
            deadline = time.monotonic() + 30
            while missing or active != ALERTS:
                if time.monotonic() > deadline:
                    raise AssertionError(f"no series for {missing}; alerts active: {active}")
                time.sleep(1)
                st.call(lambda gw: gw.metrics.shed_request(MODEL, "queue_full"))
                missing = [e for e in exprs if not query(base, e)]
                alerts = http_json("GET", base + "/api/v1/alerts")["data"]["alerts"]
                active = {a["labels"]["alertname"] for a in alerts
                          if a["state"] in ("pending", "firing")}

            # Each alert's labels point at the right thing.
            def labels(name: str, key: str) -> set[str]:
                return {a["labels"][key] for a in alerts if a["labels"]["alertname"] == name}

            assert "l4-0" in labels("TailguardNodeQuarantined", "node")
            assert labels("TailguardNodeDown", "node") == {"l4-1"}
            assert labels("TailguardPoolMostlyDegraded", "pool") == {MODEL}
            assert labels("TailguardPoolSloAttainmentLow", "pool") == {MODEL}
            retried = query(base, "sum by (origin) (tailguard_retries_total)")
            assert "upstream_5xx" in {r["metric"]["origin"] for r in retried}
            # The SLO series are real measurements: the L4s miss, the H100 meets.
            met = query(base, 'sum by (gpu) (tailguard_slo_requests_total{result="met"})')
            missed = query(base, 'sum by (gpu) (tailguard_slo_requests_total{result="missed"})')
            assert "H100-SXM" in {r["metric"]["gpu"] for r in met}
            assert "L4" in {r["metric"]["gpu"] for r in missed}
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
