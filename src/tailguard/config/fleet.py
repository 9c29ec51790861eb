"""The fleet file: which engines the gateway fronts, and how each model's pool behaves.

One YAML file serves both ``tailguard serve`` (this package) and ``tailguard
emulate`` (which reads the same nodes and their ``faults``/``emulator`` keys)::

    listen: 127.0.0.1:8080
    nodes:
      - {id: h100-0, url: http://127.0.0.1:8101, gpu: H100-SXM, models: [llama-3.1-8b]}
      - {id: l4-0, url: http://127.0.0.1:8102, gpu: L4, tp: 1, models: [llama-3.1-8b],
         engine: vllm, labels: {zone: a}}
    pools:
      llama-3.1-8b: {policy: tailguard, slo: {ttft_s: 2.0, tpot_s: 0.1}}
    admin: {token_env: TAILGUARD_ADMIN_TOKEN}

:func:`load_fleet` reads a file, :func:`parse_fleet` checks already-loaded data
(the admin API and the tests use it). Every value is validated up front; an
error is a :class:`tailguard.errors.ConfigError` naming the dotted field
(``nodes[1].gpu``) and, where the set is finite, the allowed values. Unknown
keys are errors too (a typo must not silently fall back to a default), except
the raw sections kept for the emulator (``faults``, ``emulator``) and keys that
start with ``x-`` (free annotations).

Decisions worth knowing:

* A GPU name the catalog does not know is *accepted with a warning*
  (:attr:`FleetConfig.warnings`): new or custom accelerators exist, and the
  balancer copes (its prior then has a mid-range GPU's shape and measurements
  set its scale). Aliases such as ``H100``, ``A100`` or the names nvidia-smi
  prints resolve through :data:`tailguard.core.hardware.DEFAULT_CATALOG`.
* A model name the catalog does not know is served all the same; a pool may
  name its ``catalog_model`` for the roofline prior, which must then exist.
* A model served by nodes but absent from ``pools`` gets a pool with the
  defaults (policy ``tailguard``).

The parsed form is frozen dataclasses (:mod:`tailguard.config.settings`,
re-exported here): a reload builds a new :class:`FleetConfig` and the gateway
diffs it against the running one.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator
from yarl import URL

from tailguard.config.catalog import CatalogBlock, extend_catalog
from tailguard.config.core_options import ReplicaShape, SloBlock, kv_link
from tailguard.config.discovery import DiscoveryBlock
from tailguard.config.faults import FaultBlock
from tailguard.config.files import read_yaml
from tailguard.config.options import (
    AdmissionBlock,
    HedgingBlock,
    LimitsBlock,
    MigrationBlock,
    OutliersBlock,
    RetriesBlock,
    parse_policy_options,
)
from tailguard.config.parse import Block, FieldError, block_for, parse, retype
from tailguard.config.remediation import RemediationBlock
from tailguard.config.settings import (
    DEFAULT_LISTEN as DEFAULT_LISTEN,
    DEFAULT_MAX_BODY_BYTES as DEFAULT_MAX_BODY_BYTES,
    ENGINES as ENGINES,
    AdminConfig as AdminConfig,
    ClientSettings as ClientSettings,
    EmulatorOptions as EmulatorOptions,
    FleetConfig as FleetConfig,
    HealthSettings as HealthSettings,
    NodeConfig as NodeConfig,
    PoolSettings as PoolSettings,
    ScrapeSettings as ScrapeSettings,
    Timeouts as Timeouts,
)
from tailguard.config.shared_state import SharedStateBlock
from tailguard.core.balancer import FALLBACK_GPU, PoolConfig
from tailguard.core.fleet import NodeSpec
from tailguard.core.hardware import DEFAULT_CATALOG, Catalog
from tailguard.core.policies import DEFAULT_POLICY, policy_names
from tailguard.errors import ConfigError

# -- values ------------------------------------------------------------------------


def parse_listen(raw: Any, where: str = "listen") -> tuple[str, int]:
    """``host:port``, ``[v6]:port``, ``:port`` or a bare port number."""
    if raw is None:
        return DEFAULT_LISTEN
    if isinstance(raw, int) and not isinstance(raw, bool):
        host, port_text = DEFAULT_LISTEN[0], str(raw)
    elif isinstance(raw, str):
        text = raw.strip()
        if text.startswith("["):
            end = text.find("]")
            if end < 0 or text[end + 1:end + 2] != ":":
                raise ConfigError(where, f"must be host:port, got {raw!r}")
            host, port_text = text[1:end], text[end + 2:]
        elif ":" in text:
            host, _, port_text = text.rpartition(":")
        else:
            host, port_text = DEFAULT_LISTEN[0], text
        host = host or "0.0.0.0"
    else:
        raise ConfigError(where, f"must be host:port, got {raw!r}")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError(where, f"port must be 0-65535, got {port_text!r}")
    return host, int(port_text)


def parse_url(raw: Any, where: str) -> str:
    if not isinstance(raw, str) or not raw:
        raise ConfigError(where, f"must be a URL like http://10.0.0.5:8000, got {raw!r}")
    try:
        url = URL(raw)
    except (ValueError, TypeError) as exc:
        raise ConfigError(where, f"not a valid URL: {raw!r}") from exc
    if url.scheme not in ("http", "https"):
        raise ConfigError(where, f"scheme must be http or https, got {raw!r}", ["http", "https"])
    if not url.host:
        raise ConfigError(where, f"has no host: {raw!r}")
    if url.query_string or url.fragment:
        raise ConfigError(where, f"must not carry a query or fragment: {raw!r}")
    if url.user is not None or url.password is not None:
        # Credentials in a URL end up in logs, the admin API and every scrape;
        # the engine's key belongs in the environment instead.
        raise ConfigError(where, f"must not carry credentials (user:password@); put the "
                                 f"engine's key in an environment variable named by "
                                 f"api_key_env: {redact_url(raw)!r}")
    return raw.rstrip("/")


def redact_url(raw: str) -> str:
    """``raw`` with any ``user:password@`` replaced by ``***@`` (for errors and logs)."""
    scheme, sep, rest = raw.partition("://")
    if not sep:
        return raw
    authority, slash, tail = rest.partition("/")
    if "@" not in authority:
        return raw
    return f"{scheme}://***@{authority.rpartition('@')[2]}{slash}{tail}"


def _a_url(raw: str | None) -> str | None:
    if raw is None:
        return None
    try:
        return parse_url(raw, "")
    except ConfigError as exc:
        raise ValueError(exc.message) from None


def _a_listen(raw: str | int | None) -> str | int | None:
    try:
        parse_listen(raw, "")
    except ConfigError as exc:
        raise ValueError(exc.message) from None
    return raw


def _a_path(path: str) -> str:
    if not path.startswith("/"):
        raise ValueError(f"must start with '/', got {path!r}")
    return path


def _one_or_list(raw: Any) -> Any:
    return [raw] if isinstance(raw, str) else raw


# -- the blocks --------------------------------------------------------------------

_POSITIVE = {"gt": 0.0}
TimeoutsBlock = block_for(Timeouts, bounds=dict.fromkeys(
    ("connect_s", "first_byte_s", "idle_s", "total_s"), _POSITIVE))
ScrapeBlock = block_for(ScrapeSettings, bounds=dict.fromkeys(
    ("interval_s", "stale_s", "timeout_s"), _POSITIVE),
    validators={"a_path": field_validator("path")(_a_path)})
HealthBlock = block_for(HealthSettings, bounds=dict.fromkeys(("interval_s", "timeout_s"),
                                                             _POSITIVE),
                        validators={"a_path": field_validator("path")(_a_path)})
ClientBlock = block_for(ClientSettings, bounds=dict.fromkeys(
    ("header_timeout_s", "body_timeout_s", "idle_timeout_s", "write_timeout_s"), _POSITIVE))
EmulatorBlock = block_for(EmulatorOptions, bounds={
    "speed": _POSITIVE, "catalog_model": {"min_length": 1},
    "long_prefill_token_threshold": {"ge": 0}})

Name = Annotated[str, Field(min_length=1)]


class PoolBlock(Block):
    """One ``pools:`` entry: the pool of one served model name."""

    policy: str = DEFAULT_POLICY
    policy_options: dict[str, Any] = Field(default_factory=dict)
    slo: Block = Field(default_factory=SloBlock)
    catalog_model: Name | None = None
    timeouts: Block = Field(default_factory=TimeoutsBlock)
    retries: Block = Field(default_factory=RetriesBlock)
    limits: Block | None = None
    admission: Block | None = None
    hedging: Block = Field(default_factory=HedgingBlock)
    migration: Block = Field(default_factory=MigrationBlock)

    @field_validator("policy")
    @classmethod
    def _known(cls, policy: str) -> str:
        if policy not in policy_names():
            raise FieldError(None, f"unknown policy {policy!r}", policy_names())
        return policy

    def settings(self, name: str, where: str, catalog: Catalog) -> PoolSettings:
        slo = self.slo.core()
        options = parse_policy_options(self.policy, self.policy_options,
                                       f"{where}.policy_options")
        if self.catalog_model is not None and catalog.find_model(self.catalog_model) is None:
            raise ConfigError(f"{where}.catalog_model", f"unknown model {self.catalog_model!r}",
                              [x.name for x in catalog.models])
        core = PoolConfig(name, self.policy, options, slo, self.catalog_model,
                          limits=self.limits.core() if self.limits is not None else None,
                          admission=self.admission.core() if self.admission is not None
                          else None,
                          retries=self.retries.core(), hedging=self.hedging.core(),
                          migration=self.migration.core())
        return PoolSettings(core, self.timeouts.core())


retype(PoolBlock, slo=SloBlock, timeouts=TimeoutsBlock, retries=RetriesBlock,
       limits=LimitsBlock | None, admission=AdmissionBlock | None, hedging=HedgingBlock,
       migration=MigrationBlock)


class NodeBlock(ReplicaShape):
    """One ``nodes:`` entry (also the body of ``POST /admin/nodes``)."""

    id: str | int
    url: str
    models: list[Name] | Name
    engine: Literal["vllm", "sglang", "trtllm", "tgi", "llamacpp"] | None = None
    labels: dict[str, str | int | float | bool] = Field(default_factory=dict)
    weight: float | None = Field(default=None, gt=0.0)
    max_num_seqs: int = Field(default=256, ge=1)
    api_key_env: Name | None = None
    dcgm_url: str | None = None
    faults: list[FaultBlock] = Field(default_factory=list)
    emulator: Block = Field(default_factory=EmulatorBlock)

    a_url = field_validator("url", "dcgm_url")(_a_url)

    @field_validator("id")
    @classmethod
    def _an_id(cls, node_id: str | int) -> str:
        text = str(node_id)
        if not text or any(c.isspace() for c in text):
            raise ValueError(f"must be a non-empty string without spaces, got {node_id!r}")
        return text

    @field_validator("models")
    @classmethod
    def _distinct(cls, models: list[str] | str) -> list[str]:
        names = _one_or_list(models)
        if not names:
            raise ValueError("must be a non-empty list of served model names")
        if len(set(names)) != len(names):
            raise ValueError("names a model twice")
        return list(names)

    @field_validator("faults")
    @classmethod
    def _own(cls, faults: list[FaultBlock]) -> list[FaultBlock]:
        for f in faults:
            if f.node is not None:
                raise ValueError("a node's faults are its own: leave out node")
            if f.kind == "kv_link":
                raise ValueError("the emulated engines' KV link has no fault yet: no kv_link "
                                 "fault on a fleet node (a scenario's may have one)")
        return faults

    def config(self, where: str, catalog: Catalog, warnings: list[str] | None) -> NodeConfig:
        layout = self.layout(catalog, where)
        if layout is None and self.gpu is None:
            raise ConfigError(f"{where}.gpu", "is required (a GPU name such as H100, A100, L4)",
                              [g.name for g in catalog.gpus])
        gpu = layout.name if layout is not None else str(self.gpu)
        gpu_spec = catalog.find_gpu(gpu) if layout is None else layout.stages[0].gpu
        if gpu_spec is None and warnings is not None:
            warnings.append(f"{where}.gpu: unknown GPU {gpu!r}; its speed will be learned "
                            f"from measurements on an {FALLBACK_GPU}'s shape (declare a card of "
                            "another shape, such as a CPU, under catalog:; known: "
                            + ", ".join(g.name for g in catalog.gpus) + ")")
        spec = NodeSpec(
            id=str(self.id), gpu=gpu_spec, gpu_name=gpu, models=tuple(self.models),
            tp=self.tp if layout is None else layout.stages[0].tp,
            labels={k: str(v) for k, v in self.labels.items()}, weight=self.weight,
            url=self.url, max_num_seqs=self.max_num_seqs, layout=layout, role=self.role,
            kv_link=kv_link(self.kv_link, f"{where}.kv_link"))
        return NodeConfig(spec, engine=self.engine, api_key_env=self.api_key_env,
                          dcgm_url=self.dcgm_url, faults=tuple(f.core() for f in self.faults),
                          emulator=self.emulator.core())


retype(NodeBlock, emulator=EmulatorBlock)


def _host_or_network(entry: str) -> str:
    if "/" in entry:
        try:
            ipaddress.ip_network(entry, strict=False)
        except ValueError:
            raise ValueError(f"not a valid network: {entry!r}") from None
    return entry


HostOrNetwork = Annotated[str, Field(min_length=1), AfterValidator(_host_or_network)]


class AdminBlock(Block):
    """``admin:``: the admin API's token and the hosts nodes may be registered at."""

    token_env: Name | None = None
    allow: list[HostOrNetwork] | HostOrNetwork = Field(default_factory=list)

    @field_validator("allow")
    @classmethod
    def _a_list(cls, allow: list[str] | str) -> list[str]:
        return list(_one_or_list(allow))


