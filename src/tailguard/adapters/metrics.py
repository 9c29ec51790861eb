"""The gateway's own Prometheus metrics (``GET /metrics``).

One :class:`prometheus_client.CollectorRegistry` per application, so several
gateways in one process (tests) do not share counters. Names carry the
``tailguard_`` prefix and their unit; labels are bounded: ``pool`` is a served
model name (``_unknown`` for names the fleet does not serve, ``_invalid`` for
requests refused before their model was known), ``node`` and ``gpu`` come from
the fleet file, ``code`` is the HTTP status, ``origin`` an
:class:`~tailguard.core.fleet.Outcome`. Never a request id.

Per-request series are updated on the hot path through label children cached
in plain dicts (``labels()`` takes a lock and builds a key each call). The
per-node gauges (in flight, capacity estimate, state, engine metrics) are read
from the live fleet at scrape time by :class:`FleetCollector`, so the request
path pays nothing for them.

=================================================  =========  ============================
metric                                             type       labels
=================================================  =========  ============================
tailguard_requests_total                           counter    pool, code
tailguard_ttft_seconds                             histogram  pool, node, gpu (streamed)
tailguard_tpot_seconds                             histogram  pool, node, gpu (streamed)
tailguard_max_token_gap_seconds                    histogram  pool, node, gpu (streamed)
tailguard_e2e_seconds                              histogram  pool, node, gpu
tailguard_output_tokens_total                      counter    pool, node
tailguard_retries_total                            counter    pool, origin
tailguard_upstream_errors_total                    counter    node, origin
tailguard_balancer_events_total                    counter    kind, state
tailguard_config_reloads_total                     counter    result
tailguard_client_connections                       gauge      -
tailguard_asyncio_tasks                            gauge      -
tailguard_client_connections_closed_total          counter    reason
tailguard_failure_verdicts_total                   counter    verdict
tailguard_in_flight_requests                       gauge      node, gpu
tailguard_node_slots                               gauge      node, gpu
tailguard_node_capacity_tokens_per_second          gauge      node, gpu
tailguard_node_decode_slowdown_ratio               gauge      node, gpu
tailguard_node_prefill_slowdown_ratio              gauge      node, gpu
tailguard_node_ttft_estimate_seconds               gauge      node, gpu
tailguard_node_tpot_estimate_seconds               gauge      node, gpu
tailguard_node_state                               gauge      node, gpu, state (1 = current)
tailguard_node_role                                gauge      node, gpu, role (prefill, decode, both)
tailguard_node_up                                  gauge      node, gpu (health checks)
tailguard_node_engine_running_requests             gauge      node, gpu (fresh data only)
tailguard_node_engine_waiting_requests             gauge      node, gpu (fresh data only)
tailguard_node_engine_kv_cache_usage_ratio         gauge      node, gpu (fresh data only)
tailguard_node_engine_metrics_age_seconds          gauge      node, gpu
tailguard_node_engine_metrics_stale                gauge      node, gpu
tailguard_node_limit_requests                      gauge      node, gpu
tailguard_node_slowness_ratio                      gauge      node, gpu
tailguard_slo_requests_total                       counter    pool, gpu, result (met/missed)
tailguard_hedges_total                             counter    pool, result (hook)
tailguard_shed_requests_total                      counter    pool, reason (hook)
tailguard_remediations_total                       counter    action, result (hook)
tailguard_class_{decode,prefill}_slowdown_ratio    gauge      gpu
tailguard_pool_nodes                               gauge      pool, state
tailguard_pool_queue_depth                         gauge      pool
tailguard_pool_capacity_tokens_per_second          gauge      pool
tailguard_pool_slo_{ttft,tpot}_seconds             gauge      pool
tailguard_pool_slo_attainment_target               gauge      pool
tailguard_node_in_flight_elsewhere_requests        gauge      node, gpu (shared_state)
tailguard_shared_state_{up,leader,replicas}        gauge      - (shared_state)
tailguard_shared_state_sync_seconds                gauge      - (shared_state)
tailguard_shared_state_errors_total                counter    - (shared_state)
tailguard_shared_state_rejected_total              counter    reason (shared_state)
=================================================  =========  ============================

What each means, with queries and alert rules: ``docs/metrics.md`` (a test
checks that every metric exposed is documented there, and the reverse).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from tailguard.core.events import Event
from tailguard.core.fleet import NodeState
from tailguard.core.snapshot import FleetSnapshot, NodeSnapshot

if TYPE_CHECKING:
    from tailguard.adapters.live_fleet import LiveFleet

UNKNOWN_POOL = "_unknown"
INVALID_POOL = "_invalid"

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
E2E_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
               160.0, 320.0)


class GatewayMetrics:
    """The registry and the hot-path counters of one gateway."""

    def __init__(self, fleet: LiveFleet) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        node_labels = ["pool", "node", "gpu"]
        self.requests = Counter("tailguard_requests", "Requests answered, by pool and HTTP status",
                                ["pool", "code"], registry=r)
        self.ttft = Histogram("tailguard_ttft_seconds",
                              "Time to first token of streamed answers, as the gateway saw it",
                              node_labels, buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("tailguard_tpot_seconds",
                              "Mean time per output token after the first, streamed answers",
                              node_labels, buckets=TPOT_BUCKETS, registry=r)
        self.max_gap = Histogram("tailguard_max_token_gap_seconds",
                                 "Longest gap between two chunks of a streamed answer",
                                 node_labels, buckets=(*TPOT_BUCKETS, 2.0, 5.0, 10.0), registry=r)
        self.e2e = Histogram("tailguard_e2e_seconds",
                             "End-to-end time of requests answered by a node",
                             node_labels, buckets=E2E_BUCKETS, registry=r)
        # Disaggregated requests, leg by leg (the first token's time splits into them).
        self.prefill_leg = Histogram(
            "tailguard_prefill_leg_seconds",
            "Disaggregated requests: the prefill leg on the node that computed the prompt, "
            "sent to answered", node_labels, buckets=TTFT_BUCKETS, registry=r)
        self.handoff = Histogram(
            "tailguard_handoff_first_token_seconds",
            "Disaggregated streamed requests: from the prefill leg's answer to the decode "
            "node's first token (the KV pull, its wait there and a step)",
            node_labels, buckets=TTFT_BUCKETS, registry=r)
        self.output_tokens = Counter("tailguard_output_tokens",
                                     "Output tokens delivered (usage when reported, else counted)",
                                     ["pool", "node"], registry=r)
        self.retries = Counter("tailguard_retries",
                               "Requests retried on another node, by the failure that caused it",
                               ["pool", "origin"], registry=r)
        self.upstream_errors = Counter("tailguard_upstream_errors",
                                       "Failed upstream attempts, by node and origin",
                                       ["node", "origin"], registry=r)
        self.events = Counter("tailguard_balancer_events", "Events the decision core returned",
                              ["kind", "state"], registry=r)
        self.reloads = Counter("tailguard_config_reloads", "Fleet file reloads, by result",
                               ["result"], registry=r)
        self.slo = Counter("tailguard_slo_requests",
                           "Streamed answers judged against their pool's TTFT and TPOT SLO",
                           ["pool", "gpu", "result"], registry=r)
        self.hedges = Counter("tailguard_hedges", "Hedge (duplicate) requests sent, by result",
                              ["pool", "result"], registry=r)
        self.migrations = Counter(
            "tailguard_migrations", "Streams moved to another node mid-answer, by cause "
            "(failure, stall, quarantined, down, degraded) and result (moved: the continuation "
            "took over; resumed: the stalled stream came back first; failed)",
            ["pool", "cause", "result"], registry=r)
        self.shed = Counter("tailguard_shed_requests", "Requests refused at admission (429)",
                            ["pool", "reason"], registry=r)
        self.remediations = Counter("tailguard_remediations",
                                    "Remediation actions run, by action and result",
                                    ["action", "result"], registry=r)
        self.client_closed = Counter("tailguard_client_connections_closed",
                                     "Client connections the gateway closed or refused, by reason",
                                     ["reason"], registry=r)
        self.client_connections = Gauge("tailguard_client_connections",
                                        "Open client connections", registry=r)
        # The process's memory, file descriptors and CPU (process_*), and its
        # asyncio tasks: what a leak shows in first (benchmarks/soak.py reads them).
        ProcessCollector(registry=r)
        self.tasks = Gauge("tailguard_asyncio_tasks", "Asyncio tasks alive in the gateway",
                           registry=r)
        self.tasks.set_function(_task_count)
        self.failure_verdicts = Counter(
            "tailguard_failure_verdicts",
            "Upstream 5xx before the first byte, by whose fault a second node showed it was",
            ["verdict"], registry=r)
        self._fleet = fleet
        self._slo: dict[tuple[str, str, bool], Any] = {}
        r.register(FleetCollector(fleet))
        fleet.event_listeners.append(self.on_event)
        self._codes: dict[tuple[str, int], Any] = {}
        self._nodes: dict[tuple[str, str], tuple[Any, Any, Any, Any, Any]] = {}

    def request_done(self, pool: str, code: int) -> None:
        child = self._codes.get((pool, code))
        if child is None:
            child = self._codes[(pool, code)] = self.requests.labels(pool, str(code))
        child.inc()

    def _node(self, pool: str, node: str, gpu: str) -> tuple[Any, Any, Any, Any, Any]:
        key = (pool, node)
        c = self._nodes.get(key)
        if c is None:
            c = self._nodes[key] = (
                self.ttft.labels(pool, node, gpu), self.tpot.labels(pool, node, gpu),
                self.max_gap.labels(pool, node, gpu), self.e2e.labels(pool, node, gpu),
                self.output_tokens.labels(pool, node))
        return c

    def answered(self, pool: str, node: str, gpu: str, e2e: float, output_tokens: int,
                 ttft: float | None = None, tpot: float | None = None,
                 max_gap: float | None = None) -> None:
        """A node answered (completely): latency histograms and token counter."""
        c_ttft, c_tpot, c_gap, c_e2e, c_tokens = self._node(pool, node, gpu)
        c_e2e.observe(e2e)
        if output_tokens:
            c_tokens.inc(output_tokens)
        if ttft is not None:
            c_ttft.observe(ttft)
            self._judge(pool, gpu, ttft, tpot)
        if tpot is not None:
            c_tpot.observe(tpot)
        if max_gap is not None:
            c_gap.observe(max_gap)

    def leg(self, pool: str, prefill: tuple[str, str, float], decode: tuple[str, str, float]
            | None) -> None:
        """A disaggregated request's legs: (node, gpu, seconds) of its prefill leg and,
        streamed, of the decode side up to the first token."""
        self.prefill_leg.labels(pool, prefill[0], prefill[1]).observe(prefill[2])
        if decode is not None:
            self.handoff.labels(pool, decode[0], decode[1]).observe(decode[2])

    def _judge(self, pool: str, gpu: str, ttft: float, tpot: float | None) -> None:
        # Only streamed answers are judged: a non-streamed one has no TTFT to compare.
        p = self._fleet.balancer.pools.get(pool)
        if p is None:
            return
        slo = p.config.slo
        met = ttft <= slo.ttft_s and (tpot is None or tpot <= slo.tpot_s)
        key = (pool, gpu, met)
        child = self._slo.get(key)
        if child is None:
            child = self._slo[key] = self.slo.labels(pool, gpu, "met" if met else "missed")
        child.inc()

    def hedge(self, pool: str, result: str) -> None:
        """A hedge was sent; ``result``: ``won``, ``lost`` or ``cancelled`` (for issue 5)."""
        self.hedges.labels(pool, result).inc()

    def migration(self, pool: str, cause: str, result: str) -> None:
        """A stream's continuation was sent to another node (issue 45)."""
        self.migrations.labels(pool, cause, result).inc()

    def shed_request(self, pool: str, reason: str) -> None:
        """Admission refused a request (``queue_full``, ``deadline``...; for issue 4)."""
        self.shed.labels(pool, reason).inc()

    def remediation(self, action: str, result: str) -> None:
        """A remediation action ran (``command``/``webhook``/``kubernetes``; for issue 5)."""
        self.remediations.labels(action, result).inc()

    def client_closed_reason(self, reason: str) -> None:
        self.client_closed.labels(reason).inc()

    def watch_connections(self, count: Callable[[], int]) -> None:
        self.client_connections.set_function(count)

    def upstream_error(self, node: str, origin: str) -> None:
        self.upstream_errors.labels(node, origin).inc()

    def retry(self, pool: str, origin: str) -> None:
        self.retries.labels(pool, origin).inc()

    def on_event(self, ev: Event) -> None:
        self.events.labels(ev.kind, ev.state).inc()


