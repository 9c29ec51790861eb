"""The health-probe rule, one for every driver.

A driver probes each node (the gateway: ``GET /health`` every few seconds; the
simulator: a crashed engine fails its probe) and reports every result with
``Balancer.on_probe``. A node that fails ``failures`` probes in a row is out of
rotation (the health probes move a routable node to ``down``); one that then
passes ``successes`` in a row is back (``down`` to healthy). Kubernetes' probes
count the same way (``failureThreshold``, ``successThreshold``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ProbeRule:
    failures: int = 2  # failed probes in a row that take a node out of rotation
    successes: int = 1  # passed probes in a row that bring it back


class ProbeCount:
    """One node's probes: in rotation by them, and the passes and failures in a row."""

    __slots__ = ("failed", "passed", "up")

    def __init__(self) -> None:
        self.up = True
        self.passed = 0
        self.failed = 0


class HealthProbes:
    """Every node's probe count under one :class:`ProbeRule`."""

    __slots__ = ("_counts", "rule")

    def __init__(self, rule: ProbeRule) -> None:
        self.rule = rule
        self._counts: dict[str, ProbeCount] = {}

    def observe(self, node_id: str, ok: bool) -> bool | None:
        """One probe's result; the node's verdict when it changes (False: out of
        rotation, True: back), else None."""
        c = self._counts.get(node_id)
        if c is None:
            c = self._counts[node_id] = ProbeCount()
        if ok:
            c.passed += 1
            c.failed = 0
            if not c.up and c.passed >= self.rule.successes:
                c.up = True
                return True
        else:
            c.failed += 1
            c.passed = 0
            if c.up and c.failed >= self.rule.failures:
                c.up = False
                return False
        return None

    def count(self, node_id: str) -> ProbeCount | None:
        """The node's probes so far (None: never probed)."""
        return self._counts.get(node_id)

    def forget(self, node_id: str) -> None:
        self._counts.pop(node_id, None)


__all__ = ["HealthProbes", "ProbeCount", "ProbeRule"]
