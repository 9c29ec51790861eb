"""Estimators on literal samples and explicit timestamps."""

from __future__ import annotations

import math

from tailguard.core.estimate import Ewma, LogRatio, PeakEwma


def test_peak_ewma_worked_example() -> None:
    pe = PeakEwma(tau=10.0, initial=0.10)
    pe.update(0.10, 0.0)
    assert pe.update(0.30, 0.0) == 0.30  # a peak replaces the cost at once
    got = pe.update(0.10, 5.0)
    assert math.isclose(got, 0.30 * math.exp(-0.5) + 0.10 * (1 - math.exp(-0.5)))
    assert math.isclose(pe.decayed(15.0), got * math.exp(-1.0))


def test_ewma_time_decay() -> None:
    e = Ewma(tau=10.0)
    assert e.update(1.0, 0.0) == 1.0
    # Ten seconds later the old value keeps weight e^-1 (capped by the warm-up rule).
    v = e.update(0.0, 10.0)
    assert 0.3 < v <= 0.5


def test_log_ratio_learns_a_constant_slowdown() -> None:
    r = LogRatio(alpha=0.1)
    for _ in range(60):
        r.update(2.5, 1.0)
    assert abs(r.ratio - 2.5) < 0.05


def test_log_ratio_clamps_wild_samples() -> None:
    r = LogRatio(alpha=0.1, prior_weight=20.0)
    r.update(1e6, 1.0)
    # The sample counts as log-ratio 3 (not 13.8), weighted by alpha 0.1.
    assert math.isclose(r.ratio, math.exp(0.3))
