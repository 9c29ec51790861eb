"""The fleet file's parsed form: frozen settings for the gateway, its nodes and pools.

:mod:`tailguard.config.fleet` parses a fleet file into these (and re-exports
them); everything here is a frozen dataclass, so a reload builds a new
:class:`FleetConfig` and the gateway diffs it against the running one.
"""

from __future__ import annotations

import functools
import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from yarl import URL

from tailguard.config.discovery import KubernetesDiscoveryConfig
from tailguard.config.faults import FaultSpec
from tailguard.config.remediation import RemediationConfig
from tailguard.config.shared_state import SharedStateConfig
from tailguard.core.admission import AdmissionConfig
from tailguard.core.balancer import PoolConfig
from tailguard.core.fleet import NodeSpec
from tailguard.core.hardware import DEFAULT_CATALOG, GPU, Catalog
from tailguard.core.hedging import HedgeConfig
from tailguard.core.limits import LimitConfig
from tailguard.core.outliers import OutlierConfig
from tailguard.core.pipeline import Layout
from tailguard.core.policies import Slo
from tailguard.core.retry_budget import RetryConfig

#: Engines whose metric names the gateway knows (``None`` in a node: detect).
ENGINES = ("vllm", "sglang", "trtllm", "tgi", "llamacpp")
DEFAULT_LISTEN = ("127.0.0.1", 8080)
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024

# -- the dataclasses ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Per-pool upstream timeouts, in seconds.

    ``first_byte_s`` bounds the wait for the first byte of a *streamed*
    answer (a non-streamed answer only arrives once it is complete, so only
    ``total_s`` bounds it); ``idle_s`` bounds the gap between two chunks of a
    stream; ``total_s`` bounds the whole request, retries included.
    """

    connect_s: float = 2.0
    first_byte_s: float = 30.0
    idle_s: float = 30.0
    total_s: float = 600.0


@dataclass(frozen=True, slots=True)
class PoolSettings:
    """One served model name: the decision core's pool (policy, SLO, limits, queue,
    retries, hedging) and what the gateway adds to it (timeouts)."""

    core: PoolConfig
    timeouts: Timeouts = field(default_factory=Timeouts)

    @property
    def retries(self) -> RetryConfig:
        return self.core.retries

    @property
    def hedging(self) -> HedgeConfig:
        return self.core.hedging

    def pool_config(self) -> PoolConfig:
        """The decision core's view of this pool."""
        return self.core

    @property
    def name(self) -> str:
        return self.core.name

    @property
    def policy(self) -> str:
        return self.core.policy

    @property
    def slo(self) -> Slo:
        return self.core.slo

    @property
    def catalog_model(self) -> str | None:
        return self.core.catalog_model

    @property
    def limits(self) -> LimitConfig | None:
        """Per-node concurrency limits (core/limits.py)."""
        return self.core.limits

    @property
    def admission(self) -> AdmissionConfig | None:
        """The pool's queue (core/admission.py)."""
        return self.core.admission


@dataclass(frozen=True, slots=True)
class EmulatorOptions:
    """How ``tailguard emulate`` runs a node (``emulator:`` of a node, and of the
    fleet for every node's defaults); None: not given here."""

    speed: float | None = None  # this unit's speed, 1.0 nominal (0.8: a slow unit)
    catalog_model: str | None = None  # the catalog model to time
    max_num_batched_tokens: int | None = None  # engine token budget per step (vLLM's flag)
    enable_chunked_prefill: bool | None = None  # as vLLM's flag (default true)
    kv_capacity_tokens: int | None = None  # instead of the KV cache the roofline derives
    block_size: int | None = None  # KV block size (default 16)
    enable_prefix_caching: bool | None = None  # as vLLM's flag (default true)
    # As vLLM's flag: the most prompt tokens one request computes in a step (0: no cap).
    long_prefill_token_threshold: int | None = None

    def over(self, defaults: EmulatorOptions) -> EmulatorOptions:
        """These options, each one not given taken from ``defaults``."""
        return EmulatorOptions(*(mine if mine is not None else theirs
                                 for mine, theirs in zip(_astuple(self), _astuple(defaults),
                                                         strict=True)))


def _astuple(options: EmulatorOptions) -> tuple[Any, ...]:
    return tuple(getattr(options, f.name) for f in fields(options))


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """One engine replica: the decision core's node (its hardware, models, slots; its
    ``url``, the base URL without a trailing slash: requests go to url + "/v1/...")
    and what the gateway adds to it."""

    core: NodeSpec
    engine: str | None = None  # one of ENGINES; None: detect from the metric names
    api_key_env: str | None = None  # env var holding the key the engine expects
    dcgm_url: str | None = None  # the node's DCGM exporter page (adapters/dcgm.py)
    faults: tuple[FaultSpec, ...] = ()  # what the emulator makes it suffer
    emulator: EmulatorOptions = field(default_factory=lambda: EmulatorOptions())

    def spec(self) -> NodeSpec:
        """The decision core's view of this node."""
        return self.core

    @property
    def id(self) -> str:
        return self.core.id

    @property
    def url(self) -> str:
        return self.core.url or ""

    @property
    def gpu(self) -> str:
        """The GPU as the file names it."""
        return self.core.gpu_name

    @property
    def gpu_spec(self) -> GPU | None:
        """The catalog entry; None for a GPU the catalog does not know."""
        return self.core.gpu

    @property
    def models(self) -> tuple[str, ...]:
        return self.core.models

    @property
    def tp(self) -> int:
        return self.core.tp

    @property
    def labels(self) -> Mapping[str, str]:
        return self.core.labels

    @property
    def weight(self) -> float | None:
        return self.core.weight

    @property
    def max_num_seqs(self) -> int:
        return self.core.max_num_seqs

    @property
    def layout(self) -> Layout | None:
        """A pipeline-parallel replica's stages (core/pipeline.py)."""
        return self.core.layout

    @property
    def host(self) -> str:
        return URL(self.url).host or ""

    @property
    def port(self) -> int:
        return URL(self.url).port or 80

    @property
    def endpoint(self) -> str:
        """``host:port`` (IPv6 in brackets): how an endpoint picker names the node."""
        host = self.host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    @property
    def gpu_class(self) -> str:
        """What the node is compared with: the core's (a pipeline's layout, or its GPU)."""
        return self.core.gpu_class

    def upstream_api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None


