"""The report section of the straggler work (issue 5).

The scenario key ``outliers:`` (on by default, parsed by
:mod:`tailguard.config.core_options`) sets :class:`~tailguard.core.outliers.OutlierConfig`;
the report section ``outliers`` says, per fault, how long detection took, how
long each node spent in each state, and which detections hit nodes that had
no fault (false detections)::

    outliers: {enabled: true, interval_s: 5, slow_ratio: 1.5, base_ejection_s: 30}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.table import Table

from tailguard.core.events import Event

# A detection within this long after a fault ended still counts as the fault's.
FAULT_GRACE_S = 30.0
_BAD_STATES = ("degraded", "quarantined")


def _names(e: Event, f: Any) -> bool:
    """Whether event ``e`` names fault ``f``: a node's state for a fault of the node,
    a link's (``from->to``) for a KV link fault on either end."""
    if e.kind == "link":
        return f.kind == "kv_link" and f.node in e.node.split("->")
    return bool(e.node == f.node and f.kind != "kv_link")


def outlier_report(events: Sequence[Event], faults: Sequence[Any], end_s: float,
                   time_in_states: Mapping[str, Mapping[str, float]],
                   detected: int, enforced: int,
                   stalls: Mapping[str, tuple[int, float]] | None = None) -> dict[str, Any]:
    """Time to detect each fault, false detections, time per state, ejection counts,
    and the stalls each node was seen to make (count, seconds silent), where any."""
    bad = [e for e in events if (e.kind == "state" and e.state in _BAD_STATES)
           or (e.kind == "link" and e.state == "slow")]
    detect: list[dict[str, Any]] = []
    for f in faults:
        end = f.at_s + f.duration_s if f.duration_s is not None else end_s
        hit = next((e for e in bad if _names(e, f) and f.at_s <= e.t <= end + FAULT_GRACE_S),
                   None)
        detect.append({"node": f.node, "kind": f.kind, "at_s": f.at_s,
                       "detected_s": round(hit.t - f.at_s, 3) if hit else None,
                       "state": hit.state if hit else None})
    false = [e for e in bad if not any(
        _names(e, f) and f.at_s <= e.t <= (f.at_s + f.duration_s if f.duration_s is not None
                                           else end_s) + FAULT_GRACE_S for f in faults)]
    unhealthy = {node: {k: round(v, 3) for k, v in sorted(st.items()) if k != "healthy"}
                 for node, st in sorted(time_in_states.items())}
    out = {
        "time_to_detect": detect,
        "false_detections": len(false),
        "false_quarantines": sum(1 for e in false if e.state == "quarantined"),
        "detected_ejections": detected,
        "enforced_ejections": enforced,
        "time_in_state_s": {k: v for k, v in unhealthy.items() if v},
    }
    if stalls:
        out["stalls"] = {node: {"stalls": n, "silent_s": round(s, 3)}
                         for node, (n, s) in sorted(stalls.items())}
    return out


def straggler_table(doc: Mapping[str, Any]) -> Table | None:
    """The ``tailguard sim`` summary of detection and hedging (None when nothing happened)."""
    rows = []
    for label, r in doc["results"].items():
        rep = r.get("outliers")
        if not r.get("events") and not r.get("hedges") and not (rep and rep["time_to_detect"]):
            continue
        detect = "-"
        if rep:
            detect = ", ".join(
                f"{d['node']} {d['kind']}: {d['detected_s']:g} s ({d['state']})"
                if d["detected_s"] is not None else f"{d['node']} {d['kind']}: not detected"
                for d in rep["time_to_detect"]) or "-"
        states = [e["state"] for e in r.get("events", [])]
        rows.append((label, str(states.count("degraded")), str(states.count("quarantined")),
                     str(rep["false_detections"]) if rep else "-", detect,
                     str(r.get("hedges", 0))))
    if not rows:
        return None
    table = Table(title="stragglers: detection, quarantine, hedging")
    for col in ("policy", "degraded", "quarantined", "false detections", "time to detect",
                "hedges"):
        table.add_column(col)
    for row in rows:
        table.add_row(*row)
    return table