def _task_count() -> int:
    try:
        return len(asyncio.all_tasks())
    except RuntimeError:  # scraped outside the loop (a test's registry read)
        return 0


class FleetCollector:
    """Per-node gauges, read from the live fleet when Prometheus scrapes."""

    def __init__(self, fleet: LiveFleet) -> None:
        self.fleet = fleet

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        labels = ["node", "gpu"]

        def gauge(name: str, doc: str, extra: list[str] | None = None) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=labels + (extra or []))

        in_flight = gauge("tailguard_in_flight_requests", "Requests dispatched and not finished")
        slots = gauge("tailguard_node_slots", "Concurrent sequences the balancer assumes the engine runs")
        capacity = gauge("tailguard_node_capacity_tokens_per_second",
                         "Estimated decode throughput within the pool's TPOT SLO "
                         "(roofline prior corrected by measurements)")
        decode = gauge("tailguard_node_decode_slowdown_ratio",
                       "Measured decode time over the roofline prior (1 = as modelled)")
        prefill = gauge("tailguard_node_prefill_slowdown_ratio",
                        "Measured prefill time over the roofline prior (1 = as modelled)")
        ttft = gauge("tailguard_node_ttft_estimate_seconds", "EWMA of measured time to first token")
        tpot = gauge("tailguard_node_tpot_estimate_seconds", "EWMA of measured time per output token")
        state = gauge("tailguard_node_state", "Node state (1 for the current one)", ["state"])
        role = gauge("tailguard_node_role", "The node's role in disaggregated serving (1 for "
                     "its own: prefill, decode or both)", ["role"])
        up = gauge("tailguard_node_up", "1 while the node passes its health checks")
        running = gauge("tailguard_node_engine_running_requests",
                        "Requests the engine reports running (fresh data only)")
        waiting = gauge("tailguard_node_engine_waiting_requests",
                        "Requests the engine reports waiting (fresh data only)")
        kv = gauge("tailguard_node_engine_kv_cache_usage_ratio",
                   "KV cache use the engine reports, 0..1 (fresh data only)")
        age = gauge("tailguard_node_engine_metrics_age_seconds", "Age of the last good scrape")
        stale = gauge("tailguard_node_engine_metrics_stale", "1 when the engine metrics are stale")
        limit = gauge("tailguard_node_limit_requests",
                      "Concurrent requests the gateway lets the node run (its concurrency "
                      "limit; its slots when no limiter is configured)")
        slowness = gauge("tailguard_node_slowness_ratio",
                         "How slow the node is for its own hardware (1 = like its GPU class)")
        stalls = CounterMetricFamily("tailguard_node_stalls",
                                     "Stalls seen to end: silences past a prompt's due time "
                                     "of 1 s and twice its allowance or more", labels=labels)
        stalled = CounterMetricFamily("tailguard_node_stalled_seconds",
                                      "Silence of the node's stalls past their prompts' due "
                                      "times", labels=labels)
        fleet = self.fleet
        now = time.monotonic()
        snap = fleet.balancer.snapshot(now)
        nodes = list(snap.nodes.values())
        for node in nodes:
            lv = [node.id, node.gpu_class]
            in_flight.add_metric(lv, node.in_flight)
            stalls.add_metric(lv, node.stalls)
            stalled.add_metric(lv, node.stalled_s)
            slots.add_metric(lv, node.slots)
            limit.add_metric(lv, node.limit)
            slowness.add_metric(lv, node.slowness)
            decode.add_metric(lv, node.decode_slowdown)
            prefill.add_metric(lv, node.prefill_slowdown)
            if node.ttft_s is not None:
                ttft.add_metric(lv, node.ttft_s)
            if node.tpot_s is not None:
                tpot.add_metric(lv, node.tpot_s)
            capacity.add_metric(lv, node.capacity_tokens_per_s)
            for s in NodeState:
                state.add_metric([*lv, s.value], 1.0 if node.state is s else 0.0)
            role.add_metric([*lv, node.spec.role], 1.0)
            mon = fleet.monitors.get(node.id)
            if mon is None:
                continue
            up.add_metric(lv, 1.0 if mon.up else 0.0)
            a = mon.metrics_age(now)
            if a is not None:
                age.add_metric(lv, a)
                stale.add_metric(lv, 1.0 if mon.stale else 0.0)
            if mon.sample is not None and not mon.stale:
                running.add_metric(lv, mon.sample.running)
                waiting.add_metric(lv, mon.sample.waiting)
                if mon.sample.kv_usage >= 0:
                    kv.add_metric(lv, mon.sample.kv_usage)
        return [in_flight, slots, capacity, decode, prefill, ttft, tpot, state, role, up, running,
                waiting, kv, age, stale, limit, slowness, stalls, stalled, *self._classes(nodes),
                *self._pools(snap), *self._shared(nodes)]

    def _shared(self, nodes: list[NodeSnapshot]) -> list[Metric]:
        """Shared state across replicas: the families always, samples only with shared_state."""
        shared = self.fleet.shared
        elsewhere = GaugeMetricFamily("tailguard_node_in_flight_elsewhere_requests",
                                      "Requests on the node from the other gateway replicas, "
                                      "as they last published", labels=["node", "gpu"])
        up = GaugeMetricFamily("tailguard_shared_state_up",
                               "1 when the last sync with the shared store succeeded")
        leader = GaugeMetricFamily("tailguard_shared_state_leader",
                                   "1 on the replica whose detector decides node states")
        replicas = GaugeMetricFamily("tailguard_shared_state_replicas",
                                     "Live gateway replicas seen at the last sync, this one "
                                     "included")
        sync = GaugeMetricFamily("tailguard_shared_state_sync_seconds",
                                 "Round trip of the last good sync with the shared store")
        errors = CounterMetricFamily("tailguard_shared_state_errors",
                                     "Syncs with the shared store that failed or timed out")
        rejected = CounterMetricFamily("tailguard_shared_state_rejected",
                                       "Reports and operator actions read from the shared "
                                       "store and refused", labels=["reason"])
        if shared is not None:
            for node in nodes:
                elsewhere.add_metric([node.id, node.gpu_class], node.in_flight_elsewhere)
            up.add_metric([], 1.0 if shared.up else 0.0)
            leader.add_metric([], 1.0 if shared.leader else 0.0)
            replicas.add_metric([], float(shared.replicas))
            sync.add_metric([], shared.sync_s)
            errors.add_metric([], float(shared.errors))
            for reason in ("malformed", "unsigned", "signature", "stale", "replayed"):
                rejected.add_metric([reason], float(shared.rejected.get(reason, 0)))
        return [elsewhere, up, leader, replicas, sync, errors, rejected]

    def _classes(self, nodes: list[NodeSnapshot]) -> list[Metric]:
        decode = GaugeMetricFamily("tailguard_class_decode_slowdown_ratio",
                                   "GPU class's measured decode time over the roofline prior "
                                   "(geometric mean over its nodes; what routing uses)",
                                   labels=["gpu"])
        prefill = GaugeMetricFamily("tailguard_class_prefill_slowdown_ratio",
                                    "GPU class's measured prefill time over the roofline prior",
                                    labels=["gpu"])
        seen: set[str] = set()
        for node in nodes:
            gpu = node.gpu_class
            if gpu not in seen:
                seen.add(gpu)
                decode.add_metric([gpu], node.class_decode_slowdown)
                prefill.add_metric([gpu], node.class_prefill_slowdown)
        return [decode, prefill]

    def _pools(self, snap: FleetSnapshot) -> list[Metric]:
        def gauge(name: str, doc: str, extra: list[str] | None = None) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=["pool", *(extra or [])])

        slo_ttft = gauge("tailguard_pool_slo_ttft_seconds", "The pool's TTFT SLO")
        slo_tpot = gauge("tailguard_pool_slo_tpot_seconds", "The pool's TPOT SLO")
        target = gauge("tailguard_pool_slo_attainment_target",
                       "Share of requests that must meet the SLO")
        states = gauge("tailguard_pool_nodes", "Nodes of the pool, by state", ["state"])
        queue = gauge("tailguard_pool_queue_depth",
                      "Requests waiting in the pool's admission queue (0 without a queue)")
        capacity = gauge("tailguard_pool_capacity_tokens_per_second",
                         "Sum of the routable nodes' estimated throughput within the TPOT SLO")
        for name, pool in snap.pools.items():
            if not pool.nodes:
                continue
            slo = pool.config.slo
            slo_ttft.add_metric([name], slo.ttft_s)
            slo_tpot.add_metric([name], slo.tpot_s)
            target.add_metric([name], slo.attainment)
            for st, n in pool.states.items():
                states.add_metric([name, st.value], n)
            queue.add_metric([name], pool.queue_depth)
            capacity.add_metric([name], pool.capacity_tokens_per_s)
        return [slo_ttft, slo_tpot, target, states, queue, capacity]