@dataclass(frozen=True, slots=True)
class AdminConfig:
    """The admin API: off unless the env var ``token_env`` holds a token.

    ``allow`` lists the hosts (names, addresses or CIDR networks) a node
    registered through ``POST /admin/nodes`` may point at; empty refuses every
    registration (this guards against the gateway being used to reach
    arbitrary hosts).
    """

    token_env: str | None = None
    allow: tuple[str, ...] = ()

    def token(self) -> str | None:
        if not self.token_env:
            return None
        return os.environ.get(self.token_env) or None

    def url_allowed(self, url: str) -> bool:
        host = URL(url).host
        if not host:
            return False
        try:
            addr: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(host)
        except ValueError:
            addr = None
        for entry in self.allow:
            if addr is not None and "/" in entry:
                try:
                    if addr in ipaddress.ip_network(entry, strict=False):
                        return True
                except ValueError:
                    continue
            elif entry.lower() == host.lower():
                return True
        return False


@dataclass(frozen=True, slots=True)
class ScrapeSettings:
    """Engine metrics scraping (``GET {url}/metrics``)."""

    interval_s: float = 0.5
    stale_s: float = 2.0  # older data is marked stale and withdrawn from the balancer
    timeout_s: float = 1.0
    path: str = "/metrics"


@dataclass(frozen=True, slots=True)
class ClientSettings:
    """What the gateway allows its clients' connections (``client:`` in the fleet file).

    ``header_timeout_s``: from the first byte of a request until its headers
    are complete (slowloris). ``body_timeout_s``: reading the request body
    (answered 408). ``idle_timeout_s``: a keep-alive connection with no new
    request, counted from its connect or its last answer (a connection that
    never completes a request is closed then too). ``max_connections``: open
    client connections (default: half the file-descriptor limit); at the cap
    the oldest connection without a request in progress is closed to make
    room, and only when all are busy is a new one answered 503 and closed.
    ``write_timeout_s``: a streamed answer's client that takes nothing of it
    for this long is dropped (a slow reader: never charged to the node).
    """

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    idle_timeout_s: float = 15.0
    write_timeout_s: float = 30.0
    max_connections: int | None = None


@dataclass(frozen=True, slots=True)
class HealthSettings:
    """Active health checks (``GET {url}{path}``)."""

    interval_s: float = 2.0
    timeout_s: float = 1.0
    path: str = "/health"
    failures: int = 2  # consecutive failures before a node is marked down
    successes: int = 1  # consecutive successes before it is routed again


@functools.lru_cache(maxsize=1024)
def _default_pool(model: str) -> PoolSettings:
    # Immutable, so one per name; cached because the proxy asks per request.
    return PoolSettings(PoolConfig(model))


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """A parsed fleet file."""

    listen: tuple[str, int] = DEFAULT_LISTEN
    nodes: tuple[NodeConfig, ...] = ()
    pools: Mapping[str, PoolSettings] = field(default_factory=dict)
    admin: AdminConfig = field(default_factory=AdminConfig)
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    scrape: ScrapeSettings = field(default_factory=ScrapeSettings)
    health: HealthSettings = field(default_factory=HealthSettings)
    reload_poll_s: float = 1.0  # mtime poll of the file; 0 turns it off
    shutdown_timeout_s: float = 30.0
    emulator: EmulatorOptions = field(default_factory=lambda: EmulatorOptions())  # defaults
    catalog: Catalog = DEFAULT_CATALOG
    path: Path | None = None  # the file it came from, for reloads
    warnings: tuple[str, ...] = ()
    outliers: OutlierConfig = field(default_factory=OutlierConfig)  # straggler detection
    remediation: RemediationConfig = field(default_factory=RemediationConfig)
    client: ClientSettings = field(default_factory=ClientSettings)
    discovery: KubernetesDiscoveryConfig | None = None  # engines as pods (adapters/discovery.py)
    shared_state: SharedStateConfig | None = None  # replicas as one (adapters/shared_state.py)

    def pool(self, model: str) -> PoolSettings:
        """The settings of ``model``'s pool (defaults when the file has none)."""
        found = self.pools.get(model)
        return found if found is not None else _default_pool(model)

    def node(self, node_id: str) -> NodeConfig | None:
        for n in self.nodes:
            if n.id == node_id:
                return n
        return None

    @property
    def models(self) -> list[str]:
        """Served model names, in the order the nodes first name them."""
        seen: dict[str, None] = {}
        for n in self.nodes:
            for m in n.models:
                seen.setdefault(m, None)
        return list(seen)
