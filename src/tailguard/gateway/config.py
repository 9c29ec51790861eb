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

The parsed form is frozen dataclasses (:mod:`tailguard.gateway.settings`,
re-exported here): a reload builds a new :class:`FleetConfig` and the gateway
diffs it against the running one.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import field_validator
from yarl import URL

from tailguard.config import block_for, parse_core
from tailguard.config.catalog import extend_catalog
from tailguard.config.options import (
    AdmissionBlock,
    HedgingBlock,
    LimitsBlock,
    OutliersBlock,
    RetriesBlock,
)
from tailguard.config_file import check_keys, integer, number, read_yaml, require_mapping
from tailguard.core.balancer import PoolConfig
from tailguard.core.fleet import NodeSpec
from tailguard.core.hardware import DEFAULT_CATALOG, Catalog
from tailguard.core.policies import DEFAULT_POLICY, make_policy, policy_names
from tailguard.core_options import parse_layout, parse_slo
from tailguard.errors import ConfigError
from tailguard.gateway.discovery_config import parse_discovery
from tailguard.gateway.settings import (
    DEFAULT_LISTEN as DEFAULT_LISTEN,
    DEFAULT_MAX_BODY_BYTES as DEFAULT_MAX_BODY_BYTES,
    ENGINES as ENGINES,
    FLEET_KEYS as FLEET_KEYS,
    NODE_KEYS as NODE_KEYS,
    POOL_KEYS as POOL_KEYS,
    AdminConfig as AdminConfig,
    ClientSettings as ClientSettings,
    FleetConfig as FleetConfig,
    HealthSettings as HealthSettings,
    NodeConfig as NodeConfig,
    PoolSettings as PoolSettings,
    ScrapeSettings as ScrapeSettings,
    Timeouts as Timeouts,
)
from tailguard.gateway.shared_state_config import parse_shared_state
from tailguard.remediation.config import parse_remediation

# -- value checks ------------------------------------------------------------------


def _string(raw: Mapping[str, Any], key: str, where: str, default: str | None = None) -> str:
    value = raw.get(key)
    name = f"{where}.{key}" if where else key
    if value is None:
        if default is None:
            raise ConfigError(name, "is required")
        return default
    if not isinstance(value, str) or not value:
        raise ConfigError(name, f"must be a non-empty string, got {value!r}")
    return value


def _path(raw: Mapping[str, Any], key: str, where: str, default: str) -> str:
    value = _string(raw, key, where, default)
    if not value.startswith("/"):
        raise ConfigError(f"{where}.{key}", f"must start with '/', got {value!r}")
    return value


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


def _a_path(path: str) -> str:
    if not path.startswith("/"):
        raise ValueError(f"must start with '/', got {path!r}")
    return path


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


def parse_timeouts(raw: Any, where: str) -> Timeouts:
    timeouts: Timeouts = parse_core(TimeoutsBlock, raw, where)
    return timeouts


def parse_pool(name: str, raw: Any, where: str, catalog: Catalog = DEFAULT_CATALOG) -> PoolSettings:
    m = require_mapping(raw if raw is not None else {}, where)
    check_keys(m, POOL_KEYS, where, extensions=True)
    policy = _string(m, "policy", where, DEFAULT_POLICY)
    if policy not in policy_names():
        raise ConfigError(f"{where}.policy", f"unknown policy {policy!r}", policy_names())
    options = dict(require_mapping(m.get("policy_options") or {}, f"{where}.policy_options"))
    slo = parse_slo(m.get("slo"), f"{where}.slo")
    # Build the policy once so a bad option fails at load, not on the first request.
    make_policy(policy, slo, options, field=f"{where}.policy_options")
    catalog_model = m.get("catalog_model")
    if catalog_model is not None:
        catalog_model = _string(m, "catalog_model", where)
        if catalog.find_model(catalog_model) is None:
            raise ConfigError(f"{where}.catalog_model", f"unknown model {catalog_model!r}",
                              [x.name for x in catalog.models])
    core = PoolConfig(name, policy, options, slo, catalog_model,
                      limits=parse_core(LimitsBlock, m.get("limits"), f"{where}.limits",
                                        optional=True),
                      admission=parse_core(AdmissionBlock, m.get("admission"),
                                           f"{where}.admission", optional=True),
                      retries=parse_core(RetriesBlock, m.get("retries"), f"{where}.retries"),
                      hedging=parse_core(HedgingBlock, m.get("hedging"), f"{where}.hedging"))
    return PoolSettings(core, parse_timeouts(m.get("timeouts"), f"{where}.timeouts"))


