"""The admin API: look at the live fleet and change it at run time.

Off unless ``admin.token_env`` names an environment variable holding a token
(every route then answers 404). Each request must carry
``Authorization: Bearer <token>``, compared in constant time (401 otherwise).

* ``GET /admin/nodes``: the live state of every node (GPU, state, in flight,
  capacity estimate, TTFT/TPOT estimates, scraped engine metrics, health).
* ``POST /admin/nodes``: register a node; the body is one ``nodes:`` entry of
  the fleet file. Its URL's host must be in ``admin.allow`` (hosts or CIDR
  networks), else 400: the gateway must not become a way to reach arbitrary
  hosts. 409 for an id in use.
* ``POST /admin/nodes/{id}/drain``: no new requests; in-flight ones finish.
* ``POST /admin/nodes/{id}/resume``: back into rotation after a drain.
* ``DELETE /admin/nodes/{id}``: drain, then remove once idle (202).
* ``POST /admin/nodes/{id}/cordon`` / ``uncordon``: out of rotation by hand
  (the outlier detector leaves a cordoned node alone) and back (409 unless
  cordoned).
* ``GET /admin/events[?since=SEQ]``: the recent core events (state changes,
  detections) and remediation results (:mod:`tailguard.adapters.event_log`).

Registered nodes live until removed or restart; a reload of the fleet file
leaves them alone.
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from tailguard.adapters.api_errors import error_response
from tailguard.adapters.live_fleet import LiveFleet
from tailguard.config.fleet import parse_node
from tailguard.core.fleet import NodeState
from tailguard.core.snapshot import NodeSnapshot
from tailguard.errors import ConfigError

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, text=json.dumps(data, indent=1),
                        content_type="application/json")


class AdminApi:
    def __init__(self, fleet: LiveFleet) -> None:
        self.fleet = fleet

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/admin/nodes", self._guard(self.list_nodes)),
            web.post("/admin/nodes", self._guard(self.register)),
            web.post("/admin/nodes/{id}/drain", self._guard(self.drain)),
            web.post("/admin/nodes/{id}/resume", self._guard(self.resume)),
            web.delete("/admin/nodes/{id}", self._guard(self.delete)),
            web.post("/admin/nodes/{id}/cordon", self._guard(self.cordon)),
            web.post("/admin/nodes/{id}/uncordon", self._guard(self.uncordon)),
            web.get("/admin/events", self._guard(self.events)),
        ]

    def _guard(self, handler: Handler) -> Handler:
        async def guarded(request: web.Request) -> web.StreamResponse:
            token = self.fleet.config.admin.token()
            if token is None:
                return error_response(404, "the admin API is off (set admin.token_env and the "
                                           "variable it names)", "admin_disabled")
            header = request.headers.get("Authorization", "")
            given = header[7:].strip() if header.startswith("Bearer ") else ""
            if not hmac.compare_digest(given.encode(), token.encode()):
                return error_response(401, "admin token missing or wrong "
                                           "(Authorization: Bearer ...)", "invalid_admin_token")
            return await handler(request)

        return guarded

    def _node(self, request: web.Request) -> NodeSnapshot | None:
        """The node the path names, as the read model has it now (None: no such node)."""
        return self.fleet.balancer.snapshot(time.monotonic()).nodes.get(request.match_info["id"])

    async def list_nodes(self, request: web.Request) -> web.StreamResponse:
        snap = self.fleet.balancer.snapshot(time.monotonic())
        body: dict[str, Any] = {"nodes": [self.describe(n) for n in snap.nodes.values()]}
        if self.fleet.shared is not None:
            body["shared_state"] = self.fleet.shared.status()
        return _json(body)

    async def register(self, request: web.Request) -> web.StreamResponse:
        try:
            raw = await request.json()
        except ValueError:
            return error_response(400, "the body must be a JSON node entry", "invalid_json")
        try:
            node = parse_node(raw, "node", self.fleet.config.catalog)
        except ConfigError as exc:
            return error_response(400, str(exc), "invalid_node")
        if not self.fleet.config.admin.url_allowed(node.url):
            allow = ", ".join(self.fleet.config.admin.allow) or "(empty: set admin.allow)"
            return error_response(400, f"node.url {node.url!r} is not in the allow-list "
                                       f"({allow})", "url_not_allowed")
        if node.id in self.fleet.balancer.nodes:
            return error_response(409, f"node id {node.id!r} is in use", "node_exists")
        self.fleet.add_node(node, dynamic=True)
        return _json(self.describe_now(node.id), 201)

    async def drain(self, request: web.Request) -> web.StreamResponse:
        node = self._node(request)
        if node is None:
            return error_response(404, "no such node", "node_not_found")
        self.fleet.set_state(node.id, NodeState.DRAINING)
        return _json(self.describe_now(node.id))

    async def resume(self, request: web.Request) -> web.StreamResponse:
        node = self._node(request)
        if node is None:
            return error_response(404, "no such node", "node_not_found")
        if self.fleet.retiring(node.id):
            return error_response(409, "the node is being removed", "node_retiring")
        self.fleet.set_state(node.id, NodeState.HEALTHY)
        return _json(self.describe_now(node.id))

    async def cordon(self, request: web.Request) -> web.StreamResponse:
        """Out of rotation by hand; the outlier detector leaves a cordoned node alone."""
        node = self._node(request)
        if node is None:
            return error_response(404, "no such node", "node_not_found")
        self.fleet.set_state(node.id, NodeState.CORDONED)
        self.fleet.event_log.add({"node": node.id, "kind": "state", "state": "cordoned",
                                  "reason": "operator"})
        return _json(self.describe_now(node.id))

    async def uncordon(self, request: web.Request) -> web.StreamResponse:
        node = self._node(request)
        if node is None:
            return error_response(404, "no such node", "node_not_found")
        if node.state is not NodeState.CORDONED:
            return error_response(409, f"the node is {node.state.value}, not cordoned",
                                  "node_not_cordoned")
        self.fleet.set_state(node.id, NodeState.HEALTHY)
        self.fleet.event_log.add({"node": node.id, "kind": "state", "state": "healthy",
                                  "reason": "operator: uncordon"})
        return _json(self.describe_now(node.id))

    async def events(self, request: web.Request) -> web.StreamResponse:
        """Recent core events and remediation results; ``?since=<seq>`` for newer ones."""
        try:
            since = int(request.query.get("since", "0"))
        except ValueError:
            return error_response(400, "since must be an integer", "invalid_since")
        return _json({"events": self.fleet.event_log.since(since)})

    async def delete(self, request: web.Request) -> web.StreamResponse:
        node = self._node(request)
        if node is None:
            return error_response(404, "no such node", "node_not_found")
        self.fleet.retire(node.id)
        return _json(self.describe_now(node.id), 202)

    def describe_now(self, node_id: str) -> dict[str, Any]:
        """:meth:`describe` of a node as it is now."""
        return self.describe(self.fleet.balancer.snapshot(time.monotonic()).nodes[node_id])

    def describe(self, node: NodeSnapshot) -> dict[str, Any]:
        fleet = self.fleet
        cfg = fleet.nodes.get(node.id)
        mon = fleet.monitors.get(node.id)
        now = time.monotonic()
        engine: dict[str, Any] | None = None
        health: dict[str, Any] | None = None
        gpus: dict[str, Any] | None = None
        if mon is not None:
            age = mon.metrics_age(now)
            engine = {
                "engine": mon.engine,
                "running": mon.sample.running if mon.sample else None,
                "waiting": mon.sample.waiting if mon.sample else None,
                "kv_usage": mon.sample.kv_usage if mon.sample and mon.sample.kv_usage >= 0
                else None,
                "preemptions": mon.sample.preemptions if mon.sample
                and mon.sample.preemptions >= 0 else None,
                "age_s": round(age, 3) if age is not None else None,
                "stale": mon.stale,
                "missing": mon.metrics_missing,
                "scrape_errors": mon.scrape_errors,
            }
            health = {"up": mon.up, "checks_failed": node.probes_failed,
                      "last_error": mon.last_error}
            if mon.node.dcgm_url:
                gpus = {"gpus": [g.as_dict() for g in mon.gpus],
                        "age_s": round(now - mon.gpus_at, 3) if mon.gpus_at >= 0 else None,
                        "cause": mon.gpu_cause(), "warning": mon.gpu_warning or None,
                        "error": mon.dcgm_error}
        return {
            "id": node.id,
            "url": cfg.url if cfg else node.spec.url,
            "gpu": node.spec.gpu_name,
            "gpu_class": node.spec.gpu_class,
            "gpu_known": node.spec.gpu is not None,
            "tp": node.spec.tp,
            "role": node.spec.role,  # prefill, decode or both (disaggregated serving)
            "models": list(node.spec.models),
            "labels": dict(node.spec.labels),
            "state": node.state.value,
            "registered": node.id in fleet.dynamic,
            "retiring": fleet.retiring(node.id),
            "in_flight": node.in_flight,
            # On the node from the other gateway replicas (shared_state), as they last said.
            "in_flight_elsewhere": node.in_flight_elsewhere,
            "prefilling": node.prefilling,
            "decoding": node.decoding,
            "slots": node.slots,
            # Concurrency limit (core/limits.py): None when the pool has no limits.
            "limit": None if node.limiter is None else {
                "limit": node.limiter.limit, "in_use": node.limiter.in_use,
                "allowed_here": node.limiter.allowed_here,
                "successes": node.limiter.successes, "dropped": node.limiter.dropped,
                "ignored": node.limiter.ignored},
            "dispatched_total": node.dispatched_total,
            "capacity": {
                "decode_slowdown": node.decode_slowdown,
                "prefill_slowdown": node.prefill_slowdown,
                "tokens_per_s": node.capacity_tokens_per_s,
            },
            "ttft_s": node.ttft_s,
            "tpot_s": node.tpot_s,
            "latency_s": node.latency_s,
            "engine_metrics": engine,
            "health": health,
            "telemetry": gpus,
            "outliers": None if node.outliers is None else {
                "slowness": round(node.outliers.slowness, 3),
                "weight_scale": round(node.weight_scale, 3),
                "ejections": node.outliers.ejections,
                "consecutive_failures": node.outliers.consecutive_failures,
                "stalls": node.stalls, "stalled_s": round(node.stalled_s, 3)},
        }
