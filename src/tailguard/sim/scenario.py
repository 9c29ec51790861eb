"""Scenario files: what fleet, what workload, which faults, which policies.

A scenario is YAML (see README "Scenario format")::

    name: mixed
    seed: 7
    model: llama-3.1-8b
    slo: {ttft_s: 2.0, tpot_s: 0.10}
    network_rtt_s: 0.001
    fleet:
      - {gpu: H100-SXM, count: 2}
      - {gpu: A100-80GB, count: 4, tp: 1, engine: {max_num_seqs: 128, max_num_batched_tokens: 4096}}
      - {gpu: A100-80GB, tp: 2, pp: 2, split: even}         # pipeline of two TP-2 stages
      - {stages: [{gpu: H100-SXM}, {gpu: A100-80GB}], split: speed, overlap: true}
    workload: {duration_s: 600, warmup_s: 60, arrival: {process: poisson, load: 0.8}, ...}
    faults:
      - {node: "L4#3", kind: throttle, factor: 0.4, at_s: 120, duration_s: 300}
      - {node: "A100-80GB#0", kind: throttle, factor: 0.5, gpu_index: 2}  # one GPU of a tp: 4 replica
    policies: [round_robin, least_request, seed_weighted, tailguard]

Every value is checked; an error names the field and the allowed values and
is raised as :class:`tailguard.errors.ConfigError`. Node ids are ``GPU#i``,
numbered per GPU type from 0 in fleet order; a pipeline's are its layout's
name (``A100-80GB-PP2#0``, ``H100-SXM+A100-80GB#0``: core/pipeline.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, field_validator

from tailguard.config import Block, block_for, parse
from tailguard.config.catalog import CatalogBlock, extend_catalog
from tailguard.config.core_options import LinkBlock, ReplicaShape, SloBlock, kv_link
from tailguard.config.faults import FaultBlock, FaultSpec
from tailguard.config.files import read_yaml
from tailguard.config.options import (
    AdmissionBlock,
    HedgingBlock,
    LimitsBlock,
    MigrationBlock,
    OutliersBlock,
    parse_policy_options,
)
from tailguard.config.parse import retype
from tailguard.core.admission import AdmissionConfig
from tailguard.core.hardware import DEFAULT_CATALOG, Catalog, Model, PerfModel
from tailguard.core.hedging import HedgeConfig
from tailguard.core.kv_transfer import DEFAULT_LINK, Link, PairLink
from tailguard.core.limits import LimitConfig
from tailguard.core.migration import MigrationConfig
from tailguard.core.outliers import OutlierConfig
from tailguard.core.pipeline import Layout, PipelinePerf
from tailguard.core.policies import Slo, policy_names
from tailguard.engine import EngineConfig
from tailguard.errors import ConfigError
from tailguard.traffic.workload import WorkloadSpec, parse_workload


@dataclass(frozen=True, slots=True)
class FleetGroup:
    gpu: str  # the GPU, or the pipeline layout's name
    count: int
    tp: int
    engine: EngineConfig
    speed_spread: float = 0.0
    layout: Layout | None = None  # a pipeline-parallel replica's stages
    role: str = "both"  # disaggregated serving (NodeSpec.role)
    kv_link: Link | None = None  # its own KV path, over the scenario's

    @property
    def gpus(self) -> int:
        """GPUs per replica."""
        return self.layout.gpus if self.layout is not None else self.tp

    def perf(self, catalog: Catalog, model: Model) -> PerfModel:
        if self.layout is not None:
            first = self.layout.stages[0]
            return PipelinePerf(first.gpu, model, first.tp, layout=self.layout)
        return PerfModel(catalog.gpu(self.gpu), model, self.tp)


@dataclass(frozen=True, slots=True)
class NodePlan:
    """One simulated node: its id, hardware, engine settings and base speed."""

    id: str
    group: int
    perf: PerfModel
    engine: EngineConfig
    speed: float = 1.0
    role: str = "both"
    kv_link: Link | None = None


@dataclass(frozen=True, slots=True)
class PolicyChoice:
    name: str
    options: Any = None  # the policy's options dataclass (None: its defaults)

    @property
    def label(self) -> str:
        """The name, with the options that differ from the policy's defaults."""
        if self.options is None:
            return self.name
        given = {f.name: getattr(self.options, f.name) for f in fields(self.options)}
        default = {f.name: getattr(type(self.options)(), f.name) for f in fields(self.options)}
        opts = ",".join(f"{k}={v}" for k, v in sorted(given.items()) if v != default[k])
        return f"{self.name}[{opts}]" if opts else self.name


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    seed: int
    model: str
    slo: Slo
    network_rtt_s: float
    fleet: tuple[FleetGroup, ...]
    workload: WorkloadSpec
    faults: tuple[FaultSpec, ...]  # each names its node
    policies: tuple[PolicyChoice, ...]
    catalog: Catalog = DEFAULT_CATALOG
    outliers: OutlierConfig = field(default_factory=OutlierConfig)  # straggler detection
    limits: LimitConfig | None = None  # per-node concurrency limits (None: none)
    admission: AdmissionConfig | None = None  # the gateway queue (None: none)
    hedging: HedgeConfig = field(default_factory=HedgeConfig)  # hedged requests (off)
    migration: MigrationConfig = field(default_factory=MigrationConfig)  # streams that move (on)
    # The nodes export DCGM-like GPU readings: a slow node's events name the
    # throttled GPU (or say its GPUs are healthy), as the gateway's do.
    gpu_telemetry: bool = False
    kv_link: Link = DEFAULT_LINK  # between two nodes with none of their own
    kv_pairs: tuple[PairLink, ...] = ()  # pairs with a link of their own

    def nodes(self) -> list[NodePlan]:
        """The fleet expanded to nodes with ids ``GPU#i``; speeds drawn from the seed."""
        import random

        rng = random.Random(f"{self.seed}:speed")
        counters: dict[str, int] = {}
        out: list[NodePlan] = []
        model = self.catalog.model(self.model)
        for gi, g in enumerate(self.fleet):
            perf = g.perf(self.catalog, model)
            for _ in range(g.count):
                i = counters.get(g.gpu, 0)
                counters[g.gpu] = i + 1
                speed = 1.0
                if g.speed_spread > 0:
                    speed = 1.0 + rng.uniform(-g.speed_spread, g.speed_spread)
                out.append(NodePlan(f"{g.gpu}#{i}", gi, perf, g.engine, speed, g.role,
                                    g.kv_link))
        return out


