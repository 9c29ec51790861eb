"""The hedging decision: delay (class quantile, or per request), budget, silence."""

from __future__ import annotations

from tailguard.core.hedging import HedgeConfig, Hedger


def test_delay_is_the_class_quantile_once_known() -> None:
    h = Hedger(HedgeConfig(enabled=True, min_samples=20, window=100))
    assert h.hedge_after("A100") is None
    for i in range(100):
        h.on_ttft("A100", 0.01 * (i + 1))  # 0.01 .. 1.00
    assert h.hedge_after("A100") == 0.96  # p95 of 100 samples: the 96th
    assert h.hedge_after("L4") is None  # per class
    assert Hedger(HedgeConfig(after_s=0.3)).hedge_after("L4") == 0.3


def test_budget_caps_hedges_at_the_share_of_requests() -> None:
    h = Hedger(HedgeConfig(enabled=True, budget=0.05, burst=3.0))
    sent = 0
    for _ in range(1000):
        h.on_request()
        if h.try_hedge():
            sent += 1
    assert sent == 51  # one hedge of starting credit, then 5% of 1000 requests
    h2 = Hedger(HedgeConfig(enabled=True, budget=0.05, burst=3.0))
    for _ in range(1000):
        h2.on_request()
    # Saved credit is capped: a burst of at most three hedges.
    assert [h2.try_hedge() for _ in range(4)] == [True, True, True, False]


def test_silence_of_the_node() -> None:
    h = Hedger(HedgeConfig(enabled=True))
    assert h.silent("n1", 10.0, 0.5)  # never heard of: silent
    h.on_progress("n1", 9.8)
    assert not h.silent("n1", 10.0, 0.5)
    assert h.silent("n1", 10.3, 0.5)
    assert Hedger(HedgeConfig(require_silence=False)).silent("n1", 0.0, 1.0)


def test_default_burst_covers_one_stall() -> None:
    # After 1,000 calm requests a stall may hedge 50 stuck requests at once (a
    # burst of 10 ran dry within each 2 s stall in benchmarks/stragglers.py), but
    # no more: a calm hour must not fund a hedge storm.
    h = Hedger(HedgeConfig(enabled=True))
    for _ in range(5000):
        h.on_request()
    sent = 0
    while h.try_hedge():
        sent += 1
    assert sent == 50


def test_per_request_delay_scales_the_expected_ttft_capped_by_the_class() -> None:
    h = Hedger(HedgeConfig(enabled=True, min_samples=20, window=100))
    for i in range(100):
        # Observed 1.0x .. 1.99x the expectation; TTFTs 0.01 .. 1.00 s.
        h.on_ttft("A100", 0.01 * (i + 1), 0.01 * (i + 1) / (1.0 + 0.01 * i))
    # Ratio p95: the 96th of 1.00 .. 1.99 = 1.95; class TTFT p95 0.96 s.
    assert abs((h.hedge_after("A100", 0.04) or 0.0) - 0.078) < 1e-9  # 0.04 x 1.95
    assert h.hedge_after("A100", 0.8) == 0.96  # never later than the class rule
    assert h.hedge_after("A100") == 0.96  # no expectation: the class rule
    off = Hedger(HedgeConfig(enabled=True, per_request=False, min_samples=20, window=100))
    for i in range(100):
        off.on_ttft("A100", 0.01 * (i + 1), 0.01)
    assert off.hedge_after("A100", 0.04) == 0.96
    assert Hedger(HedgeConfig(after_s=0.3)).hedge_after("L4", 0.01) == 0.3


def test_silence_is_judged_at_the_class_quantile_once_known() -> None:
    h = Hedger(HedgeConfig(enabled=True, min_samples=20, window=100))
    h.on_progress("n1", 10.0)
    assert h.silent("n1", 10.1, 0.05, "A100")  # class unknown: the request's delay
    for _ in range(100):
        h.on_ttft("A100", 0.2)
    assert not h.silent("n1", 10.1, 0.05, "A100")  # a busy node's gap, not a stall
    assert h.silent("n1", 10.25, 0.05, "A100")
