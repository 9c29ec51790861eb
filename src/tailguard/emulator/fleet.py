"""Which engines to emulate: :class:`EmulatedNode`, built from the gateway's fleet file.

One fleet file serves ``tailguard serve`` and ``tailguard emulate``. The
emulator takes every node whose ``url`` points at this machine (``127.0.0.1``,
``localhost``, ``::1``) and serves it on that URL's port; a local URL without a
port gets the next free one of ``--base-port``, ``--base-port + 1``, ... in
fleet order. Other nodes are real engines somewhere else and are skipped.

Node keys used: ``id``, ``url``, ``gpu`` (catalog aliases accepted), ``tp``,
``models`` (the served names; the first one the catalog knows, or the node's
``catalog_model``, picks the roofline model, else ``llama-3.1-8b``),
``engine`` (metrics dialect: vllm, sglang, trtllm, tgi), ``max_num_seqs``,
``max_num_batched_tokens``, ``speed`` (a per-unit slowness, e.g. 0.8) and a
``faults:`` schedule (see :mod:`tailguard.emulator.faults`).

The file is read with the gateway's loader (:func:`tailguard.gateway.config.load_fleet`),
so both commands accept and reject the same files; node objects are read by
attribute or key, which keeps this adapter independent of the loader's
classes.
"""

from __future__ import annotations

import importlib
import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from tailguard.core.hardware import DEFAULT_CATALOG, PerfModel
from tailguard.emulator.faults import FaultSpec, parse_fault
from tailguard.emulator.metrics import DIALECTS
from tailguard.engine import EngineConfig
from tailguard.errors import ConfigError

DEFAULT_CATALOG_MODEL = "llama-3.1-8b"
LOCAL_HOSTS = ("localhost",)


@dataclass(frozen=True, slots=True)
class EmulatedNode:
    """One emulated engine. ``port`` 0 picks a free port at start."""

    id: str
    gpu: str
    models: tuple[str, ...] = (DEFAULT_CATALOG_MODEL,)
    port: int = 0
    tp: int = 1
    catalog_model: str | None = None
    dialect: str = "vllm"
    engine: EngineConfig = field(default_factory=EngineConfig)
    speed: float = 1.0
    faults: tuple[FaultSpec, ...] = ()

    def perf(self) -> PerfModel:
        gpu = DEFAULT_CATALOG.gpu(self.gpu, f"node {self.id}: gpu")
        name = self.catalog_model
        if name is None:
            name = next((m for m in self.models if DEFAULT_CATALOG.find_model(m)),
                        DEFAULT_CATALOG_MODEL)
        model = DEFAULT_CATALOG.model(name, f"node {self.id}: catalog_model")
        return PerfModel(gpu, model, self.tp)


def _get(obj: Any, key: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(key, default)
    return getattr(obj, key, default)


def is_local(host: str | None) -> bool:
    if not host:
        return False
    if host.lower() in LOCAL_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def nodes_from_fleet(raw_nodes: Iterable[Any], base_port: int = 8100) -> list[EmulatedNode]:
    """Emulated nodes for the local entries of a fleet's node list (objects or mappings)."""
    out: list[EmulatedNode] = []
    taken: set[int] = set()
    unported: list[tuple[int, dict[str, Any]]] = []
    for i, n in enumerate(raw_nodes):
        where = f"nodes[{i}]"
        url = str(_get(n, "url", ""))
        parts = urlsplit(url)
        if not is_local(parts.hostname):
            continue
        node_id = str(_get(n, "id", f"node-{i}"))
        models = _get(n, "models") or [DEFAULT_CATALOG_MODEL]
        engine_kind = _get(n, "engine", "vllm")
        if not isinstance(engine_kind, str):  # a loader may give an object with a kind/name
            engine_kind = str(_get(engine_kind, "kind", _get(engine_kind, "name", "vllm")))
        if engine_kind not in DIALECTS:
            raise ConfigError(f"{where}.engine", f"no emulation for {engine_kind!r}", list(DIALECTS))
        cfg = EngineConfig()
        seqs = _get(n, "max_num_seqs")
        batched = _get(n, "max_num_batched_tokens")
        if seqs is not None or batched is not None:
            s = int(seqs) if seqs is not None else cfg.max_num_seqs
            b = int(batched) if batched is not None else max(cfg.max_num_batched_tokens, s)
            cfg = EngineConfig(max_num_seqs=s, max_num_batched_tokens=b)
        faults = tuple(parse_fault(f, f"{where}.faults[{j}]")
                       for j, f in enumerate(_get(n, "faults") or []))
        kwargs: dict[str, Any] = {
            "id": node_id, "gpu": str(_get(n, "gpu")), "models": tuple(str(m) for m in models),
            "tp": int(_get(n, "tp", 1) or 1), "catalog_model": _get(n, "catalog_model"),
            "dialect": engine_kind, "engine": cfg, "speed": float(_get(n, "speed", 1.0) or 1.0),
            "faults": faults,
        }
        node = EmulatedNode(**kwargs)
        node.perf()  # fail now, with the node named, on an unknown GPU or model
        try:
            port = parts.port
        except ValueError as exc:
            raise ConfigError(f"{where}.url", f"bad port in {url!r}") from exc
        if port is None:
            unported.append((len(out), kwargs))
        else:
            if port in taken:
                raise ConfigError(f"{where}.url", f"port {port} is used by another local node")
            taken.add(port)
            node = EmulatedNode(**{**kwargs, "port": port})
        out.append(node)
    port = base_port
    for idx, kwargs in unported:
        while port in taken:
            port += 1
        taken.add(port)
        out[idx] = EmulatedNode(**{**kwargs, "port": port})
    return out


def load_emulated_nodes(path: str | Path, base_port: int = 8100) -> list[EmulatedNode]:
    """Read a fleet file with the gateway's loader and keep its local nodes."""
    raw_nodes: Any
    try:
        # imported by name: the gateway package is optional for the emulator's users
        gateway_config: Any = importlib.import_module("tailguard.gateway.config")
    except ModuleNotFoundError:
        gateway_config = None
    if gateway_config is not None:
        raw_nodes = _get(gateway_config.load_fleet(path), "nodes")
    else:
        try:
            doc = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError("fleet", f"cannot read {path}: {exc}") from exc
        raw_nodes = _get(doc, "nodes") if isinstance(doc, Mapping) else None
        if not isinstance(raw_nodes, list):
            raise ConfigError("nodes", "must be a list of nodes")
    nodes = nodes_from_fleet(raw_nodes or [], base_port)
    if not nodes:
        raise ConfigError("nodes", "no node has a url on 127.0.0.1/localhost to emulate")
    return nodes
