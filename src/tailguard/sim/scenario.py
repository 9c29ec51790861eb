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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tailguard.config import parse_core
from tailguard.config.catalog import extend_catalog
from tailguard.config.options import AdmissionBlock, HedgingBlock, LimitsBlock, OutliersBlock
from tailguard.config_file import check_keys, integer, number, read_yaml, require_mapping
from tailguard.core.admission import AdmissionConfig
from tailguard.core.hardware import DEFAULT_CATALOG, Catalog, Model, PerfModel
from tailguard.core.hedging import HedgeConfig
from tailguard.core.limits import LimitConfig
from tailguard.core.outliers import OutlierConfig
from tailguard.core.pipeline import Layout, PipelinePerf
from tailguard.core.policies import Slo, policy_names
from tailguard.core_options import PIPELINE_KEYS, parse_layout, parse_slo
from tailguard.engine import EngineConfig
from tailguard.errors import ConfigError
from tailguard.sim.workload import WorkloadSpec, parse_workload

FAULT_KINDS = ("throttle", "stall", "crash", "error_rate", "slow_network")


@dataclass(frozen=True, slots=True)
class FleetGroup:
    gpu: str  # the GPU, or the pipeline layout's name
    count: int
    tp: int
    engine: EngineConfig
    speed_spread: float = 0.0
    layout: Layout | None = None  # a pipeline-parallel replica's stages

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


@dataclass(frozen=True, slots=True)
class Fault:
    node: str
    kind: str
    at_s: float
    duration_s: float | None = None
    factor: float = 1.0  # throttle: speed factor
    rate: float = 0.0  # error_rate: share of requests failed
    period_s: float = 10.0  # stall: a pause every period
    pause_s: float = 1.0  # stall: length of each pause
    delay_s: float = 0.0  # slow_network: one-way delay added
    # throttle: one GPU of a TP replica (None: the whole replica). The replica
    # steps at its slowest rank's pace, so one rank at ``factor`` slows it all.
    gpu_index: int | None = None


@dataclass(frozen=True, slots=True)
class PolicyChoice:
    name: str
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        if not self.options:
            return self.name
        opts = ",".join(f"{k}={v}" for k, v in sorted(self.options.items()))
        return f"{self.name}[{opts}]"


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    seed: int
    model: str
    slo: Slo
    network_rtt_s: float
    fleet: tuple[FleetGroup, ...]
    workload: WorkloadSpec
    faults: tuple[Fault, ...]
    policies: tuple[PolicyChoice, ...]
    catalog: Catalog = DEFAULT_CATALOG
    outliers: OutlierConfig = field(default_factory=OutlierConfig)  # straggler detection
    limits: LimitConfig | None = None  # per-node concurrency limits (None: none)
    admission: AdmissionConfig | None = None  # the gateway queue (None: none)
    hedging: HedgeConfig = field(default_factory=HedgeConfig)  # hedged requests (off)
    # The nodes export DCGM-like GPU readings: a slow node's events name the
    # throttled GPU (or say its GPUs are healthy), as the gateway's do.
    gpu_telemetry: bool = False

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
                out.append(NodePlan(f"{g.gpu}#{i}", gi, perf, g.engine, speed))
        return out


def parse_engine(raw: Any, where: str) -> EngineConfig:
    if raw is None:
        return EngineConfig()
    m = require_mapping(raw, where)
    check_keys(m, ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill",
                    "kv_capacity_tokens", "block_size", "enable_prefix_caching"), where)
    base = EngineConfig()
    flags = {}
    for flag in ("enable_chunked_prefill", "enable_prefix_caching"):
        flags[flag] = m.get(flag, getattr(base, flag))
        if not isinstance(flags[flag], bool):
            raise ConfigError(f"{where}.{flag}", "must be true or false")
    chunked = flags["enable_chunked_prefill"]
    kv = m.get("kv_capacity_tokens")
    return EngineConfig(
        max_num_seqs=integer(m, "max_num_seqs", where, base.max_num_seqs),
        max_num_batched_tokens=integer(m, "max_num_batched_tokens", where,
                                       base.max_num_batched_tokens),
        enable_chunked_prefill=chunked,
        kv_capacity_tokens=integer(m, "kv_capacity_tokens", where) if kv is not None else None,
        block_size=integer(m, "block_size", where, base.block_size),
        enable_prefix_caching=flags["enable_prefix_caching"],
    )


