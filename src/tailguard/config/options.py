"""The decision core's option blocks, as scenario and fleet files spell them.

``limits:`` (:class:`~tailguard.core.limits.LimitConfig`), ``admission:``
(:class:`~tailguard.core.admission.AdmissionConfig`), ``outliers:``
(:class:`~tailguard.core.outliers.OutlierConfig`, on by default), ``hedging:``
(:class:`~tailguard.core.hedging.HedgeConfig`, off by default),
``retries:`` (:class:`~tailguard.core.retry_budget.RetryConfig`; a bare number
is the attempts), ``migration:`` (:class:`~tailguard.core.migration.MigrationConfig`,
on by default), and each policy's ``policy_options`` (the policy's ``Options``
dataclass; a policy without options takes none)::

    limits: {kind: gradient, min: 2, target: 0.9}
    admission: {queue_max: 256}
    outliers: {interval_s: 5, slow_ratio: 1.5, base_ejection_s: 30}
    hedging: {enabled: true, quantile: 0.95, budget: 0.05}
    retries: {attempts: 2, budget: 0.1}
    migration: {stall_floor_s: 2, max_per_request: 1}
    policy_options: {sample: 4, ttft_weight: slo}      # tailguard
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ValidationInfo, field_validator

from tailguard.config.parse import Block, FieldError, block_for, parse
from tailguard.core.admission import AdmissionConfig
from tailguard.core.hedging import HedgeConfig
from tailguard.core.limits import LimitConfig
from tailguard.core.migration import MigrationConfig
from tailguard.core.outliers import OutlierConfig
from tailguard.core.policies import options_type
from tailguard.core.policies.cache_aware import CacheAwareOptions
from tailguard.core.policies.consistent_hash import ConsistentHashOptions
from tailguard.core.policies.pairs import DynamoOptions
from tailguard.core.policies.tailguard_options import TailguardOptions
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


def _sample(value: int) -> int:
    if value == 1:
        raise ValueError("must be 0 (every node) or >= 2")
    return value


def _slo_weight(value: Any) -> Any:
    """``ttft_weight: slo`` (weigh TTFT as the SLOs do) is the default, None; any other
    string is refused."""
    if isinstance(value, str):
        if value != "slo":
            raise FieldError(None, f"must be a number or 'slo', got {value!r}", ["slo"])
        return None
    return value


class NoOptions(Block):
    """The options of a policy that has none: any key is unknown."""


# Each policy's ``policy_options`` block, built from the policy's own dataclass.
POLICY_OPTIONS: dict[str, type[Block]] = {
    "tailguard": block_for(
        TailguardOptions,
        validators={"sample_not_one": field_validator("sample")(_sample),
                    "slo_weight": field_validator("ttft_weight", mode="before")(_slo_weight)},
        bounds={"sample": {"ge": 0}, "slo_headroom": {"gt": 0.0, "le": 1.0},
                "ttft_weight": {"gt": 0.0}, "queue_weight": {"ge": 0.0},
                "spill_excess": {"gt": 0.0}}),
    "cache_aware": block_for(CacheAwareOptions, bounds={
        "cache_threshold": {"ge": 0.0, "le": 1.0}, "balance_abs_threshold": {"ge": 0},
        "balance_rel_threshold": {"ge": 1.0}}),
    "consistent_hash": block_for(ConsistentHashOptions),
    "dynamo": block_for(DynamoOptions, bounds={
        "max_local_prefill_length": {"ge": 0},
        "max_remote_prefill_cache_hit_ratio": {"ge": 0.0, "le": 1.0}}),
}


def parse_policy_options(policy: str, raw: Any, where: str = "policy_options") -> Any:
    """``policy_options`` of ``policy`` as its dataclass (None: every default, or a
    policy without options)."""
    kind = options_type(policy)
    block = POLICY_OPTIONS.get(policy, NoOptions)
    assert block.CORE is kind, f"policy {policy!r} has options without a block here"
    parsed = parse(block, raw, where)
    return parsed.core() if kind is not None and raw else None


__all__ = ["POLICY_OPTIONS", "AdmissionBlock", "HedgingBlock", "LimitsBlock", "MigrationBlock",
           "NoOptions", "OutliersBlock", "RetriesBlock", "parse_policy_options"]
