"""Prometheus series of the request path's upstream connections, read at scrape time.

=================================================  =========  ======
metric                                             type       labels
=================================================  =========  ======
tailguard_upstream_connections_opened_total        counter    node
tailguard_upstream_connection_reuses_total         counter    node
tailguard_upstream_stale_retries_total             counter    node
tailguard_upstream_connect_errors_total            counter    node
tailguard_upstream_idle_connections                gauge      node
=================================================  =========  ======

Keep-alive is working when reuses grow with requests and opened stays flat;
stale retries count requests sent again because the engine had closed the idle
connection they went out on (a keep-alive timeout shorter than the gateway's).
Connections are pooled per origin (scheme, host, port): nodes that share one
report the same numbers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from tailguard.adapters.live_fleet import LiveFleet
    from tailguard.gateway.proxy import Proxy


class UpstreamCollector:
    def __init__(self, fleet: LiveFleet, proxy: Proxy) -> None:
        self.fleet = fleet
        self.proxy = proxy

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        client = self.proxy.upstream
        if client is None:
            return []
        opened = CounterMetricFamily("tailguard_upstream_connections_opened",
                                     "New connections to the node", labels=["node"])
        reuses = CounterMetricFamily("tailguard_upstream_connection_reuses",
                                     "Requests sent on a kept-alive connection", labels=["node"])
        stale = CounterMetricFamily("tailguard_upstream_stale_retries",
                                    "Requests sent again: the idle connection had closed",
                                    labels=["node"])
        errors = CounterMetricFamily("tailguard_upstream_connect_errors",
                                     "Connection attempts that failed or timed out",
                                     labels=["node"])
        idle = GaugeMetricFamily("tailguard_upstream_idle_connections",
                                 "Kept-alive connections waiting for a request", labels=["node"])
        for node in list(self.fleet.nodes.values()):
            pool = client.pool_for(node.url)
            lv = [node.id]
            if pool is None:  # no request yet
                for fam in (opened, reuses, stale, errors, idle):
                    fam.add_metric(lv, 0)
                continue
            opened.add_metric(lv, pool.opened)
            reuses.add_metric(lv, pool.reused)
            stale.add_metric(lv, pool.stale_retries)
            errors.add_metric(lv, pool.connect_errors)
            idle.add_metric(lv, len(pool.idle))
        return [opened, reuses, stale, errors, idle]