EngineBlock = block_for(EngineConfig)


class FleetEntry(ReplicaShape):
    """One ``fleet:`` entry: ``count`` replicas of one shape."""

    count: int = Field(default=1, ge=1)
    engine: Block = Field(default_factory=EngineBlock)
    speed_spread: float = Field(default=0.0, ge=0.0, lt=1.0)  # 0.1: speeds +-10%

    def group(self, where: str, catalog: Catalog, model: Model) -> FleetGroup:
        layout = self.layout(catalog, where)
        if layout is not None:
            name, tp = layout.name, layout.stages[0].tp
        else:
            name, tp = self.gpu_of(catalog, where).name, self.tp
        try:
            engine = self.engine.core()
        except ConfigError as exc:
            raise ConfigError(f"{where}.engine.{exc.field}", exc.message) from None
        group = FleetGroup(name, self.count, tp, engine, self.speed_spread, layout, self.role,
                           kv_link(self.kv_link, f"{where}.kv_link"))
        try:
            perf = group.perf(catalog, model)
        except ConfigError as exc:
            raise ConfigError(f"{where}.{exc.field}", exc.message) from None
        if not perf.fits:
            raise ConfigError(
                f"{where}.gpu" if layout is None else f"{where}.stages",
                f"{model.name} does not fit on {group.gpus} x {name}: it needs about "
                f"{perf.memory_needed_gb:.0f} GB per GPU; raise tp or pp, or pick larger GPUs",
            )
        return group


retype(FleetEntry, engine=EngineBlock)

# A policy by name, or {name: ..., its options...}.
PolicyEntry = Annotated[str, Field(min_length=1)] | dict[str, Any]


def _policy(item: str | dict[str, Any], where: str) -> PolicyChoice:
    if isinstance(item, str):
        name, options = item, {}
    else:
        if not isinstance(item.get("name"), str):
            raise ConfigError(where, "must be a policy name or {name: ..., options}",
                              policy_names())
        name, options = item["name"], {k: v for k, v in item.items() if k != "name"}
    if name not in policy_names():
        raise ConfigError(where, f"unknown policy {name!r}", policy_names())
    return PolicyChoice(name, parse_policy_options(name, options, where))


def parse_policies(raw: Any, where: str = "policies") -> tuple[PolicyChoice, ...]:
    """A ``policies:`` list, or a comma-separated string of names (``--policies``)."""
    if raw is None:
        return (PolicyChoice("tailguard"),)
    if isinstance(raw, str):
        raw = [p.strip() for p in raw.split(",") if p.strip()]
    if not isinstance(raw, list) or not raw:
        raise ConfigError(where, "must be a non-empty list of policy names", policy_names())
    return tuple(_policy(item, f"{where}[{i}]") for i, item in enumerate(raw))


class PairBlock(Block):
    """Two nodes' own KV link (``kv_pairs``): ``{nodes: [A, B], link: nvlink}``."""

    nodes: list[str] = Field(min_length=2, max_length=2)
    link: str | LinkBlock


