"""The fleet file's ``discovery:`` section (the watcher is :mod:`tailguard.gateway.discovery`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tailguard.errors import ConfigError

_KEYS = ("namespace", "selector", "port", "inference_pool", "models", "kubeconfig",
         "watch_timeout_s")


@dataclass(frozen=True, slots=True)
class KubernetesDiscoveryConfig:
    namespace: str
    selector: str  # "" with inference_pool: the pool's own selector
    port: int | str  # a number, or the name of a container port (0: the pool's targetPorts)
    inference_pool: str | None = None  # an InferencePool (inference.networking.k8s.io/v1)
    models: tuple[str, ...] = ()
    kubeconfig: str | None = None  # default: in-cluster, else the usual kubeconfig
    watch_timeout_s: int = 300  # the server ends each watch after this; it resumes


def parse_discovery(raw: Any) -> KubernetesDiscoveryConfig | None:
    """The fleet file's ``discovery:`` (only ``kubernetes`` so far)."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping) or set(raw) != {"kubernetes"}:
        raise ConfigError("discovery", "expected {kubernetes: {namespace, selector, port}}")
    m = raw["kubernetes"]
    where = "discovery.kubernetes"
    if not isinstance(m, Mapping):
        raise ConfigError(where, "expected a mapping with namespace, selector and port")
    unknown = sorted(set(m) - set(_KEYS))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}", "unknown key", list(_KEYS))
    pool = m.get("inference_pool")
    if pool is not None and (not isinstance(pool, str) or not pool):
        raise ConfigError(f"{where}.inference_pool", "must be an InferencePool's name")
    for key in ("namespace",) if pool else ("namespace", "selector"):
        if not isinstance(m.get(key), str) or not m[key]:
            raise ConfigError(f"{where}.{key}", "is required (a non-empty string)")
    if pool and "selector" in m:
        raise ConfigError(f"{where}.selector", "comes from the InferencePool: give one or the other")
    port = m.get("port", 0 if pool else None)
    if isinstance(port, bool) or not ((isinstance(port, int) and 0 <= port < 65536
                                       and (port or pool)) or (isinstance(port, str) and port)):
        raise ConfigError(f"{where}.port", "is required: a port number or a container port name")
    models = m.get("models") or ()
    if isinstance(models, str):
        models = (models,)
    if not all(isinstance(x, str) and x for x in models):
        raise ConfigError(f"{where}.models", "must be a list of model names")
    timeout = m.get("watch_timeout_s", 300)
    if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 1:
        raise ConfigError(f"{where}.watch_timeout_s", "must be a whole number of seconds >= 1")
    kubeconfig = m.get("kubeconfig")
    if kubeconfig is not None and not isinstance(kubeconfig, str):
        raise ConfigError(f"{where}.kubeconfig", "must be a path")
    return KubernetesDiscoveryConfig(m["namespace"], m.get("selector", ""), port, pool,
                                     tuple(models), kubeconfig, timeout)
