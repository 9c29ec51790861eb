"""The decision core's option sections, as scenario and fleet files spell them.

``outliers:`` (:class:`~tailguard.core.outliers.OutlierConfig`, on by default)
is read the same way by ``tailguard sim`` (top level of a scenario) and
``tailguard serve`` (top level of a fleet file): every key is a field of the
dataclass, type-checked, unknown keys refused::

    outliers: {enabled: true, interval_s: 5, slow_ratio: 1.5, base_ejection_s: 30}

``hedging:`` (:class:`~tailguard.core.hedging.HedgeConfig`, off by default) is
a scenario's top-level key and a fleet file's per-pool key::

    hedging: {enabled: true, quantile: 0.95, budget: 0.05}   # or after_s: 0.5 (fixed)
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from tailguard.config_file import check_keys, require_mapping
from tailguard.core.hedging import HedgeConfig
from tailguard.core.outliers import OutlierConfig
from tailguard.errors import ConfigError


def parse_dataclass_options(raw: Any, where: str, cls: Any, default: Any) -> Any:
    """Build ``cls`` from a mapping of its field names (bool/int/float checked)."""
    if raw is None:
        return default
    m = require_mapping(raw, where)
    names = [f.name for f in fields(cls)]
    check_keys(m, names, where)
    kwargs: dict[str, Any] = {}
    for f in fields(cls):
        if f.name not in m:
            continue
        value = m[f.name]
        base = getattr(default, f.name)
        if isinstance(base, bool):
            if not isinstance(value, bool):
                raise ConfigError(f"{where}.{f.name}", "must be true or false")
        elif isinstance(base, int):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{where}.{f.name}", f"must be an integer >= 1, got {value!r}")
        elif isinstance(base, float):
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ConfigError(f"{where}.{f.name}", f"must be a number >= 0, got {value!r}")
            value = float(value)
        kwargs[f.name] = value
    return cls(**{**{f.name: getattr(default, f.name) for f in fields(cls)}, **kwargs})


def parse_outliers(raw: Any, where: str = "outliers") -> OutlierConfig:
    cfg: OutlierConfig = parse_dataclass_options(raw, where, OutlierConfig, OutlierConfig())
    if cfg.interval_s <= 0:
        raise ConfigError(f"{where}.interval_s", "must be > 0")
    if not 0.0 < cfg.max_ejection_share <= 1.0:
        raise ConfigError(f"{where}.max_ejection_share", "must be in (0, 1]")
    return cfg


def parse_hedging(raw: Any, where: str = "hedging") -> HedgeConfig:
    cfg: HedgeConfig = parse_dataclass_options(raw, where, HedgeConfig, HedgeConfig())
    if not 0.0 < cfg.quantile < 1.0:
        raise ConfigError(f"{where}.quantile", "must be in (0, 1)")
    if not 0.0 <= cfg.budget <= 1.0:
        raise ConfigError(f"{where}.budget", "must be in [0, 1]")
    if cfg.burst < 1.0:
        raise ConfigError(f"{where}.burst", "must be >= 1 (one hedge)")
    return cfg