class ReloadBlock(Block):
    """``reload:``: how often the file's modification time is polled (0: never)."""

    poll_s: float = Field(default=1.0, ge=0.0)


class FleetFile(Block):
    """A whole fleet file (``tailguard schema fleet`` prints its JSON Schema)."""

    listen: str | int | None = None
    nodes: list[NodeBlock] = Field(default_factory=list)
    pools: dict[str, PoolBlock] = Field(default_factory=dict)
    discovery: DiscoveryBlock | None = None
    shared_state: Block | None = None
    admin: AdminBlock = Field(default_factory=AdminBlock)
    api_keys: list[Name] = Field(default_factory=list)
    api_keys_env: Name | None = None
    max_body_bytes: int = Field(default=DEFAULT_MAX_BODY_BYTES, ge=1)
    scrape: Block = Field(default_factory=ScrapeBlock)
    health: Block = Field(default_factory=HealthBlock)
    client: Block = Field(default_factory=ClientBlock)
    reload: ReloadBlock = Field(default_factory=ReloadBlock)
    shutdown_timeout_s: float = Field(default=30.0, ge=0.0)
    emulator: Block = Field(default_factory=EmulatorBlock)
    catalog: CatalogBlock | None = None
    outliers: Block = Field(default_factory=OutliersBlock)
    remediation: RemediationBlock = Field(default_factory=RemediationBlock)

    a_listen = field_validator("listen")(_a_listen)


