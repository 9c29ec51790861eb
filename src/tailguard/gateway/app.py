"""The gateway application: routes, background work, and how to run it.

:func:`build_app` wires one :class:`~tailguard.adapters.live_fleet.LiveFleet`
(the balancer and the fleet's state), the :class:`~tailguard.gateway.proxy.Proxy`
(the ``/v1`` request path), the :class:`~tailguard.gateway.admin.AdminApi`,
the Prometheus registry and the fleet-file reloader into an
:class:`aiohttp.web.Application`. Its startup opens the one upstream
:class:`aiohttp.ClientSession` (a keep-alive pool per node, no global cap: the
balancer decides how much each node gets) and starts the monitors and the
balancer's tick; its cleanup stops them after in-flight requests ended.
The request path itself uses the lean keep-alive client of
:mod:`~tailguard.adapters.upstream` (a quarter of aiohttp's CPU per request);
health checks, scrapes and webhooks use the aiohttp session.

:func:`run_gateway` runs it on a socket for tests, demos and benchmarks::

    async with run_gateway(load_fleet("fleet.yaml"), port=0) as gw:
        print(gw.url)          # http://127.0.0.1:<free port>
        gw.fleet.balancer      # the live decision core

``tailguard serve`` (:mod:`tailguard.gateway.server`) runs the same app on
uvloop with signal handling.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from random import Random

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tailguard.adapters.api_errors import error_response
from tailguard.adapters.discovery import KubernetesDiscovery
from tailguard.adapters.live_fleet import LiveFleet
from tailguard.adapters.logs import add_request_id_header, request_log
from tailguard.adapters.metrics import GatewayMetrics
from tailguard.adapters.remediation import Remediator
from tailguard.adapters.upstream import UpstreamClient
from tailguard.config.fleet import FleetConfig
from tailguard.gateway.admin import AdminApi
from tailguard.gateway.connections import ClientConnections, GuardedRunner
from tailguard.gateway.dashboard import Dashboard, setup_dashboard
from tailguard.gateway.gpu_metrics import GpuCollector
from tailguard.gateway.outlier_metrics import OutlierCollector
from tailguard.gateway.proxy import Proxy, authorized
from tailguard.gateway.recording import DecisionFile
from tailguard.gateway.reload import ConfigReloader
from tailguard.gateway.upstream_metrics import UpstreamCollector

log = logging.getLogger("tailguard.gateway")

FLEET = web.AppKey("fleet", LiveFleet)
METRICS = web.AppKey("metrics", GatewayMetrics)
PROXY = web.AppKey("proxy", Proxy)
RELOADER = web.AppKey("reloader", ConfigReloader)
DASHBOARD = web.AppKey("dashboard", Dashboard)
CONNECTIONS = web.AppKey("connections", ClientConnections)
DISCOVERY = web.AppKey("discovery", list)

# Shorter than the 5 s keep-alive of uvicorn (vLLM, SGLang) so that the
# gateway never reuses a connection the engine is closing at that moment.
UPSTREAM_KEEPALIVE_S = 4.0
# aiohttp's own body limit is lifted: the proxy enforces max_body_bytes with an
# OpenAI-shaped 413, and the limit can change on reload.
_NO_AIOHTTP_BODY_LIMIT = 1 << 40


def build_app(config: FleetConfig, rng: Random | None = None,
              record: str | Path | None = None) -> web.Application:
    """The gateway for ``config``; ``rng`` seeds the routing policies' randomness.

    ``record``: write every balancer input and decision to this JSONL file.
    """
    recorder = DecisionFile(record) if record is not None else None
    fleet = LiveFleet(config, rng, recorder)
    metrics = GatewayMetrics(fleet)
    proxy = Proxy(fleet, metrics)
    reloader = ConfigReloader(fleet, metrics)
    admin = AdminApi(fleet)
    remediator = Remediator(fleet, fleet.event_log, metrics.remediation)
    fleet.event_listeners.append(remediator.on_event)
    metrics.registry.register(OutlierCollector(fleet))
    metrics.registry.register(GpuCollector(fleet))
    metrics.registry.register(UpstreamCollector(fleet, proxy))
    app = web.Application(client_max_size=_NO_AIOHTTP_BODY_LIMIT, middlewares=[request_log])
    app.on_response_prepare.append(add_request_id_header)
    app[FLEET] = fleet
    app[METRICS] = metrics
    app[PROXY] = proxy
    app[RELOADER] = reloader
    connections = ClientConnections(lambda: fleet.config.client, metrics.client_closed_reason)
    metrics.watch_connections(lambda: connections.open)
    app[CONNECTIONS] = connections
    app.add_routes([
        web.post("/v1/chat/completions", proxy.chat),
        web.post("/v1/completions", proxy.completions),
        web.post("/v1/embeddings", proxy.embeddings),
        *_service_routes(fleet, metrics),
        *admin.routes(),
        web.route("*", "/v1/{tail:.*}", _unknown_route),
    ])
    app[DASHBOARD] = setup_dashboard(app, fleet)
    _add_lifecycle(app, fleet, proxy, reloader, remediator, recorder)
    return app


def _service_routes(fleet: LiveFleet, metrics: GatewayMetrics) -> list[web.RouteDef]:
    """The model list, liveness, readiness and the Prometheus page."""
    started = time.time()

    async def models(request: web.Request) -> web.StreamResponse:
        keys = fleet.config.api_keys
        if keys and not authorized(request, keys):
            return error_response(401, "invalid or missing API key (Authorization: Bearer ...)",
                                  "invalid_api_key")
        data = [{"id": m, "object": "model", "created": int(started), "owned_by": "tailguard"}
                for m in fleet.served_models()]
        return web.Response(text=json.dumps({"object": "list", "data": data}),
                            content_type="application/json")

    async def health(request: web.Request) -> web.StreamResponse:
        return web.Response(text="ok\n")

    async def ready(request: web.Request) -> web.StreamResponse:
        if fleet.ready():
            return web.Response(text="ready\n")
        return error_response(503, "no routable node", "not_ready", headers={"Retry-After": "1"})

    async def prometheus(request: web.Request) -> web.StreamResponse:
        body = generate_latest(metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    return [web.get("/v1/models", models), web.get("/health", health),
            web.get("/ready", ready), web.get("/metrics", prometheus)]


async def _unknown_route(request: web.Request) -> web.StreamResponse:
    return error_response(404, f"no route {request.method} {request.path}", "not_found")


def _add_lifecycle(app: web.Application, fleet: LiveFleet, proxy: Proxy,
                   reloader: ConfigReloader, remediator: Remediator,
                   recorder: DecisionFile | None) -> None:
    """Start the gateway's side work with the app (upstream client, health checks and
    scrapes, discovery, reloads) and stop it, and close the recording, with it."""
    config = fleet.config
    side: list[aiohttp.ClientSession] = []  # health checks, scrapes, webhooks
    discovery: list[KubernetesDiscovery] = []  # with discovery: in the fleet file
    app[DISCOVERY] = discovery

    async def startup(app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0,
                                         keepalive_timeout=UPSTREAM_KEEPALIVE_S,
                                         ttl_dns_cache=60)
        session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                        timeout=aiohttp.ClientTimeout(total=None))
        side.append(session)
        proxy.upstream = UpstreamClient(keepalive_s=UPSTREAM_KEEPALIVE_S)
        remediator.session = session
        await fleet.start(session)
        if config.discovery is not None:
            discovery.append(KubernetesDiscovery(fleet, config.discovery))
            discovery[0].start()
        reloader.start()
        for w in config.warnings:
            log.warning("%s", w)

    async def cleanup(app: web.Application) -> None:
        for d in discovery:
            await d.stop()
        await reloader.stop()
        await fleet.stop()
        await remediator.stop()
        while side:
            await side.pop().close()
        if proxy.upstream is not None:
            proxy.upstream.close()
            proxy.upstream = None
        if recorder is not None:
            recorder.close()

    app.on_startup.append(startup)
    app.on_cleanup.append(cleanup)


@dataclass(frozen=True, slots=True)
class RunningGateway:
    """A gateway serving on a socket (what :func:`run_gateway` yields)."""

    app: web.Application
    runner: web.AppRunner
    host: str
    port: int

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:8080`` (the OpenAI base_url is ``url + "/v1"``)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def fleet(self) -> LiveFleet:
        return self.app[FLEET]

    @property
    def metrics(self) -> GatewayMetrics:
        return self.app[METRICS]

    @property
    def reloader(self) -> ConfigReloader:
        return self.app[RELOADER]


def make_runner(app: web.Application, shutdown_timeout_s: float,
                access_log: bool = False) -> web.AppRunner:
    """The runner both ``serve`` and :func:`run_gateway` use.

    Handlers are cancelled when their client disconnects, so an abandoned
    request stops its upstream generation at once (the proxy's ``finally``
    releases the permit); no access log by default (a line per request is a
    large share of the request path's own cost; the request log has them). Its connections follow the fleet file's ``client`` rules
    (:mod:`~tailguard.gateway.connections`).
    """
    kwargs: dict[str, object] = {"handler_cancellation": True,
                                 "shutdown_timeout": shutdown_timeout_s}
    if not access_log:
        kwargs["access_log"] = None
    return GuardedRunner(app, app[CONNECTIONS], **kwargs)


async def start_gateway(config: FleetConfig, host: str | None = None, port: int | None = None,
                        rng: Random | None = None, access_log: bool = False,
                        record: str | Path | None = None) -> RunningGateway:
    """Start serving ``config`` (``host``/``port`` override ``listen``; port 0: a free one)."""
    app = build_app(config, rng, record)
    runner = make_runner(app, config.shutdown_timeout_s, access_log)
    await runner.setup()
    bind_host = host if host is not None else config.listen[0]
    bind_port = port if port is not None else config.listen[1]
    site = web.TCPSite(runner, bind_host, bind_port, backlog=1024, reuse_address=True)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    actual = bind_port
    for addr in runner.addresses:
        if isinstance(addr, tuple) and len(addr) >= 2:
            actual = int(addr[1])
            break
    return RunningGateway(app, runner, bind_host, actual)


@asynccontextmanager
async def run_gateway(config: FleetConfig, host: str = "127.0.0.1", port: int = 0,
                      rng: Random | None = None,
                      record: str | Path | None = None) -> AsyncIterator[RunningGateway]:
    """Serve ``config`` on ``host:port`` (0: a free port) for the ``async with`` body."""
    gw = await start_gateway(config, host, port, rng, record=record)
    try:
        yield gw
    finally:
        await gw.runner.cleanup()
