"""Simulator reports: one self-contained HTML page with matplotlib figures embedded.

``tailguard sim SCENARIO --report report.html`` writes, next to the usual
tables:

* TTFT and TPOT CDFs per policy (requests that arrived in the measured
  window and completed), with the SLO marked;
* per-node load over time, one panel per policy: requests assigned to each
  node (from arrival to end, so time waiting in a gateway queue counts),
  coloured by GPU class;
* the node-state timeline per policy (degraded, quarantined, probation...),
  from the events the balancer returned;
* with ``--sweep``, SLO attainment and goodput against offered load per policy.

Figures are PNGs inlined as ``data:`` URIs, so the file opens anywhere and
fetches nothing. Only :class:`matplotlib.figure.Figure` is used (no pyplot):
no global backend or state is touched, which keeps the module safe to call
from tests and other programs.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from tailguard.sim.cluster import OK, RunRecord
from tailguard.sim.run import RunOptions, with_options
from tailguard.sim.scenario import Scenario

# Fixed colours per state (matching the live dashboard) and a palette for classes.
STATE_COLORS = {"healthy": "#2fb36d", "degraded": "#e5a50a", "probation": "#3e8ef7",
                "quarantined": "#e5484d", "cordoned": "#a371f7", "draining": "#8a96a3",
                "down": "#9b1c1c"}
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf")
LOAD_POINTS = 400


def _png(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def _window(rec: RunRecord, warmup_s: float, duration_s: float) -> np.ndarray[Any, Any]:
    arrival = np.asarray(rec.arrival, dtype=float)
    return (arrival >= warmup_s) & (arrival < duration_s)


def latencies(rec: RunRecord, warmup_s: float, duration_s: float) -> tuple[
        np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """TTFT and TPOT (s) of the completed requests that arrived in the measured window."""
    w = _window(rec, warmup_s, duration_s) & (np.asarray(rec.status) == OK)
    arrival = np.asarray(rec.arrival, dtype=float)[w]
    first = np.asarray(rec.first, dtype=float)[w]
    end = np.asarray(rec.end, dtype=float)[w]
    out = np.asarray(rec.output, dtype=float)[w]
    ttft = first - arrival
    multi = out > 1
    tpot = (end[multi] - first[multi]) / (out[multi] - 1)
    return ttft, tpot


def cdf_figure(records: Mapping[str, RunRecord], warmup_s: float, duration_s: float,
               slo_ttft_s: float, slo_tpot_s: float) -> Figure:
    fig = Figure(figsize=(11, 4))
    ax_ttft, ax_tpot = fig.subplots(1, 2)
    for i, (name, rec) in enumerate(records.items()):
        ttft, tpot = latencies(rec, warmup_s, duration_s)
        color = PALETTE[i % len(PALETTE)]
        for ax, values in ((ax_ttft, ttft), (ax_tpot, tpot)):
            if values.size:
                xs = np.sort(values)
                ax.plot(xs, np.arange(1, xs.size + 1) / xs.size, label=name, color=color)
    for ax, slo, what in ((ax_ttft, slo_ttft_s, "TTFT"), (ax_tpot, slo_tpot_s, "TPOT")):
        ax.axvline(slo, color="#e5484d", linestyle="--", linewidth=1, label=f"SLO {slo:g} s")
        ax.set_xscale("log")
        ax.set_xlabel(f"{what} (s, log scale)")
        ax.set_ylabel("share of requests")
        ax.set_ylim(0, 1.005)
        ax.grid(True, which="both", alpha=0.3)
        ax.set_title(f"{what} CDF")
    ax_tpot.legend(loc="lower right", fontsize=8)
    return fig


def node_load(rec: RunRecord, times: np.ndarray[Any, Any]) -> dict[str, np.ndarray[Any, Any]]:
    """Requests assigned to each node at each of ``times`` (arrival to end)."""
    node = np.asarray(rec.node, dtype=np.int64)
    arrival = np.asarray(rec.arrival, dtype=float)
    end = np.asarray(rec.end, dtype=float)
    end = np.where(end >= 0, end, rec.end_time)  # unfinished: held until the run stopped
    out = {}
    for i, nid in enumerate(rec.node_ids):
        mine = node == i
        starts = np.sort(arrival[mine])
        ends = np.sort(end[mine])
        out[nid] = (np.searchsorted(starts, times, side="right")
                    - np.searchsorted(ends, times, side="right"))
    return out


def busy_until(rec: RunRecord) -> float:
    """When the run's last request ended (the drain after it is empty and not plotted)."""
    end = np.asarray(rec.end, dtype=float)
    if ((end < 0) & (np.asarray(rec.node) >= 0)).any():
        return rec.end_time  # something never finished: show the whole run
    return float(end.max()) if end.size else rec.end_time


