"""Prometheus series of the nodes' GPUs, from their DCGM pages (``dcgm_url``), at scrape time.

==============================================  =====  =========================================
metric                                          type   labels
==============================================  =====  =========================================
tailguard_gpu_sm_clock_ratio                    gauge  node, gpu (index), model: SM clock / max
tailguard_gpu_temperature_celsius               gauge  node, gpu, model
tailguard_gpu_memory_used_bytes                 gauge  node, gpu, model (frame buffer)
tailguard_gpu_slowdown                          gauge  node, gpu, model, reason: 1 while it holds
==============================================  =====  =========================================

Only nodes with a ``dcgm_url`` have series; a GPU's series go when its node's
page stops listing it. Names follow the gateway's own units (bytes, not MiB).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client.metrics_core import GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from tailguard.adapters.live_fleet import LiveFleet


class GpuCollector:
    def __init__(self, fleet: LiveFleet) -> None:
        self.fleet = fleet

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        labels = ["node", "gpu", "model"]
        clock = GaugeMetricFamily("tailguard_gpu_sm_clock_ratio",
                                  "SM clock as a share of its maximum (DCGM)", labels=labels)
        temp = GaugeMetricFamily("tailguard_gpu_temperature_celsius", "GPU temperature (DCGM)",
                                 labels=labels)
        mem = GaugeMetricFamily("tailguard_gpu_memory_used_bytes",
                                "GPU frame buffer in use (DCGM)", labels=labels)
        slow = GaugeMetricFamily("tailguard_gpu_slowdown",
                                 "1 while a throttle reason or a low clock holds (DCGM)",
                                 labels=[*labels, "reason"])
        for node_id, mon in list(self.fleet.monitors.items()):
            for g in mon.gpus:
                key = [node_id, str(g.index), g.model]
                ratio = g.clock_ratio
                if ratio is not None:
                    clock.add_metric(key, ratio)
                if g.temp_c is not None:
                    temp.add_metric(key, g.temp_c)
                if g.fb_used_mib is not None:
                    mem.add_metric(key, g.fb_used_mib * 1024 * 1024)
                for reason in g.slowdowns():
                    slow.add_metric([*key, reason], 1.0)
        return [clock, temp, mem, slow]