class ScenarioFile(Block):
    """A whole scenario (``tailguard schema scenario`` prints its JSON Schema)."""

    name: str = "scenario"
    seed: int = 0
    model: str = Field(min_length=1)
    slo: Block = Field(default_factory=SloBlock)
    network_rtt_s: float = Field(default=0.0, ge=0.0)
    fleet: list[FleetEntry] = Field(min_length=1)
    workload: dict[str, Any]  # tailguard.traffic.workload
    faults: list[FaultBlock] = Field(default_factory=list)
    policies: list[PolicyEntry] | None = Field(default=None, min_length=1)
    catalog: CatalogBlock | None = None
    prices: dict[str, Annotated[float, Field(gt=0.0)]] | None = None
    gpu_telemetry: bool = False
    outliers: Block = Field(default_factory=OutliersBlock)
    limits: Block | None = None
    admission: Block | None = None
    hedging: Block = Field(default_factory=HedgingBlock)
    migration: Block = Field(default_factory=MigrationBlock)
    kv_link: str | LinkBlock | None = None  # disaggregated serving's default KV path
    kv_pairs: list[PairBlock] = Field(default_factory=list)

    @field_validator("faults")
    @classmethod
    def _simulated(cls, faults: list[FaultBlock]) -> list[FaultBlock]:
        for f in faults:
            if f.node is None:
                raise ValueError("each fault names its node")
            if f.kind == "hang":
                raise ValueError("the simulator models no request timeouts, so no hang: "
                                 "use crash")
            if f.jitter_s:
                raise ValueError("the simulator's links have a fixed delay: leave out "
                                 "jitter_s")
        return faults


retype(ScenarioFile, slo=SloBlock, outliers=OutliersBlock, limits=LimitsBlock | None,
       admission=AdmissionBlock | None, hedging=HedgingBlock, migration=MigrationBlock)


def _pairs(doc: ScenarioFile, planned: list[NodePlan]) -> tuple[PairLink, ...]:
    ids = {n.id for n in planned}
    out = []
    for i, block in enumerate(doc.kv_pairs):
        for j, node in enumerate(block.nodes):
            if node not in ids:
                raise ConfigError(f"kv_pairs[{i}].nodes[{j}]", f"unknown node {node!r}",
                                  sorted(ids)[:40])
        link = kv_link(block.link, f"kv_pairs[{i}].link")
        assert link is not None
        out.append(PairLink(block.nodes[0], block.nodes[1], link))
    return tuple(out)


def _faults(doc: ScenarioFile, planned: list[NodePlan]) -> tuple[FaultSpec, ...]:
    ids = [n.id for n in planned]
    gpus = {n.id: n.perf.gpus for n in planned}
    out = []
    for i, block in enumerate(doc.faults):
        w = f"faults[{i}]"
        if block.node not in gpus:
            shown = ids if len(ids) <= 40 else [*ids[:40], "..."]
            raise ConfigError(f"{w}.node", f"unknown node {block.node!r}", shown)
        if block.gpu_index is not None and block.gpu_index >= gpus[block.node]:
            raise ConfigError(f"{w}.gpu_index",
                              f"must be a GPU of the node: 0..{gpus[block.node] - 1}")
        out.append(block.core())
    return tuple(out)


def parse_scenario(raw: Any, base_dir: Path | None = None,
                   catalog: Catalog = DEFAULT_CATALOG) -> Scenario:
    doc = parse(ScenarioFile, raw, "")
    if doc.catalog is not None:
        catalog = extend_catalog(catalog, doc.catalog)
    if doc.prices is not None:
        catalog = catalog.with_prices(doc.prices)
    model = catalog.model(doc.model, "model")
    groups = tuple(entry.group(f"fleet[{i}]", catalog, model)
                   for i, entry in enumerate(doc.fleet))
    workload = parse_workload(doc.workload, "workload", base_dir)
    policies = parse_policies(doc.policies)
    scenario = Scenario(doc.name, doc.seed, model.name, doc.slo.core(), doc.network_rtt_s,
                        groups, workload, (), policies, catalog,
                        doc.outliers.core(),
                        limits=doc.limits.core() if doc.limits is not None else None,
                        admission=doc.admission.core() if doc.admission is not None else None,
                        hedging=doc.hedging.core(), migration=doc.migration.core(),
                        gpu_telemetry=doc.gpu_telemetry,
                        kv_link=kv_link(doc.kv_link, "kv_link") or DEFAULT_LINK)
    planned = scenario.nodes()
    return replace(scenario, faults=_faults(doc, planned), kv_pairs=_pairs(doc, planned))


def load_scenario(path: str | Path) -> Scenario:
    p = Path(path)
    return parse_scenario(read_yaml(p, "scenario"), p.parent)
