"""Simulator reports and load sweeps: parsing, the figures' data, the CLI end to end."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from tailguard.cli import main
from tailguard.core.events import Event
from tailguard.errors import ConfigError
from tailguard.sim.cluster import FAILED_STATUS, OK, UNFINISHED, RunRecord
from tailguard.sim.report import busy_until, latencies, node_load, render_report, state_segments
from tailguard.sim.sweep import parse_sweep


def record() -> RunRecord:
    # Three requests on two nodes: r0 on a [0, 4], r1 on b [1, 3], r2 on a, never finished.
    return RunRecord(arrival=[0.0, 1.0, 2.0], prompt=[10, 10, 10], output=[5, 1, 3],
                     node=[0, 1, 0], first=[0.5, 2.0, -1.0], end=[4.0, 3.0, -1.0],
                     status=[OK, OK, UNFINISHED], node_ids=["a", "b"], end_time=10.0,
                     events=[Event(2.0, "b", "state", "degraded", "slow"),
                             Event(5.0, "b", "state", "quarantined", "slower"),
                             Event(6.0, "b", "detect", "quarantined", "ignored: not a change"),
                             Event(8.0, "b", "state", "healthy", "recovered")])


def test_parse_sweep() -> None:
    assert parse_sweep("0.5:1.2:0.1") == [0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2]
    assert parse_sweep("1:1:0.5") == [1.0]
    assert parse_sweep("0.5:1.0:0.2") == [0.5, 0.7, 0.9]
    for bad in ("0.5:1.2", "a:b:c", "0:1:0.1", "1.2:0.5:0.1", "0.5:1:0", "0.01:10:0.01"):
        with pytest.raises(ConfigError, match="--sweep"):
            parse_sweep(bad)


def test_figure_data_from_literal_records() -> None:
    rec = record()
    counts = node_load(rec, np.array([0.0, 0.5, 1.0, 2.5, 3.5, 4.5, 9.9]))
    assert counts["a"].tolist() == [1, 1, 1, 2, 2, 1, 1]  # r2 is held until the run stopped
    assert counts["b"].tolist() == [0, 0, 1, 1, 0, 0, 0]
    ttft, tpot = latencies(rec, warmup_s=0.0, duration_s=10.0)
    assert ttft.tolist() == [0.5, 1.0]
    assert tpot.tolist() == [(4.0 - 0.5) / 4]  # one-token answers have no TPOT
    assert latencies(rec, warmup_s=0.5, duration_s=10.0)[0].tolist() == [1.0]
    assert state_segments(rec) == {"b": [(0.0, 2.0, "healthy"), (2.0, 5.0, "degraded"),
                                         (5.0, 8.0, "quarantined"), (8.0, 10.0, "healthy")]}
    assert busy_until(rec) == 10.0  # an unfinished request: the whole run
    done = record()
    done.status[2], done.end[2] = FAILED_STATUS, 2.5
    assert busy_until(done) == 4.0


def doc_for(rec: RunRecord) -> dict[str, Any]:
    summary = {"mean": 0.1, "p50": 0.1, "p90": 0.2, "p99": 0.3, "max": 0.4}
    return {"scenario": "t", "seed": 1, "model": "m", "capacity_bound_rps": 1.0,
            "slo": {"ttft_s": 2.0, "tpot_s": 0.1, "attainment": 0.99},
            "results": {"p": {"offered_rps": 1.0, "completed": 2, "failed": 1,
                              "ttft_s": summary, "tpot_s": summary, "slo_attainment": 0.5,
                              "goodput_rps": 0.2}}}


def test_render_report_embeds_every_figure() -> None:
    rec = record()
    sweep = [{"load": x, "offered_rps": x * 10,
              "results": {"p": {"slo_attainment": 1.0 - x / 2, "goodput_rps": x * 9}}}
             for x in (0.5, 1.0)]
    page, figures = render_report(doc_for(rec), {"p": rec}, gpu_of={"a": "L4", "b": "T4"},
                                  warmup_s=0.0, duration_s=10.0, sweep=sweep)
    assert set(figures) == {"latency_cdf", "node_load", "state_timeline", "sweep"}
    for b64 in figures.values():
        assert base64.b64decode(b64).startswith(b"\x89PNG")
    assert page.count("src='data:image/png;base64,") == 4
    assert not re.search(r"(src|href)=['\"]?https?:", page)  # self-contained
    # Without state changes the timeline is a sentence, not an empty figure.
    rec.events = []
    page, figures = render_report(doc_for(rec), {"p": rec}, gpu_of={"a": "L4", "b": "T4"},
                                  warmup_s=0.0, duration_s=10.0)
    assert "state_timeline" not in figures and "No node left the healthy" in page


def test_cli_report_and_sweep(tmp_path: Path) -> None:
    scn = {
        "name": "tiny", "seed": 2, "model": "llama-3.1-8b", "slo": {"ttft_s": 2.0, "tpot_s": 0.1},
        "fleet": [{"gpu": "A100-80GB", "count": 1}, {"gpu": "L4", "count": 1}],
        "workload": {"duration_s": 30, "warmup_s": 5, "arrival": {"process": "poisson",
                                                                  "load": 0.8},
                     "input_tokens": {"dist": "fixed", "value": 256},
                     "output_tokens": {"dist": "fixed", "value": 64}},
        "policies": ["round_robin", "tailguard"],
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(scn))
    out, js, figs = tmp_path / "report.html", tmp_path / "out.json", tmp_path / "figs"
    assert main(["sim", str(path), "--quiet", "--report", str(out), "--report-figures",
                 str(figs), "--sweep", "0.5:1.5:0.5", "--json", str(js)]) == 0
    doc = json.loads(js.read_text())
    assert [p["load"] for p in doc["sweep"]] == [0.5, 1.0, 1.5]
    for p in doc["sweep"]:
        assert set(p["results"]) == {"round_robin", "tailguard"}
    # More load never makes it easier: attainment at 1.5 is below that at 0.5.
    att = [p["results"]["tailguard"]["slo_attainment"] for p in doc["sweep"]]
    assert att[2] < att[0]
    # The main run at the scenario's load is the same as without --sweep.
    assert doc["results"]["tailguard"]["offered_rps"] == pytest.approx(
        doc["sweep"][0]["offered_rps"] * 0.8 / 0.5, rel=1e-6)
    page = out.read_text()
    assert page.count("data:image/png;base64,") >= 3 and "SLO attainment against load" in page
    assert {p.name for p in figs.iterdir()} >= {"latency_cdf.png", "node_load.png", "sweep.png"}
    assert main(["sim", str(path), "--quiet", "--sweep", "0.5:1:0.5", "--load", "0.5"]) == 2
