"""Prometheus series of the outlier detector, read from the core at scrape time.

=================================================  =========  ============================
metric                                             type       labels
=================================================  =========  ============================
tailguard_outlier_ejections_total                  counter    kind (detected | enforced)
tailguard_node_outlier_slowness_ratio              gauge      node, gpu (1 = like its peers)
tailguard_node_weight_scale                        gauge      node, gpu (routing weight)
tailguard_node_ejections_total                     counter    node, gpu
=================================================  =========  ============================

*Detected* ejections are every time the detector decided a node should go;
*enforced* the ones it carried out (the rest hit the max-ejection share and
were degraded instead). State changes themselves are counted by
``tailguard_balancer_events_total{kind,state}`` and the current state is
``tailguard_node_state``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from tailguard.adapters.live_fleet import LiveFleet


class OutlierCollector:
    def __init__(self, fleet: LiveFleet) -> None:
        self.fleet = fleet

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        det = self.fleet.balancer.outliers
        if det is None:
            return []
        ejections = CounterMetricFamily("tailguard_outlier_ejections",
                                        "Ejections decided (detected) and carried out (enforced)",
                                        labels=["kind"])
        ejections.add_metric(["detected"], det.detected_ejections)
        ejections.add_metric(["enforced"], det.enforced_ejections)
        labels = ["node", "gpu"]
        slowness = GaugeMetricFamily("tailguard_node_outlier_slowness_ratio",
                                     "Last calibrated slowness for the node's own hardware",
                                     labels=labels)
        weight = GaugeMetricFamily("tailguard_node_weight_scale",
                                   "Routing weight (1 healthy; below 1 degraded or on probation)",
                                   labels=labels)
        per_node = CounterMetricFamily("tailguard_node_ejections",
                                       "Quarantines of the node", labels=labels)
        for node in list(self.fleet.balancer.nodes.values()):
            lv = [node.id, node.spec.gpu_class]
            weight.add_metric(lv, node.weight_scale)
            h = det.health.get(node.id)
            if h is not None:
                slowness.add_metric(lv, h.slowness)
                per_node.add_metric(lv, h.ejections)
        return [ejections, slowness, weight, per_node]