retype(FleetFile, shared_state=SharedStateBlock | None, scrape=ScrapeBlock, health=HealthBlock,
       client=ClientBlock, emulator=EmulatorBlock, outliers=OutliersBlock)


# -- building ----------------------------------------------------------------------


def parse_node(raw: Any, where: str, catalog: Catalog = DEFAULT_CATALOG,
               warnings: list[str] | None = None) -> NodeConfig:
    """One ``nodes:`` entry (also the body of ``POST /admin/nodes``)."""
    return parse(NodeBlock, raw, where).config(where, catalog, warnings)


def _api_keys(doc: FleetFile) -> tuple[str, ...]:
    keys = list(doc.api_keys)
    if doc.api_keys_env is not None:
        value = os.environ.get(doc.api_keys_env, "")
        # An unset variable is a deployment mistake that would open the gateway.
        if not value.strip():
            raise ConfigError("api_keys_env",
                              f"environment variable {doc.api_keys_env} is unset or empty")
        keys.extend(k.strip() for k in value.split(",") if k.strip())
    return tuple(keys)


def parse_fleet(raw: Any, catalog: Catalog = DEFAULT_CATALOG,
                path: Path | None = None) -> FleetConfig:
    """Check a loaded fleet document and build its :class:`FleetConfig`."""
    doc = parse(FleetFile, raw, "")
    warnings: list[str] = []
    if doc.catalog is not None:
        catalog = extend_catalog(catalog, doc.catalog)
    nodes: list[NodeConfig] = []
    seen: set[str] = set()
    for i, item in enumerate(doc.nodes):
        node = item.config(f"nodes[{i}]", catalog, warnings)
        if node.id in seen:
            raise ConfigError(f"nodes[{i}].id", f"duplicate node id {node.id!r}")
        seen.add(node.id)
        nodes.append(node)
    served = {model for n in nodes for model in n.models}
    pools: dict[str, PoolSettings] = {}
    for name, block in doc.pools.items():
        pools[name] = block.settings(name, f"pools.{name}", catalog)
        if name not in served:
            warnings.append(f"pools.{name}: no node serves this model yet")
    return FleetConfig(
        listen=parse_listen(doc.listen),
        nodes=tuple(nodes),
        pools=pools,
        admin=AdminConfig(doc.admin.token_env, tuple(doc.admin.allow)),
        api_keys=_api_keys(doc),
        max_body_bytes=doc.max_body_bytes,
        scrape=doc.scrape.core(),
        health=doc.health.core(),
        reload_poll_s=doc.reload.poll_s,
        shutdown_timeout_s=doc.shutdown_timeout_s,
        emulator=doc.emulator.core(),
        catalog=catalog,
        path=path,
        warnings=tuple(warnings),
        outliers=doc.outliers.core(),
        remediation=doc.remediation.core(),
        discovery=doc.discovery.kubernetes.core() if doc.discovery is not None else None,
        shared_state=doc.shared_state.core() if doc.shared_state is not None else None,
        client=doc.client.core(),
    )


def load_fleet(path: str | Path, catalog: Catalog = DEFAULT_CATALOG) -> FleetConfig:
    """Read and check a fleet file; raises :class:`ConfigError` naming the field."""
    p = Path(path)
    raw = read_yaml(p, "fleet file")
    # A truncated or emptied file (an editor's save, ": > fleet.yaml") must not
    # become a fleet without nodes, admin API or listen address.
    if raw is None:
        raise ConfigError("", f"{p}: the fleet file is empty")
    if isinstance(raw, Mapping) and "nodes" not in raw and "discovery" not in raw:
        raise ConfigError("nodes", f"{p}: missing (write `nodes: []` for a fleet that starts "
                                   f"empty and is filled through the admin API or discovery)")
    return parse_fleet(raw, catalog, p.resolve())