def load_figure(records: Mapping[str, RunRecord], gpu_of: Mapping[str, str],
                horizon_s: float) -> Figure:
    n = len(records)
    fig = Figure(figsize=(11, 2.3 * n + 0.6))
    axes = fig.subplots(n, 1, sharex=True, squeeze=False)[:, 0]
    classes = list(dict.fromkeys(gpu_of.values()))
    color = {g: PALETTE[i % len(PALETTE)] for i, g in enumerate(classes)}
    times = np.linspace(0.0, horizon_s, LOAD_POINTS)
    for ax, (name, rec) in zip(axes, records.items(), strict=True):
        for nid, counts in node_load(rec, times).items():
            ax.plot(times, counts, color=color[gpu_of[nid]], linewidth=0.9, alpha=0.8)
        ax.set_title(f"{name}: requests per node", fontsize=10, loc="left")
        ax.set_ylabel("requests")
        ax.grid(True, alpha=0.3)
    for g in classes:
        axes[0].plot([], [], color=color[g], label=g)
    axes[0].legend(loc="upper right", fontsize=8, ncol=len(classes))
    axes[-1].set_xlabel("simulated time (s)")
    return fig


def state_segments(rec: RunRecord) -> dict[str, list[tuple[float, float, str]]]:
    """Per node with events: ``(start, end, state)`` from the balancer's state events."""
    out: dict[str, list[tuple[float, float, str]]] = {}
    current: dict[str, tuple[float, str]] = {}
    for ev in sorted(rec.events, key=lambda e: e.t):
        if ev.kind != "state":
            continue
        t0, st = current.get(ev.node, (0.0, "healthy"))
        out.setdefault(ev.node, []).append((t0, ev.t, st))
        current[ev.node] = (ev.t, ev.state)
    for nid, (t0, st) in current.items():
        out[nid].append((t0, max(rec.end_time, t0), st))
    return out


