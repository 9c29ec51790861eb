"""`tailguard demo` end to end, shortened and headless: both runs, the straggler, the table."""

from __future__ import annotations

import asyncio

import pytest
from rich.console import Console

from tailguard.demo import FLEET, STRAGGLER, run_demo, run_pd_demo

# Its bars are wall-clock times and live comparisons: `make test` runs it alone,
# after the rest has run two at a time (a second worker's load would move them).
pytestmark = pytest.mark.solo


def test_demo_compares_a_baseline_with_tailguard_and_catches_the_straggler() -> None:
    console = Console(record=True, width=200, force_terminal=False)
    runs = asyncio.run(run_demo(24.0, None, console, baseline="round_robin"))
    print({r.label: r.summary["slo_attainment"] for r in runs})
    assert [r.label for r in runs] == ["round_robin", "tailguard"]
    base, tg = runs
    for r in runs:
        assert r.summary["completed"] > 200
    # The detector saw the throttled node in the tailguard run (and, off, not in the other).
    assert any(node == STRAGGLER for _, node, _, _ in tg.events)
    assert not any(node == STRAGGLER for _, node, _, _ in base.events)
    assert "throttled" in tg.story and "was " in tg.story
    # tailguard holds the SLO better through the same throttle and crash
    assert tg.summary["slo_attainment"] > base.summary["slo_attainment"], \
        (tg.summary["slo_attainment"], base.summary["slo_attainment"])
    # Every GPU class served requests under tailguard.
    assert all(tg.shares[g] > 0 for g, _ in FLEET), tg.shares
    text = console.export_text()
    assert "round_robin" in text and "tailguard" in text and "SLO attainment" in text
    assert "/dashboard" in text.split("SLO attainment")[0]  # the URL before the results


def test_pd_demo_serves_the_same_load_co_located_and_disaggregated() -> None:
    console = Console(record=True, width=200, force_terminal=False)
    colo, pd = asyncio.run(run_pd_demo(5.0, 4.0, console))
    for r in (colo, pd):
        assert r.summary["failed"] == 0 and r.summary["completed"] >= 10
    assert "disaggregated" not in colo.summary  # every prompt computed where it was decoded
    assert pd.summary["disaggregated"]["remote_share"] >= 0.5
    assert pd.shares["A100-80GB"] == 1.0  # only decode nodes answer
    text = console.export_text()
    assert "prompts computed remotely" in text and "TPOT p50 / p99" in text