def parse_node(raw: Any, where: str, catalog: Catalog = DEFAULT_CATALOG,
               warnings: list[str] | None = None) -> NodeConfig:
    """One ``nodes:`` entry (also the body of ``POST /admin/nodes``)."""
    m = require_mapping(raw, where)
    check_keys(m, NODE_KEYS, where, extensions=True)
    node_id = m.get("id")
    if isinstance(node_id, int) and not isinstance(node_id, bool):
        node_id = str(node_id)
    if not isinstance(node_id, str) or not node_id or any(c.isspace() for c in node_id):
        raise ConfigError(f"{where}.id", f"must be a non-empty string without spaces, got {node_id!r}")
    url = parse_url(m.get("url"), f"{where}.url")
    layout = parse_layout(m, where, catalog)
    gpu = layout.name if layout is not None else m.get("gpu")
    if not isinstance(gpu, str) or not gpu:
        raise ConfigError(f"{where}.gpu", "is required (a GPU name such as H100, A100, L4)",
                          [g.name for g in catalog.gpus])
    gpu_spec = catalog.find_gpu(gpu) if layout is None else layout.stages[0].gpu
    if gpu_spec is None and warnings is not None:
        warnings.append(f"{where}.gpu: unknown GPU {gpu!r}; its capacity will be learned from "
                        "measurements (known: " + ", ".join(g.name for g in catalog.gpus) + ")")
    models_raw = m.get("models")
    if isinstance(models_raw, str):
        models_raw = [models_raw]
    if (not isinstance(models_raw, list) or not models_raw
            or not all(isinstance(x, str) and x for x in models_raw)):
        raise ConfigError(f"{where}.models", "must be a non-empty list of served model names")
    if len(set(models_raw)) != len(models_raw):
        raise ConfigError(f"{where}.models", "names a model twice")
    engine = m.get("engine")
    if engine is not None and engine not in ENGINES:
        raise ConfigError(f"{where}.engine", f"unknown engine {engine!r}", [*ENGINES, "(omit: detect)"])
    labels = require_mapping(m.get("labels") or {}, f"{where}.labels")
    weight = m.get("weight")
    if weight is not None:
        weight = number(m, "weight", where, 1.0)
    api_key_env = m.get("api_key_env")
    if api_key_env is not None:
        api_key_env = _string(m, "api_key_env", where)
    faults_raw = m.get("faults") or []
    if not isinstance(faults_raw, list):
        raise ConfigError(f"{where}.faults", "must be a list of {kind, at_s, duration_s, ...}")
    faults = tuple(require_mapping(f, f"{where}.faults[{i}]") for i, f in enumerate(faults_raw))
    for i, f in enumerate(faults):
        if not isinstance(f.get("kind"), str):
            raise ConfigError(f"{where}.faults[{i}].kind", "is required")
    emulator = require_mapping(m.get("emulator") or {}, f"{where}.emulator")
    dcgm_url = m.get("dcgm_url")
    if dcgm_url is not None:
        dcgm_url = parse_url(dcgm_url, f"{where}.dcgm_url")
    spec = NodeSpec(
        id=node_id, gpu=gpu_spec, gpu_name=gpu, models=tuple(models_raw),
        tp=integer(m, "tp", where, 1) if layout is None else layout.stages[0].tp,
        labels={str(k): str(v) for k, v in labels.items()}, weight=weight, url=url,
        max_num_seqs=integer(m, "max_num_seqs", where, 256), layout=layout)
    return NodeConfig(spec, engine=engine, api_key_env=api_key_env, dcgm_url=dcgm_url,
                      faults=faults, emulator=dict(emulator))


