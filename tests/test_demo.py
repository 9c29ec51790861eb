"""`tailguard demo` end to end, shortened: emulated fleet + gateway + load generator."""

from __future__ import annotations

import asyncio

from rich.console import Console

from tailguard.demo import per_gpu, run_demo


def test_demo_runs_and_reports_per_gpu_class() -> None:
    console = Console(record=True, width=160)
    doc, gpu_of = asyncio.run(run_demo(4.0, 0.5, console))
    res = doc["results"]["bench"]
    assert res["completed"] > 20
    assert res["failed"] == 0
    classes = per_gpu(doc, gpu_of)
    assert set(classes) == {"H100-SXM", "A100-80GB", "L4"}
    assert sum(c["requests"] for c in classes.values()) == res["requests"]
    text = console.export_text()
    assert "gateway:  http://127.0.0.1:" in text and "/metrics" in text
