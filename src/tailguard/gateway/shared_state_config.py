"""The fleet file's ``shared_state:`` section (the driver is :mod:`tailguard.gateway.shared_state`)."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tailguard.errors import ConfigError

_KEYS = ("url", "replica", "namespace", "period_s", "ttl_s", "timeout_s")


@dataclass(frozen=True, slots=True)
class SharedStateConfig:
    """Where replicas meet, and how often.

    ``period_s``: how often a replica publishes and merges (its view of the
    others is at most this old, plus Redis's round trip). ``ttl_s``: how long
    a replica's report, and the leader's lease, outlive its last publish: a
    dead replica's share of every node expires after it. ``timeout_s``: a
    sync that takes longer is abandoned and counted as Redis being down.
    """

    url: str
    replica: str  # unique per replica: default the host name and process id
    namespace: str = "tailguard"  # key prefix: several fleets may share one Redis
    period_s: float = 0.25
    ttl_s: float = 2.0
    timeout_s: float = 0.5


def default_replica() -> str:
    """``POD_NAME`` (set it from the downward API), else host name and process id."""
    return os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"


def parse_shared_state(raw: Any) -> SharedStateConfig | None:
    if raw is None:
        return None
    where = "shared_state"
    if not isinstance(raw, Mapping):
        raise ConfigError(where, "expected a mapping such as {url: redis://HOST:PORT/DB}")
    unknown = sorted(set(raw) - set(_KEYS))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}", "unknown key", list(_KEYS))
    url = raw.get("url")
    if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(f"{where}.url", "is required: redis://HOST:PORT/DB (or rediss://, "
                                          "unix://)")
    replica = raw.get("replica") or default_replica()
    namespace = raw.get("namespace", "tailguard")
    for key, value in (("replica", replica), ("namespace", namespace)):
        if not isinstance(value, str) or not value or any(c in value for c in " {}:"):
            raise ConfigError(f"{where}.{key}", "must be a non-empty name without spaces, "
                                                "braces or colons")

    def seconds(key: str, default: float, lo: float) -> float:
        v = raw.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int | float) or v < lo:
            raise ConfigError(f"{where}.{key}", f"must be a number of seconds >= {lo}")
        return float(v)

    period = seconds("period_s", 0.25, 0.01)
    ttl = seconds("ttl_s", max(2.0, 4 * period), 0.05)
    if ttl < 2 * period:
        raise ConfigError(f"{where}.ttl_s", f"must be at least twice period_s ({2 * period} s): "
                                            "a live replica would expire between publishes")
    timeout = seconds("timeout_s", min(0.5, ttl / 2), 0.01)
    return SharedStateConfig(url, replica, namespace, period, ttl, timeout)