def timeline_figure(records: Mapping[str, RunRecord]) -> Figure | None:
    segs = {name: state_segments(rec) for name, rec in records.items()}
    rows = [(name, nid) for name, per in segs.items() for nid in sorted(per)]
    if not rows:
        return None
    fig = Figure(figsize=(11, 0.32 * len(rows) + 1.2))
    ax = fig.subplots()
    for y, (name, nid) in enumerate(rows):
        for t0, t1, st in segs[name][nid]:
            ax.barh(y, t1 - t0, left=t0, height=0.8, color=STATE_COLORS.get(st, "#888888"))
    ax.set_yticks(range(len(rows)), [f"{name} / {nid}" for name, nid in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("simulated time (s)")
    ax.set_title("node states (nodes that left 'healthy' at least once)", fontsize=10, loc="left")
    handles = [Patch(color=c, label=st) for st, c in STATE_COLORS.items()]
    ax.legend(handles=handles, loc="upper center",
              bbox_to_anchor=(0.5, -0.25 if len(rows) > 3 else -0.5),
              ncol=len(STATE_COLORS), fontsize=8, frameon=False)
    return fig


def sweep_figure(sweep: Sequence[Mapping[str, Any]], target: float) -> Figure:
    fig = Figure(figsize=(11, 4))
    ax_att, ax_good = fig.subplots(1, 2)
    loads = [p["load"] for p in sweep]
    names = list(sweep[0]["results"]) if sweep else []
    for i, name in enumerate(names):
        color = PALETTE[i % len(PALETTE)]
        ax_att.plot(loads, [p["results"][name]["slo_attainment"] for p in sweep], "o-",
                    color=color, label=name)
        ax_good.plot(loads, [p["results"][name]["goodput_rps"] for p in sweep], "o-",
                     color=color, label=name)
    ax_att.axhline(target, color="#e5484d", linestyle="--", linewidth=1,
                   label=f"target {target:g}")
    ax_att.set_ylim(0, 1.02)
    ax_att.set_ylabel("SLO attainment")
    ax_good.plot(loads, [p["offered_rps"] for p in sweep], ":", color="#555555",
                 label="offered")
    ax_good.set_ylabel("goodput (req/s meeting the SLO)")
    for ax, title in ((ax_att, "SLO attainment against load"), (ax_good, "goodput against load")):
        ax.set_xlabel("offered load (share of the capacity bound)")
        ax.grid(True, alpha=0.3)
        ax.set_title(title)
        ax.legend(fontsize=8)
    return fig


def _results_table(doc: Mapping[str, Any]) -> str:
    head = ("policy", "offered/s", "completed", "failed", "TTFT p50", "TTFT p99", "TPOT p50",
            "TPOT p99", "SLO att.", "goodput/s")
    rows = []
    for name, r in doc["results"].items():
        cells = (name, f"{r['offered_rps']:.1f}", str(r["completed"]), str(r["failed"]),
                 f"{r['ttft_s']['p50']:.3f}", f"{r['ttft_s']['p99']:.3f}",
                 f"{r['tpot_s']['p50']:.4f}", f"{r['tpot_s']['p99']:.4f}",
                 f"{r['slo_attainment']:.4f}", f"{r['goodput_rps']:.2f}")
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    return ("<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"
            + "".join(rows) + "</table>")


def _prefix_table(doc: Mapping[str, Any]) -> str:
    """Prefix-cache use per policy ("" without shared prefixes)."""
    rows = []
    for name, r in doc["results"].items():
        p = r.get("prefix")
        if p is None:
            continue
        cells = (name, f"{p['hit_rate']:.3f}", f"{p['requests_hit']:.3f}",
                 f"{p['prefill_tokens_saved']:,}", f"{p['prefill_tokens']:,}",
                 f"{p['ttft_cached_s']['p99']:.3f}", f"{p['ttft_uncached_s']['p99']:.3f}")
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    if not rows:
        return ""
    head = ("policy", "hit rate", "requests hit", "prefill saved", "prefill done",
            "TTFT p99 cached", "TTFT p99 uncached")
    return ("<h2>Prefix caches</h2><table><tr>" + "".join(f"<th>{h}</th>" for h in head)
            + "</tr>" + "".join(rows) + "</table>")


def _sweep_table(sweep: Sequence[Mapping[str, Any]]) -> str:
    names = list(sweep[0]["results"]) if sweep else []
    head = "<tr><th>load</th><th>offered/s</th>" + "".join(
        f"<th>{html.escape(n)} att.</th>" for n in names) + "</tr>"
    rows = "".join(
        f"<tr><td>{p['load']:g}</td><td>{p['offered_rps']:.1f}</td>" + "".join(
            f"<td>{p['results'][n]['slo_attainment']:.4f}</td>" for n in names) + "</tr>"
        for p in sweep)
    return f"<table>{head}{rows}</table>"


def render_report(doc: Mapping[str, Any], records: Mapping[str, RunRecord], *,
                  gpu_of: Mapping[str, str], warmup_s: float, duration_s: float,
                  sweep: Sequence[Mapping[str, Any]] | None = None) -> tuple[str, dict[str, str]]:
    """The HTML page, and its figures as base64 PNGs by name (for saving on their own)."""
    slo = doc["slo"]
    figures: dict[str, str] = {}
    sections: list[str] = [f"<h2>Results</h2>{_results_table(doc)}{_prefix_table(doc)}"]
    if records:
        figures["latency_cdf"] = _png(cdf_figure(records, warmup_s, duration_s,
                                                 slo["ttft_s"], slo["tpot_s"]))
        sections.append(_figure("TTFT and TPOT distributions", "latency_cdf", figures,
                                f"completed requests that arrived in [{warmup_s:g} s, "
                                f"{duration_s:g} s); dashed: the SLO"))
        horizon = max(busy_until(rec) for rec in records.values())
        figures["node_load"] = _png(load_figure(records, gpu_of, horizon))
        sections.append(_figure("Load per node over time", "node_load", figures,
                                "requests assigned to each node, coloured by GPU class"))
        tl = timeline_figure(records)
        if tl is not None:
            figures["state_timeline"] = _png(tl)
            sections.append(_figure("Quarantine timeline", "state_timeline", figures,
                                    "state changes the balancer made"))
        else:
            sections.append("<h2>Quarantine timeline</h2><p>No node left the healthy "
                            "state in any policy.</p>")
    if sweep:
        figures["sweep"] = _png(sweep_figure(sweep, slo["attainment"]))
        sections.append(_figure("SLO attainment against load", "sweep", figures,
                                "each point a full run; the same requests for every "
                                "policy at a load") + _sweep_table(sweep))
    title = f"tailguard sim: {doc['scenario']}"
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 24px auto; max-width: 1240px; color: #1b1f24; }}
table {{ border-collapse: collapse; margin: 8px 0 16px; }}
td, th {{ border-bottom: 1px solid #d0d7de; padding: 3px 10px; text-align: right; }}
td:first-child, th:first-child {{ text-align: left; }}
img {{ max-width: 100%; }} .note {{ color: #57606a; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<p class="note">model {html.escape(str(doc['model']))}, seed {doc['seed']}, SLO TTFT
{slo['ttft_s']:g} s / TPOT {slo['tpot_s']:g} s (target {slo['attainment']:g}), capacity bound
{doc['capacity_bound_rps']:.1f} req/s</p>
{''.join(sections)}
</body></html>
"""
    return page, figures


def _figure(title: str, name: str, figures: Mapping[str, str], note: str) -> str:
    return (f"<h2>{html.escape(title)}</h2><p class='note'>{html.escape(note)}</p>"
            f"<img alt='{name}' src='data:image/png;base64,{figures[name]}'>")


def write_report(path: str | Path, doc: Mapping[str, Any], records: Mapping[str, RunRecord],
                 *, gpu_of: Mapping[str, str], warmup_s: float, duration_s: float,
                 sweep: Sequence[Mapping[str, Any]] | None = None,
                 figures_dir: str | Path | None = None) -> None:
    """Write the report to ``path`` (and each figure as PNG into ``figures_dir``)."""
    page, figures = render_report(doc, records, gpu_of=gpu_of, warmup_s=warmup_s,
                                  duration_s=duration_s, sweep=sweep)
    Path(path).write_text(page)
    if figures_dir is not None:
        d = Path(figures_dir)
        d.mkdir(parents=True, exist_ok=True)
        for name, b64 in figures.items():
            (d / f"{name}.png").write_bytes(base64.b64decode(b64))


def write_scenario_report(path: str | Path, scn: Scenario, opts: RunOptions,
                          doc: Mapping[str, Any],
                          records: Mapping[str, RunRecord],
                          figures_dir: str | Path | None = None) -> None:
    """:func:`write_report` for ``tailguard sim``: window and GPU classes from the scenario."""
    scn = with_options(scn, opts)
    gpu_of = {p.id: p.perf.gpu.name for p in scn.nodes()}
    write_report(path, doc, records, gpu_of=gpu_of, warmup_s=scn.workload.warmup_s,
                 duration_s=scn.workload.duration_s, sweep=doc.get("sweep"),
                 figures_dir=figures_dir)


__all__ = ["latencies", "node_load", "render_report", "state_segments", "write_report",
           "write_scenario_report"]
