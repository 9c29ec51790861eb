"""Which engines to emulate: :class:`EmulatedNode`, built from the gateway's fleet file.

One fleet file serves ``tailguard serve`` and ``tailguard emulate``, read by
the same loader (:func:`tailguard.config.fleet.load_fleet`), so both accept
and reject the same files. The emulator takes every node whose ``url`` points
at this machine (``127.0.0.1``, ``localhost``, ``::1``) and serves it on that
URL's port; a local URL without a port gets the next free one of
``--base-port``, ``--base-port + 1``, ... in fleet order. Other nodes are real
engines elsewhere and are skipped.

From each node: ``id``, ``gpu`` (catalog aliases accepted; the emulator needs
a GPU the catalog knows), ``tp``, ``models`` (the served names),
``engine`` (metrics dialect; none means vLLM), ``max_num_seqs``, ``faults``
(see :mod:`tailguard.emulator.faults`) and an optional ``emulator:`` mapping:

=========================== ====================================================
``speed``                   this unit's speed, 1.0 nominal (0.8: a slow unit)
``catalog_model``           the catalog model to time (default: the pool's
                            ``catalog_model``, else the first served name the
                            catalog knows, else ``llama-3.1-8b``)
``max_num_batched_tokens``  engine token budget per step (vLLM's flag)
``enable_chunked_prefill``  as vLLM's flag (default true)
``kv_capacity_tokens``      override the KV cache size the roofline derives
``block_size``              KV block size (default 16)
``enable_prefix_caching``   as vLLM's flag (default true)
``long_prefill_token_threshold``  as vLLM's flag: the most prompt tokens one
                            request computes in a step, so short prompts pass a
                            long one (default 0: no cap)
=========================== ====================================================

The fleet's top-level ``emulator:`` mapping gives defaults for those keys.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import urlsplit

from tailguard.config.faults import FaultSpec
from tailguard.config.fleet import FleetConfig, NodeConfig, load_fleet
from tailguard.core.hardware import DEFAULT_CATALOG, PerfModel
from tailguard.emulator.metrics import DIALECTS
from tailguard.engine import EngineConfig
from tailguard.errors import ConfigError

DEFAULT_CATALOG_MODEL = "llama-3.1-8b"


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


def is_local(host: str | None) -> bool:
    if not host:
        return False
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def emulated_node(n: NodeConfig, where: str, fleet: FleetConfig | None = None,
                  port: int = 0) -> EmulatedNode:
    """The emulation of one fleet node (any URL; the caller picks the local ones)."""
    if n.layout is not None:
        raise ConfigError(f"{where}.stages" if len({s.gpu for s in n.layout.stages}) > 1
                          else f"{where}.pp", "the emulator does not emulate pipeline-parallel "
                          "replicas yet (tailguard sim does; the gateway routes to real ones)")
    opts = n.emulator.over(fleet.emulator) if fleet is not None else n.emulator
    catalog_model = opts.catalog_model
    if catalog_model is None and fleet is not None:
        catalog_model = next((fleet.pool(m).catalog_model for m in n.models
                              if fleet.pool(m).catalog_model), None)
    dialect = n.engine or "vllm"
    if dialect not in DIALECTS:
        raise ConfigError(f"{where}.engine", f"no emulation for {dialect!r}", list(DIALECTS))
    base = EngineConfig()
    batched = opts.max_num_batched_tokens
    try:
        cfg = EngineConfig(
            max_num_seqs=n.max_num_seqs,
            max_num_batched_tokens=batched if batched is not None
            else max(base.max_num_batched_tokens, n.max_num_seqs),
            enable_chunked_prefill=opts.enable_chunked_prefill is not False,
            kv_capacity_tokens=opts.kv_capacity_tokens,
            block_size=opts.block_size or base.block_size,
            enable_prefix_caching=opts.enable_prefix_caching is not False,
            long_prefill_token_threshold=opts.long_prefill_token_threshold or 0,
        )
    except ConfigError as exc:
        raise ConfigError(f"{where}.emulator.{exc.field}", str(exc).split(": ", 1)[-1]) from exc
    node = EmulatedNode(id=n.id, gpu=n.gpu, models=n.models, port=port, tp=n.tp,
                        catalog_model=catalog_model, dialect=dialect, engine=cfg,
                        speed=opts.speed or 1.0, faults=n.faults)
    if DEFAULT_CATALOG.find_gpu(n.gpu) is None:
        raise ConfigError(f"{where}.gpu", f"the emulator needs a catalog GPU, got {n.gpu!r}",
                          [g.name for g in DEFAULT_CATALOG.gpus])
    node.perf()  # fail now, with the node named, on an unknown catalog model
    return node


def nodes_from_fleet(fleet: FleetConfig, base_port: int = 8100) -> list[EmulatedNode]:
    """Emulated nodes for the local entries of a fleet (see the module docstring)."""
    out: list[EmulatedNode] = []
    taken: set[int] = set()
    unported: list[int] = []
    for i, n in enumerate(fleet.nodes):
        where = f"nodes[{i}]"
        url = _split(n.url)
        if url is None or not is_local(url[0]):
            continue
        port = url[1]
        if port is not None:
            if port in taken:
                raise ConfigError(f"{where}.url", f"port {port} is used by another local node")
            taken.add(port)
        else:
            unported.append(len(out))
        out.append(emulated_node(n, where, fleet, port or 0))
    port = base_port
    for idx in unported:
        while port in taken:
            port += 1
        taken.add(port)
        out[idx] = replace(out[idx], port=port)
    return out


def _split(url: str) -> tuple[str, int | None] | None:
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        return None
    if parts.hostname is None:
        return None
    # the URL's explicit port only: a default port (80) is not an engine's port
    explicit = port if port is not None and f":{port}" in parts.netloc else None
    return parts.hostname, explicit


def load_emulated_nodes(path: str | Path, base_port: int = 8100) -> list[EmulatedNode]:
    """Read a fleet file with the gateway's loader and keep its local nodes."""
    nodes = nodes_from_fleet(load_fleet(path), base_port)
    if not nodes:
        raise ConfigError("nodes", "no node has a url on 127.0.0.1/localhost to emulate")
    return nodes