def parse_policies(raw: Any, where: str = "policies") -> tuple[PolicyChoice, ...]:
    if raw is None:
        return (PolicyChoice("tailguard"),)
    if isinstance(raw, str):
        raw = [p.strip() for p in raw.split(",") if p.strip()]
    if not isinstance(raw, list) or not raw:
        raise ConfigError(where, "must be a non-empty list of policy names", policy_names())
    out = []
    for i, item in enumerate(raw):
        if isinstance(item, str):
            name, options = item, {}
        elif isinstance(item, Mapping) and "name" in item:
            name = str(item["name"])
            options = {k: v for k, v in item.items() if k != "name"}
        else:
            raise ConfigError(f"{where}[{i}]", "must be a policy name or {name: ..., options}",
                              policy_names())
        if name not in policy_names():
            raise ConfigError(f"{where}[{i}]", f"unknown policy {name!r}", policy_names())
        out.append(PolicyChoice(name, options))
    return tuple(out)


def _gpu_index(m: Mapping[str, Any], w: str, kind: Any, gpus: int | None) -> int | None:
    if m.get("gpu_index") is None:
        return None
    if kind != "throttle":
        raise ConfigError(f"{w}.gpu_index", "only a throttle targets one GPU")
    k = m["gpu_index"]
    if isinstance(k, bool) or not isinstance(k, int) or k < 0 or (gpus is not None and k >= gpus):
        raise ConfigError(f"{w}.gpu_index", f"must be a GPU of the node: 0..{(gpus or 1) - 1}")
    return k


