"""Routing policies: one small class each, chosen by name from one registry."""

from __future__ import annotations

from typing import Any

from tailguard.core.policies.base import PairPolicy, Policy, RequestInfo, Slo
from tailguard.core.policies.cache_aware import CacheAware
from tailguard.core.policies.consistent_hash import ConsistentHash
from tailguard.core.policies.least_request import LeastRequest
from tailguard.core.policies.p2c import PowerOfTwo
from tailguard.core.policies.pairs import DynamoConditional, PerPhase
from tailguard.core.policies.peak_ewma import PeakEwmaP2C
from tailguard.core.policies.random_choice import RandomChoice
from tailguard.core.policies.round_robin import RoundRobin
from tailguard.core.policies.seed_weighted import SeedWeighted
from tailguard.core.policies.tailguard import TailguardPolicy
from tailguard.errors import ConfigError

REGISTRY: dict[str, type[Any]] = {
    cls.name: cls
    for cls in (
        RoundRobin,
        RandomChoice,
        LeastRequest,
        PowerOfTwo,
        PeakEwmaP2C,
        SeedWeighted,
        TailguardPolicy,
        CacheAware,
        ConsistentHash,
        DynamoConditional,
    )
}

DEFAULT_POLICY = TailguardPolicy.name


def policy_names() -> list[str]:
    return list(REGISTRY)


def options_type(name: str) -> type[Any] | None:
    """The frozen dataclass of policy ``name``'s options (None: it has none); the
    configuration layer parses ``policy_options`` into it."""
    cls = REGISTRY.get(name)
    if cls is None:
        raise ConfigError("policy", f"unknown policy {name!r}", policy_names())
    options: type[Any] | None = cls.Options
    return options


def make_policy(name: str, slo: Slo | None = None, options: Any = None,
                field: str = "policy") -> Policy:
    """Policy ``name`` with its ``options`` (an instance of :func:`options_type`, or
    None for its defaults)."""
    cls = REGISTRY.get(name)
    if cls is None:
        raise ConfigError(field, f"unknown policy {name!r}", policy_names())
    policy: Policy = cls(slo or Slo(), options)
    return policy


def make_pair_policy(name: str, policy: Policy, slo: Slo | None = None,
                     options: Any = None) -> PairPolicy:
    """How ``policy`` routes a pool whose nodes have roles: its own pair choice, or
    phase by phase (:class:`PerPhase`) with a second instance for the prefill side."""
    if hasattr(policy, "choose_pair"):
        return policy  # type: ignore[return-value]  # it has the protocol's method
    return PerPhase(make_policy(name, slo, options), policy)


__all__ = ["DEFAULT_POLICY", "REGISTRY", "PairPolicy", "Policy", "RequestInfo", "Slo",
           "make_pair_policy", "make_policy", "options_type", "policy_names"]
