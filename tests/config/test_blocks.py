"""The configuration layer: one parse entry point, errors naming the dotted field."""

from __future__ import annotations

import math

import pytest

from tailguard.config import parse, parse_core
from tailguard.config.options import (
    AdmissionBlock,
    HedgingBlock,
    LimitsBlock,
    OutliersBlock,
    RetriesBlock,
)
from tailguard.core.admission import AdmissionConfig
from tailguard.core.hedging import HedgeConfig
from tailguard.core.limits import LimitConfig
from tailguard.core.outliers import OutlierConfig
from tailguard.core.retry_budget import RetryConfig
from tailguard.errors import ConfigError


def test_blocks_build_the_cores_dataclasses_with_its_defaults() -> None:
    assert parse_core(LimitsBlock, {"kind": "aimd", "max": 32}, "limits") == \
        LimitConfig(kind="aimd", max_limit=32)
    assert parse_core(AdmissionBlock, {"queue_max": 8}, "admission") == AdmissionConfig(queue_max=8)
    assert parse_core(OutliersBlock, None, "outliers") == OutlierConfig()
    assert parse_core(HedgingBlock, {"enabled": True}, "hedging") == HedgeConfig(enabled=True)
    assert parse_core(RetriesBlock, 2, "retries") == RetryConfig(attempts=2)  # the shorthand
    assert parse_core(LimitsBlock, None, "limits", optional=True) is None  # no limits
    # A whole number where a real one goes is that number.
    assert parse_core(LimitsBlock, {"target": 1}, "limits").target == 1.0


@pytest.mark.parametrize(("block", "raw", "where", "field", "said"), [
    (LimitsBlock, {"kind": "vegas"}, "limits", "limits.kind", "'gradient', 'aimd' or 'fixed'"),
    (LimitsBlock, {"min": 8, "max": 4}, "pools.m.limits", "pools.m.limits.max", "min (8)"),
    (LimitsBlock, {"colour": 1}, "limits", "limits.colour", "unknown key"),
    (LimitsBlock, {"window": True}, "limits", "limits.window", "integer"),
    (LimitsBlock, {"target": math.nan}, "limits", "limits.target", "finite"),
    (AdmissionBlock, {"queue_max": -1}, "admission", "admission.queue_max", "-1"),
    (AdmissionBlock, {"queue_max": "many"}, "admission", "admission.queue_max", "'many'"),
    (OutliersBlock, {"interval_s": 0}, "outliers", "outliers.interval_s", "must be > 0"),
    (HedgingBlock, [1], "pools.m.hedging", "pools.m.hedging", "mapping"),
    (HedgingBlock, {"quantile": 1.0}, "hedging", "hedging.quantile", "must be < 1"),
    (RetriesBlock, {"budget": 2}, "pools.m.retries", "pools.m.retries.budget", "must be <= 1"),
])
def test_errors_name_the_field(block: type, raw: object, where: str, field: str,
                               said: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse(block, raw, where)
    assert err.value.field == field and said in str(err.value)


def test_unknown_keys_list_the_known_ones_and_x_keys_are_the_users() -> None:
    with pytest.raises(ConfigError) as err:
        parse(AdmissionBlock, {"queue_maxx": 3}, "admission")
    assert err.value.allowed is not None and "queue_max" in err.value.allowed
    assert parse_core(AdmissionBlock, {"x-owner": "team a", "queue_max": 3},
                      "admission") == AdmissionConfig(queue_max=3)


def test_an_unknown_key_is_reported_before_what_it_may_have_misspelt() -> None:
    from tailguard.config.fleet import parse_fleet

    with pytest.raises(ConfigError) as err:
        parse_fleet({"discovery": {"kubernetes": {"namespace": "n", "selectr": "a=b",
                                                  "port": 80}}})
    assert err.value.field == "discovery.kubernetes.selectr"
    with pytest.raises(ConfigError) as err:  # a value tried against a union: no type tags
        parse_fleet({"discovery": {"kubernetes": {"namespace": "n", "selector": "a=b",
                                                  "port": True}}})
    assert err.value.field == "discovery.kubernetes.port"


def test_policy_options_become_the_policys_dataclass() -> None:
    from tailguard.config.options import POLICY_OPTIONS, parse_policy_options
    from tailguard.core.policies import REGISTRY, options_type
    from tailguard.core.policies.pairs import DynamoOptions
    from tailguard.core.policies.tailguard_options import TailguardOptions
    from tailguard.sim.scenario import parse_policies

    # Every policy with options has a block, and every block belongs to its policy.
    assert {n for n in REGISTRY if options_type(n) is not None} == set(POLICY_OPTIONS)
    assert parse_policy_options("tailguard", {"sample": 4, "ttft_weight": 1000}) == \
        TailguardOptions(sample=4, ttft_weight=1000.0)
    assert parse_policy_options("tailguard", {"ttft_weight": "slo"}) == TailguardOptions()
    assert parse_policy_options("tailguard", None) is None  # every default
    assert parse_policy_options("round_robin", {}) is None
    assert parse_policy_options("dynamo", {"max_local_prefill_length": 512}) == \
        DynamoOptions(max_local_prefill_length=512)
    with pytest.raises(ConfigError) as err:
        parse_policy_options("least_request", {"sample": 2}, "pools.m.policy_options")
    assert err.value.field == "pools.m.policy_options.sample" and err.value.allowed == []
    # A scenario's policy entry: options parsed, its label names those not default.
    (choice,) = parse_policies([{"name": "tailguard", "sample": 4, "slo_headroom": 0.9}])
    assert choice.options == TailguardOptions(sample=4) and choice.label == "tailguard[sample=4]"
    with pytest.raises(ConfigError) as err:
        parse_policies([{"name": "tailguard", "sample": 1}])
    assert err.value.field == "policies[0].sample"
