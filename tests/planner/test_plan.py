"""`tailguard plan`: per-GPU batch settings from the roofline model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tailguard.cli import main
from tailguard.core.hardware import DEFAULT_CATALOG
from tailguard.planner.plan import plan_groups

FLEET = """
listen: 127.0.0.1:8080
nodes:
  - {id: h0, url: "http://127.0.0.1:8101", gpu: H100-SXM, models: [llama-3.1-8b]}
  - {id: l0, url: "http://127.0.0.1:8103", gpu: L4, models: [llama-3.1-8b]}
  - {id: l1, url: "http://127.0.0.1:8104", gpu: L4, models: [llama-3.1-8b]}
  - {id: t0, url: "http://127.0.0.1:8105", gpu: T4, models: [llama-3.1-8b]}
"""


def test_weak_gpus_get_small_batches_and_chunks() -> None:
    cat = DEFAULT_CATALOG
    model = cat.model("llama-3.1-8b")
    h, l4, t4 = plan_groups([(cat.gpu("H100-SXM"), 1, 1), (cat.gpu("L4"), 1, 2),
                             (cat.gpu("T4"), 1, 1)], model, 0.1, 1000.0, 200.0)
    assert h.max_num_seqs > 5 * l4.max_num_seqs > 0
    assert h.max_num_batched_tokens > l4.max_num_batched_tokens > l4.max_num_seqs
    assert l4.initial_limit <= l4.max_num_seqs and l4.tpot_at_batch_s <= 0.1
    assert not t4.fits and t4.memory_needed_gb > 16 and t4.share == 0.0
    assert h.share + l4.share == pytest.approx(1.0)


def test_cli_formats(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(FLEET)
    base = ["plan", "--fleet", str(fleet), "--model", "llama-3.1-8b", "--slo-tpot", "0.1",
            "--slo-ttft", "1"]
    assert main([*base, "--format", "vllm"]) == 0
    out = capsys.readouterr().out
    assert "--max-num-seqs" in out and "--enable-chunked-prefill" in out
    assert "T4 x1 (1 node): llama-3.1-8b does not fit" in out
    assert main([*base, "--format", "sglang"]) == 0
    assert "--max-running-requests" in capsys.readouterr().out
    assert main([*base, "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [g["gpu"] for g in doc["groups"]] == ["H100-SXM", "L4", "T4"]
    assert main([*base]) == 0
    assert "gateway initial limit" in capsys.readouterr().out
    assert main([*base, "--model", "llama-3.1-70b", "--tp", "1,4"]) == 0
    out = capsys.readouterr().out
    assert "H100-SXM x1 (1 node): llama-3.1-70b does not fit" in out
    assert "H100-SXM x4 (1 node): KV" in out
