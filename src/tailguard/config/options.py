"""The decision core's option blocks, as scenario and fleet files spell them.

``limits:`` (:class:`~tailguard.core.limits.LimitConfig`), ``admission:``
(:class:`~tailguard.core.admission.AdmissionConfig`), ``outliers:``
(:class:`~tailguard.core.outliers.OutlierConfig`, on by default), ``hedging:``
(:class:`~tailguard.core.hedging.HedgeConfig`, off by default) and
``retries:`` (:class:`~tailguard.core.retry_budget.RetryConfig`; a bare number
is the attempts) and ``migration:`` (:class:`~tailguard.core.migration.MigrationConfig`,
on by default)::

    limits: {kind: gradient, min: 2, target: 0.9}
    admission: {queue_max: 256}
    outliers: {interval_s: 5, slow_ratio: 1.5, base_ejection_s: 30}
    hedging: {enabled: true, quantile: 0.95, budget: 0.05}
    retries: {attempts: 2, budget: 0.1}
    migration: {stall_floor_s: 2, max_per_request: 1}
"""

from __future__ import annotations

from typing import Literal

from pydantic import ValidationInfo, field_validator

from tailguard.config.parse import block_for
from tailguard.core.admission import AdmissionConfig
from tailguard.core.hedging import HedgeConfig
from tailguard.core.limits import LimitConfig
from tailguard.core.migration import MigrationConfig
from tailguard.core.outliers import OutlierConfig
from tailguard.core.retry_budget import RetryConfig


def _max_at_least_min(value: int | None, info: ValidationInfo) -> int | None:
    low = info.data.get("min_limit", 1)
    if value is not None and value < low:
        raise ValueError(f"must be >= min ({low})")
    return value


LimitsBlock = block_for(
    LimitConfig, aliases={"min_limit": "min", "max_limit": "max"},
    types={"kind": Literal["gradient", "aimd", "fixed"]},
    validators={"max_at_least_min": field_validator("max_limit")(_max_at_least_min)},
    bounds={
    "target": {"ge": 0.05, "le": 2.0},
    "percentile": {"ge": 0.5, "le": 1.0},
    "smoothing": {"ge": 0.0, "le": 1.0},
    "backoff": {"ge": 0.1, "le": 1.0},
    "kv_full": {"ge": 0.0, "le": 1.0},
    "input_tokens": {"ge": 1.0},
    "output_tokens": {"ge": 1.0},
    })

AdmissionBlock = block_for(AdmissionConfig, bounds={
    "queue_max": {"ge": 0},
    "queue_max_bytes": {"ge": 0},
    "rate_tau_s": {"gt": 0.0},
    "min_retry_after_s": {"gt": 0.0},
})

OutliersBlock = block_for(OutlierConfig, bounds={
    "interval_s": {"gt": 0.0},
    "max_ejection_share": {"gt": 0.0, "le": 1.0},
})

HedgingBlock = block_for(HedgeConfig, bounds={
    "quantile": {"gt": 0.0, "lt": 1.0},
    "budget": {"ge": 0.0, "le": 1.0},
    "burst": {"ge": 1.0},
})

RetriesBlock = block_for(RetryConfig, shorthand="attempts", bounds={
    "budget": {"ge": 0.0, "le": 1.0},  # a share of requests
})

MigrationBlock = block_for(MigrationConfig, bounds={
    "stall_factor": {"ge": 1.0},
    "stall_floor_s": {"gt": 0.0},
    "min_remaining_tokens": {"ge": 0},
    "max_per_request": {"ge": 0},
    "budget": {"ge": 0.0, "le": 1.0},  # a share of requests
    "min_per_s": {"ge": 0.0},
    "burst": {"ge": 0},
    "engine_priority": {},  # any integer: the engine's own scale (vLLM: lower goes first)
})

__all__ = ["AdmissionBlock", "HedgingBlock", "LimitsBlock", "MigrationBlock", "OutliersBlock",
           "RetriesBlock"]