def _parse_api_keys(m: Mapping[str, Any]) -> tuple[str, ...]:
    keys: list[str] = []
    raw = m.get("api_keys")
    if raw is not None:
        if not isinstance(raw, list) or not all(isinstance(k, str) and k for k in raw):
            raise ConfigError("api_keys", "must be a list of non-empty strings")
        keys.extend(raw)
    env = m.get("api_keys_env")
    if env is not None:
        name = _string(m, "api_keys_env", "")
        value = os.environ.get(name, "")
        # An unset variable is a deployment mistake that would open the gateway.
        if not value.strip():
            raise ConfigError("api_keys_env", f"environment variable {name} is unset or empty")
        keys.extend(k.strip() for k in value.split(",") if k.strip())
    return tuple(keys)


def parse_admin(raw: Any) -> AdminConfig:
    if raw is None:
        return AdminConfig()
    m = require_mapping(raw, "admin")
    check_keys(m, ("token_env", "allow"), "admin", extensions=True)
    token_env = m.get("token_env")
    if token_env is not None:
        token_env = _string(m, "token_env", "admin")
    allow_raw = m.get("allow") or []
    if isinstance(allow_raw, str):
        allow_raw = [allow_raw]
    if not isinstance(allow_raw, list):
        raise ConfigError("admin.allow", "must be a list of hosts or CIDR networks")
    allow: list[str] = []
    for i, entry in enumerate(allow_raw):
        if not isinstance(entry, str) or not entry:
            raise ConfigError(f"admin.allow[{i}]", f"must be a host or CIDR, got {entry!r}")
        if "/" in entry:
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError as exc:
                raise ConfigError(f"admin.allow[{i}]", f"not a valid network: {entry!r}") from exc
        allow.append(entry)
    return AdminConfig(token_env, tuple(allow))


def parse_fleet(raw: Any, catalog: Catalog = DEFAULT_CATALOG,
                path: Path | None = None) -> FleetConfig:
    """Check a loaded fleet document and build its :class:`FleetConfig`."""
    m = require_mapping(raw if raw is not None else {}, "fleet")
    check_keys(m, FLEET_KEYS, "", extensions=True)
    warnings: list[str] = []
    if "catalog" in m:
        catalog = extend_catalog(catalog, m["catalog"])
    nodes_raw = m.get("nodes")
    if nodes_raw is None:
        nodes_raw = []
    if not isinstance(nodes_raw, list):
        raise ConfigError("nodes", "must be a list of {id, url, gpu, models}")
    nodes: list[NodeConfig] = []
    seen: set[str] = set()
    for i, item in enumerate(nodes_raw):
        node = parse_node(item, f"nodes[{i}]", catalog, warnings)
        if node.id in seen:
            raise ConfigError(f"nodes[{i}].id", f"duplicate node id {node.id!r}")
        seen.add(node.id)
        nodes.append(node)
    pools_raw = require_mapping(m.get("pools") or {}, "pools")
    served = {model for n in nodes for model in n.models}
    pools: dict[str, PoolSettings] = {}
    for name, body in pools_raw.items():
        pools[str(name)] = parse_pool(str(name), body, f"pools.{name}", catalog)
        if name not in served:
            warnings.append(f"pools.{name}: no node serves this model yet")
    reload_raw = require_mapping(m.get("reload") or {}, "reload")
    check_keys(reload_raw, ("poll_s",), "reload", extensions=True)
    return FleetConfig(
        listen=parse_listen(m.get("listen")),
        nodes=tuple(nodes),
        pools=pools,
        admin=parse_admin(m.get("admin")),
        api_keys=_parse_api_keys(m),
        max_body_bytes=integer(m, "max_body_bytes", "", DEFAULT_MAX_BODY_BYTES),
        scrape=parse_core(ScrapeBlock, m.get("scrape"), "scrape"),
        health=parse_core(HealthBlock, m.get("health"), "health"),
        reload_poll_s=number(reload_raw, "poll_s", "reload", 1.0, positive=False, minimum=0.0),
        shutdown_timeout_s=number(m, "shutdown_timeout_s", "", 30.0, positive=False, minimum=0.0),
        emulator=dict(require_mapping(m.get("emulator") or {}, "emulator")),
        catalog=catalog,
        path=path,
        warnings=tuple(warnings),
        outliers=parse_core(OutliersBlock, m.get("outliers"), "outliers"),
        remediation=parse_remediation(m.get("remediation")),
        discovery=parse_discovery(m.get("discovery")),
        shared_state=parse_shared_state(m.get("shared_state")),
        client=parse_core(ClientBlock, m.get("client"), "client"),
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
