"""The running fleet: the balancer plus what the gateway keeps per node and pool.

The decision core (:class:`~tailguard.core.balancer.Balancer`) knows nodes as
specs and live statistics; the gateway adds what it needs to *reach* them:
each node's :class:`~tailguard.config.fleet.NodeConfig` (URL, upstream key),
its :class:`~tailguard.adapters.monitor.NodeMonitor`, and each pool's
settings (timeouts, retries) and retry budget. All fleet changes go through
here, whichever way they come (fleet-file reload, admin API, health checks):

* **add**: ``balancer.add_node`` and a monitor;
* **retire** (removed from the file, ``DELETE /admin/nodes/{id}``): the node
  is set ``DRAINING`` (no new requests), and once its in-flight requests
  finished (or after ``shutdown_timeout_s``) it leaves the balancer;
* **change** (same id, different settings): replaced at once. Requests in
  flight hold their :class:`~tailguard.core.balancer.Ticket`, which points to
  the old node object, and the old URL, so they finish undisturbed;
* **health**: a node failing its checks is ``DOWN``, and ``HEALTHY`` again
  when they pass, unless an operator or the core moved it meanwhile.

Nodes registered through the admin API are not in the file, so a reload
leaves them alone (unless the file now names the same id: the file wins).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from random import Random
from typing import Any

import aiohttp

from tailguard.adapters.engine_metrics import EngineSample
from tailguard.adapters.event_log import EventLog
from tailguard.adapters.monitor import NodeMonitor
from tailguard.adapters.shared_state import SharedState
from tailguard.config.fleet import FleetConfig, NodeConfig, PoolSettings
from tailguard.core.balancer import Balancer, Event
from tailguard.core.events import remedy
from tailguard.core.fleet import NodeState
from tailguard.core.probes import ProbeRule

log = logging.getLogger("tailguard.gateway.fleet")

TICK_INTERVAL_S = 0.5
DRAIN_POLL_S = 0.05


@dataclass(slots=True)
class ReloadSummary:
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    pools: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        parts = [f"{k} {', '.join(v)}" for k, v in (("added", self.added),
                 ("removed", self.removed), ("changed", self.changed),
                 ("pools changed", self.pools)) if v]
        return "; ".join(parts) or "no change"


class LiveFleet:
    """The balancer and the gateway-side state of every node and pool."""

    def __init__(self, config: FleetConfig, rng: Random | None = None,
                 recorder: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.config = config
        self.balancer = Balancer([n.spec() for n in config.nodes],
                                 [p.pool_config() for p in config.pools.values()],
                                 rng or Random(), catalog=config.catalog, recorder=recorder,
                                 outliers=config.outliers,
                                 probes=ProbeRule(config.health.failures,
                                                  config.health.successes))
        self.nodes: dict[str, NodeConfig] = {n.id: n for n in config.nodes}
        self.dynamic: set[str] = set()  # registered through the admin API
        self.monitors: dict[str, NodeMonitor] = {}
        self.event_listeners: list[Callable[[Event], None]] = []
        self.event_log = EventLog()  # GET /admin/events: core events and remediation results
        self.event_listeners.append(self.event_log.on_core_event)
        self._retiring: dict[str, asyncio.Task[None]] = {}
        self._session: aiohttp.ClientSession | None = None
        self._tick_task: asyncio.Task[None] | None = None
        self._models: list[str] | None = None
        # (node id by endpoint, endpoint by node id), built when first asked for
        self._endpoints: tuple[dict[str, str], dict[str, str]] | None = None
        self.shared: SharedState | None = None  # with shared_state: in the fleet file

    # -- lifecycle -----------------------------------------------------------

    async def start(self, session: aiohttp.ClientSession) -> None:
        self._session = session
        for node in self.nodes.values():
            self._start_monitor(node)
        self._tick_task = asyncio.create_task(self._tick_loop(), name="balancer-tick")
        if self.config.shared_state is not None:
            self.shared = SharedState(self, self.config.shared_state)
            self.shared.start()

    async def stop(self) -> None:
        tasks = list(self._retiring.values())
        if self._tick_task is not None:
            tasks.append(self._tick_task)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._retiring.clear()
        self._tick_task = None
        if self.shared is not None:
            await self.shared.stop()
            self.shared = None
        for m in list(self.monitors.values()):
            await m.stop()
        self.monitors.clear()

    def _start_monitor(self, node: NodeConfig) -> None:
        if self._session is None:
            return
        mon = NodeMonitor(node, self._session, self.config.scrape, self.config.health,
                          self._on_sample, self._on_health)
        self.monitors[node.id] = mon
        mon.start()

    async def _stop_monitor(self, node_id: str) -> None:
        mon = self.monitors.pop(node_id, None)
        if mon is not None:
            await mon.stop()

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(TICK_INTERVAL_S)
            for ev in self.balancer.tick(time.monotonic()):
                self.publish_event(ev)

    def publish_event(self, ev: Event) -> None:
        """A core event to the log, the metrics, the dashboard and the remediator."""
        ev = self._with_gpu_cause(ev)
        log.info("node %s: %s -> %s (%s)", ev.node, ev.kind, ev.state, ev.reason)
        for listener in self.event_listeners:
            listener(ev)

    # -- what the proxy asks -------------------------------------------------

    def pool_settings(self, model: str) -> PoolSettings:
        return self.config.pool(model)

    def budget_balances(self) -> dict[str, list[float | None]]:
        """Each pool's retry balance and hedge credit, for the other replicas."""
        return {name: [round(p.budget.balance, 3),
                       round(p.hedger.credit, 3) if p.hedger is not None else None]
                for name, p in self.balancer.pools.items()}

    def lend_budgets(self, peers: list[dict[str, Any]]) -> None:
        """What each pool may borrow of the others' budgets: ``1/k`` of their balance."""
        k = len(peers) + 1
        for model, pool in self.balancer.pools.items():
            retry = hedge = 0.0
            for p in peers:
                got = p.get(model)
                if isinstance(got, list) and len(got) == 2:
                    retry += float(got[0] or 0.0)
                    hedge += float(got[1] or 0.0)
            pool.budget.lent = retry / k
            if pool.hedger is not None:
                pool.hedger.lent = hedge / k

    def served_models(self) -> list[str]:
        """Model names some node in the fleet serves, in first-seen order."""
        if self._models is None:
            seen: dict[str, None] = {}
            for node in self.balancer.nodes.values():
                for m in node.spec.models:
                    seen.setdefault(m, None)
            self._models = list(seen)
        return self._models

    def endpoints(self) -> dict[str, str]:
        """Node id by ``host:port`` (:attr:`NodeConfig.endpoint`), for the endpoint picker."""
        return self._endpoint_maps()[0]

    def addresses(self) -> dict[str, str]:
        """``host:port`` by node id (the inverse of :meth:`endpoints`, parsed once)."""
        return self._endpoint_maps()[1]

    def _endpoint_maps(self) -> tuple[dict[str, str], dict[str, str]]:
        if self._endpoints is None:
            by_id = {n.id: n.endpoint for n in self.nodes.values()}
            self._endpoints = ({e: i for i, e in by_id.items()}, by_id)
        return self._endpoints

    def serves(self, model: str) -> bool:
        pool = self.balancer.pools.get(model)
        return pool is not None and bool(pool.nodes)

    def _with_gpu_cause(self, ev: Event) -> Event:
        """A slow node's event names the GPU behind it, when its DCGM page shows one (or
        says its GPUs are healthy); ``cause`` gets the kind, for remediation rules."""
        mon = self.monitors.get(ev.node)
        if ev.state not in ("degraded", "quarantined") or mon is None:
            return ev
        found = mon.gpu_cause_kind()
        if found is None:
            return ev
        kind, text, gpu = found
        return dataclasses.replace(ev, reason=f"{ev.reason}; {text}", cause=kind,
                                   advice=remedy(kind, gpu, max(len(mon.gpus), 1)))

    def ready(self) -> bool:
        return any(n.state.routable for n in self.balancer.nodes.values())

    def in_flight(self) -> int:
        return sum(n.in_flight for n in self.balancer.nodes.values())

    # -- changes -------------------------------------------------------------

    def add_node(self, node: NodeConfig, dynamic: bool = False) -> None:
        """Add ``node`` to rotation (raises ConfigError for a duplicate id)."""
        self.balancer.add_node(node.spec())
        self.nodes[node.id] = node
        if dynamic:
            self.dynamic.add(node.id)
        self._models = None
        self._endpoints = None
        self._start_monitor(node)
        log.info("node %s added (%s, %s, models %s)", node.id, node.url, node.gpu_class,
                 ", ".join(node.models))

    def set_state(self, node_id: str, state: NodeState, shared: bool = True) -> None:
        """Set a node's state; ``shared``: an operator's action the other replicas follow."""
        self.balancer.set_state(node_id, state)
        if shared and self.shared is not None:
            self.shared.operator(node_id, state)

    def retire(self, node_id: str, timeout_s: float | None = None) -> None:
        """Drain ``node_id`` and remove it once its requests finished."""
        if node_id in self._retiring or node_id not in self.balancer.nodes:
            return
        self.balancer.set_state(node_id, NodeState.DRAINING)
        wait = self.config.shutdown_timeout_s if timeout_s is None else timeout_s
        self._retiring[node_id] = asyncio.create_task(self._retire(node_id, wait),
                                                      name=f"retire:{node_id}")

    def retiring(self, node_id: str) -> bool:
        return node_id in self._retiring

    async def _retire(self, node_id: str, timeout_s: float) -> None:
        node = self.balancer.nodes.get(node_id)
        deadline = time.monotonic() + timeout_s
        while node is not None and node.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        self._retiring.pop(node_id, None)
        await self._remove_now(node_id)

    async def _remove_now(self, node_id: str) -> None:
        if node_id in self.balancer.nodes:
            self.balancer.remove_node(node_id)
        self.nodes.pop(node_id, None)
        self.dynamic.discard(node_id)
        self._models = None
        self._endpoints = None
        await self._stop_monitor(node_id)
        log.info("node %s removed", node_id)

    def _cancel_retire(self, node_id: str) -> None:
        task = self._retiring.pop(node_id, None)
        if task is not None:
            task.cancel()
            node = self.balancer.nodes.get(node_id)
            if node is not None and node.state is NodeState.DRAINING:
                self.balancer.set_state(node_id, NodeState.HEALTHY)

    async def apply(self, new: FleetConfig) -> ReloadSummary:
        """Move the running fleet to ``new`` (a reloaded file) without dropping requests."""
        summary = ReloadSummary()
        old = self.config
        if new.listen != old.listen:
            log.warning("listen changed to %s:%d; it takes effect on restart", *new.listen)
        # Pools first, so that added nodes find their pool's catalog model.
        for name in dict.fromkeys([*old.pools, *new.pools]):
            if old.pool(name) != new.pool(name):
                self._replace_pool(new.pool(name))
                summary.pools.append(name)
        self.config = new
        self._endpoints = None
        if self.balancer.outliers is not None:  # thresholds apply from the next tick
            self.balancer.outliers.config = new.outliers
        file_ids = {n.id for n in old.nodes} - self.dynamic
        for node in new.nodes:
            self._cancel_retire(node.id)
            current = self.nodes.get(node.id)
            if current is None:
                self.add_node(node)
                summary.added.append(node.id)
            elif current != node or node.id in self.dynamic:
                self.dynamic.discard(node.id)
                if current != node:
                    self.balancer.remove_node(node.id)
                    await self._stop_monitor(node.id)
                    self.nodes.pop(node.id)
                    self.add_node(node)
                    summary.changed.append(node.id)
        new_ids = {n.id for n in new.nodes}
        for node_id in sorted(file_ids - new_ids):
            self.retire(node_id)
            summary.removed.append(node_id)
        if new.scrape != old.scrape or new.health != old.health:
            for node_id in list(self.monitors):
                await self._stop_monitor(node_id)
                self._start_monitor(self.nodes[node_id])
        return summary

    def _replace_pool(self, settings: PoolSettings) -> None:
        """Swap a pool's policy and SLO, keeping its nodes and running statistics."""
        self.balancer.replace_pool(settings.pool_config())

    # -- monitor callbacks ---------------------------------------------------

    def _on_sample(self, node_id: str, now: float, sample: EngineSample | None) -> None:
        if sample is None:  # stale: withdraw the old picture
            self.balancer.on_engine_metrics(node_id, now, -1, -1, -1.0)
        else:
            self.balancer.on_engine_metrics(node_id, now, sample.running, sample.waiting,
                                            sample.kv_usage, sample.preemptions)

    def _on_health(self, node_id: str, ok: bool) -> bool | None:
        return self.balancer.on_probe(node_id, ok, time.monotonic())
