"""The live web dashboard: ``GET /dashboard`` and its JSON feed ``GET /dashboard/state``.

The page (``static/dashboard.html``) is one self-contained file: inline CSS,
hand-written SVG charts in plain JavaScript, nothing fetched from anywhere but
this gateway, so it works on a closed network. It polls the state feed about
once a second and keeps the short history it plots (TPOT, in flight, state
lanes) in the browser: the gateway stores nothing per poll.

The feed is read from the live fleet at request time, like the Prometheus
gauges: per node its GPU class, state, in flight against its concurrency
limit (the limiter's when the core has one, else the engine's slots), TTFT
and TPOT estimates against the pool's SLO, decode/prefill slowdowns against
the roofline prior and against its class, and its capacity estimate; per
pool its SLO, queue depth and state counts; and the recent events.

Events come from two places, so that the timeline shows every state change
whoever made it:

* the fleet's event log (``GET /admin/events``: what
  :meth:`~tailguard.core.balancer.Balancer.tick` returned, i.e. detections,
  quarantines, probations, and the remediation actions with their results,
  and operator cordons), read every 0.25 s; without one, the balancer's
  events through ``LiveFleet.event_listeners``;
* a watcher that compares node states at the same pace and records changes no
  event announced (an operator's drain, a health check marking a node down).

Like ``/metrics``, the dashboard needs no token: it shows node ids, GPU
classes and load, never URLs, labels or keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import deque
from importlib import resources
from typing import Any

from aiohttp import web

from tailguard.adapters.live_fleet import LiveFleet
from tailguard.core.events import Event
from tailguard.core.snapshot import FleetSnapshot, NodeSnapshot

WATCH_INTERVAL_S = 0.25
MAX_EVENTS = 500


class Dashboard:
    """Serves the page and its state feed, and keeps the recent events."""

    def __init__(self, fleet: LiveFleet) -> None:
        self.fleet = fleet
        self.events: deque[dict[str, Any]] = deque(maxlen=MAX_EVENTS)
        self._states: dict[str, str] = {}
        self._primed = False  # the first look records states, not changes
        self._log_seq = 0  # last entry read from the fleet's event log
        self._task: asyncio.Task[None] | None = None
        self._page: bytes | None = None
        self._started = time.time()
        if getattr(fleet, "event_log", None) is None:
            fleet.event_listeners.append(self.on_event)

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/dashboard", self.page), web.get("/dashboard/state", self.state)]

    # -- lifecycle (app startup/cleanup) ------------------------------------------

    async def start(self, app: web.Application) -> None:
        self._watch()  # the initial states are not changes
        self._task = asyncio.create_task(self._watch_loop(), name="dashboard-watch")

    async def stop(self, app: web.Application) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _watch_loop(self) -> None:
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            self._watch()

    def _watch(self) -> None:
        nodes = self.fleet.balancer.states()
        first = not self._primed
        self._primed = True
        self._read_event_log(first)
        for node_id, node_state in nodes.items():
            state = node_state.value
            before = self._states.get(node_id)
            if before != state:
                self._states[node_id] = state
                if not first and before is not None:
                    self._add(time.time(), node_id, "state", state, f"was {before}")
                elif not first:
                    self._add(time.time(), node_id, "added", state, "joined the fleet")
        for node_id in [n for n in self._states if n not in nodes]:
            del self._states[node_id]
            self._add(time.time(), node_id, "removed", "removed", "left the fleet")

    # -- events ----------------------------------------------------------------------

    def _read_event_log(self, first: bool) -> None:
        log = getattr(self.fleet, "event_log", None)
        if log is None:
            return
        for e in log.since(self._log_seq):
            self._log_seq = e["seq"]
            node, kind, state = str(e.get("node", "-")), str(e.get("kind", "")), e.get("state")
            if kind == "state" and isinstance(state, str):
                self._states[node] = state  # announced: the watcher must not repeat it
            if first:
                continue  # history from before the dashboard started
            if kind == "action":  # a remediation: its action, result and detail
                state = str(e.get("result", ""))
                reason = f"{e.get('action', '')} on {e.get('trigger', '')}: {e.get('detail', '')}"
            else:
                reason = str(e.get("reason", ""))
            self._add(float(e.get("time", time.time())), node, kind, str(state or ""), reason,
                      str(e.get("advice", "")))

    def on_event(self, ev: Event) -> None:
        """An event from the balancer's tick (its ``t`` is the monotonic clock)."""
        wall = time.time() - (time.monotonic() - ev.t)
        if ev.kind == "state":
            self._states[ev.node] = ev.state  # announced: the watcher must not repeat it
        self._add(wall, ev.node, ev.kind, ev.state, ev.reason, ev.advice)

    def _add(self, t: float, node: str, kind: str, state: str, reason: str,
             advice: str = "") -> None:
        self.events.append({"t": round(t, 3), "node": node, "kind": kind, "state": state,
                            "reason": reason, **({"advice": advice} if advice else {})})

    # -- handlers ------------------------------------------------------------------

    async def page(self, request: web.Request) -> web.StreamResponse:
        if self._page is None:
            self._page = (resources.files("tailguard.gateway") / "static" /
                          "dashboard.html").read_bytes()
        return web.Response(body=self._page, content_type="text/html", charset="utf-8",
                            headers={"Cache-Control": "no-cache"})

    async def state(self, request: web.Request) -> web.StreamResponse:
        return web.Response(text=json.dumps(self.snapshot()), content_type="application/json",
                            headers={"Cache-Control": "no-store"})

    def snapshot(self) -> dict[str, Any]:
        """What the page draws (also handy for tests and scripts)."""
        snap = self.fleet.balancer.snapshot(time.monotonic())
        nodes = list(snap.nodes.values())
        pools = []
        for name, pool in snap.pools.items():
            if not pool.nodes:
                continue
            slo = pool.config.slo
            pools.append({
                "name": name,
                "policy": pool.config.policy,
                "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s,
                        "attainment": slo.attainment},
                "nodes": len(pool.nodes),
                "states": {st.value: n for st, n in pool.states.items() if n},
                "queue_depth": pool.queue_depth,
                "shed_total": sum(pool.shed_total.values()),
                "capacity_tokens_per_s": round(pool.capacity_tokens_per_s, 1),
                "migrations": pool.moved,
            })
        classes: dict[str, dict[str, Any]] = {}
        for n in nodes:
            c = classes.setdefault(n.gpu_class, {
                "gpu": n.gpu_class, "nodes": [],
                "decode_slowdown": round(n.class_decode_slowdown, 4),
                "prefill_slowdown": round(n.class_prefill_slowdown, 4)})
            c["nodes"].append(n.id)
        return {
            "now": round(time.time(), 3),
            "started": round(self._started, 3),
            "pools": pools,
            "classes": list(classes.values()),
            "nodes": [self._node(n, snap) for n in nodes],
            "events": list(self.events)[-100:],
        }

    def _node(self, n: NodeSnapshot, snap: FleetSnapshot) -> dict[str, Any]:
        mon = self.fleet.monitors.get(n.id)
        pool = snap.pools.get(n.spec.models[0]) if n.spec.models else None
        slo = pool.config.slo if pool is not None else None
        engine = n.engine
        return {
            "id": n.id,
            "gpu": n.gpu_class,
            "role": n.spec.role,
            "state": n.state.value,
            "pool": pool.name if pool is not None else None,
            "in_flight": n.in_flight,
            "limit": n.limit,
            "slots": n.slots,
            "dispatched_total": n.dispatched_total,
            "ttft_s": round(n.ttft_s, 5) if n.ttft_s is not None else None,
            "tpot_s": round(n.tpot_s, 5) if n.tpot_s is not None else None,
            "slo_ttft_s": slo.ttft_s if slo else None,
            "slo_tpot_s": slo.tpot_s if slo else None,
            "decode_slowdown": round(n.decode_slowdown, 4),
            "prefill_slowdown": round(n.prefill_slowdown, 4),
            "slowness": round(n.slowness, 4),
            "weight_scale": round(n.weight_scale, 4),
            "capacity_tokens_per_s": round(n.capacity_tokens_per_s, 1),
            "up": mon.up if mon is not None else None,
            "engine_running": engine.running if engine.running >= 0 else None,
            "engine_waiting": engine.waiting if engine.waiting >= 0 else None,
            "kv_usage": round(engine.kv_usage, 4) if engine.kv_usage >= 0 else None,
            # From the node's DCGM page (dcgm_url), when it has one.
            "gpus": [{"gpu": g.index, "temp_c": g.temp_c, "clock_ratio": g.clock_ratio,
                      "fb_used_mib": g.fb_used_mib, "slowdowns": g.slowdowns()}
                     for g in mon.gpus] if mon is not None else [],
            "gpu_cause": mon.gpu_cause() if mon is not None else None,
        }


def setup_dashboard(app: web.Application, fleet: LiveFleet) -> Dashboard:
    """Add the dashboard's routes and its watcher to ``app``."""
    dash = Dashboard(fleet)
    app.add_routes(dash.routes())
    app.on_startup.append(dash.start)
    app.on_cleanup.append(dash.stop)
    return dash


__all__ = ["Dashboard", "setup_dashboard"]