def parse_faults(raw: Any, node_ids: Sequence[str], where: str = "faults",
                 gpus: Mapping[str, int] | None = None) -> tuple[Fault, ...]:
    """The ``faults`` list; ``gpus``: each node's GPU count (for ``gpu_index``)."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ConfigError(where, "must be a list")
    out = []
    for i, item in enumerate(raw):
        w = f"{where}[{i}]"
        m = require_mapping(item, w)
        check_keys(m, ("node", "kind", "at_s", "duration_s", "factor", "rate", "period_s",
                        "pause_s", "delay_s", "gpu_index"), w)
        node = m.get("node")
        if node not in node_ids:
            shown = list(node_ids) if len(node_ids) <= 40 else [*node_ids[:40], "..."]
            raise ConfigError(f"{w}.node", f"unknown node {node!r}", shown)
        kind = m.get("kind")
        if kind not in FAULT_KINDS:
            raise ConfigError(f"{w}.kind", f"unknown fault kind {kind!r}", list(FAULT_KINDS))
        fault = Fault(
            node=str(node),
            kind=str(kind),
            at_s=number(m, "at_s", w, 0.0, positive=False, minimum=0.0),
            duration_s=number(m, "duration_s", w) if m.get("duration_s") is not None else None,
            factor=number(m, "factor", w, 1.0),
            rate=number(m, "rate", w, 0.0, positive=False, minimum=0.0),
            period_s=number(m, "period_s", w, 10.0),
            pause_s=number(m, "pause_s", w, 1.0),
            delay_s=number(m, "delay_s", w, 0.0, positive=False, minimum=0.0),
            gpu_index=_gpu_index(m, w, kind, gpus.get(str(node), 1) if gpus else None),
        )
        if kind == "throttle" and "factor" not in m:
            raise ConfigError(f"{w}.factor", "is required for a throttle (speed factor, e.g. 0.4)")
        if kind == "error_rate" and not 0.0 < fault.rate <= 1.0:
            raise ConfigError(f"{w}.rate", "must be in (0, 1] for error_rate")
        if kind == "slow_network" and fault.delay_s <= 0:
            raise ConfigError(f"{w}.delay_s", "must be > 0 for slow_network")
        out.append(fault)
    return tuple(out)


SCENARIO_KEYS = ("limits", "admission", "outliers", "hedging", "name", "seed", "model", "slo",
                 "network_rtt_s", "fleet", "workload", "faults", "policies", "catalog", "prices",
                 "gpu_telemetry")


def parse_scenario(raw: Any, base_dir: Path | None = None,
                   catalog: Catalog = DEFAULT_CATALOG) -> Scenario:
    m = require_mapping(raw, "scenario")
    check_keys(m, SCENARIO_KEYS, "")
    if "catalog" in m:
        catalog = extend_catalog(catalog, m["catalog"])
    if "prices" in m:
        catalog = catalog.with_prices(require_mapping(m["prices"], "prices"))
    name = str(m.get("name", "scenario"))
    seed = m.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError("seed", f"must be an integer, got {seed!r}")
    if "model" not in m:
        raise ConfigError("model", "is required", [x.name for x in catalog.models])
    model = catalog.model(str(m["model"]), "model")
    slo = parse_slo(m.get("slo"))
    rtt = number(m, "network_rtt_s", "", 0.0, positive=False, minimum=0.0)
    fleet_raw = m.get("fleet")
    if not isinstance(fleet_raw, list) or not fleet_raw:
        raise ConfigError("fleet", "must be a non-empty list of {gpu, count}")
    groups = []
    for i, item in enumerate(fleet_raw):
        w = f"fleet[{i}]"
        g = require_mapping(item, w)
        check_keys(g, ("gpu", "count", "tp", *PIPELINE_KEYS, "engine", "speed_spread"), w)
        layout = parse_layout(g, w, catalog)
        if layout is not None:
            name, tp = layout.name, layout.stages[0].tp
        else:
            if "gpu" not in g:
                raise ConfigError(f"{w}.gpu", "is required", [x.name for x in catalog.gpus])
            name, tp = catalog.gpu(str(g["gpu"]), f"{w}.gpu").name, integer(g, "tp", w, 1)
        spread = number(g, "speed_spread", w, 0.0, positive=False, minimum=0.0)
        if spread >= 1.0:
            raise ConfigError(f"{w}.speed_spread", "must be < 1 (e.g. 0.1 for +-10%)")
        group = FleetGroup(name, integer(g, "count", w, 1), tp,
                           parse_engine(g.get("engine"), f"{w}.engine"), spread, layout)
        try:
            perf = group.perf(catalog, model)
        except ConfigError as exc:
            raise ConfigError(f"{w}.{exc.field}", exc.message) from None
        if not perf.fits:
            raise ConfigError(
                f"{w}.gpu" if layout is None else f"{w}.stages",
                f"{model.name} does not fit on {group.gpus} x {name}: it needs about "
                f"{perf.memory_needed_gb:.0f} GB per GPU; raise tp or pp, or pick larger GPUs",
            )
        groups.append(group)
    if "workload" not in m:
        raise ConfigError("workload", "is required")
    workload = parse_workload(require_mapping(m["workload"], "workload"), "workload", base_dir)
    scenario = Scenario(name, seed, model.name, slo, rtt, tuple(groups), workload, (),
                        parse_policies(m.get("policies")), catalog)
    planned = scenario.nodes()
    ids = [n.id for n in planned]
    faults = parse_faults(m.get("faults"), ids, gpus={n.id: n.perf.gpus for n in planned})
    telemetry = m.get("gpu_telemetry", False)
    if not isinstance(telemetry, bool):
        raise ConfigError("gpu_telemetry", "must be true or false")
    return Scenario(name, seed, model.name, slo, rtt, tuple(groups), workload, faults,
                    scenario.policies, catalog,
                    parse_core(OutliersBlock, m.get("outliers"), "outliers"),
                    limits=parse_core(LimitsBlock, m.get("limits"), "limits", optional=True),
                    admission=parse_core(AdmissionBlock, m.get("admission"), "admission",
                                         optional=True),
                    hedging=parse_core(HedgingBlock, m.get("hedging"), "hedging"),
                    gpu_telemetry=telemetry)


def load_scenario(path: str | Path) -> Scenario:
    p = Path(path)
    return parse_scenario(read_yaml(p, "scenario"), p.parent)
