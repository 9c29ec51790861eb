"""``tailguard epp``: the endpoint picker as a process.

Three listeners share one fleet (one :class:`~tailguard.adapters.live_fleet.LiveFleet`,
one balancer):

* the ext_proc gRPC service (``--grpc-port``, GIE's default 9002), which
  Envoy calls for every request (:mod:`tailguard.epp.picker`);
* the standard gRPC health service (``--grpc-health-port``, GIE's 9003) with
  the names ``liveness`` (the process answers), ``readiness`` and
  ``envoy.service.ext_proc.v3.ExternalProcessor`` (SERVING while some node is
  routable, re-checked every half second), and the overall ``""``;
* the gateway's HTTP app (``--listen``): ``/metrics``, ``/admin``, the
  dashboard, health checks and fleet reloads exactly as under ``tailguard
  serve``, and its ``/v1`` proxy too (requests through it and through Envoy
  are accounted by the same balancer).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from random import Random

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from tailguard.adapters.runtime import start_gc_tuning
from tailguard.config.fleet import FleetConfig
from tailguard.epp.picker import SERVICE, EndpointPicker
from tailguard.gateway.app import PROXY, RunningGateway, start_gateway

log = logging.getLogger("tailguard.epp")

READINESS_EVERY_S = 0.5
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(slots=True)
class RunningPicker:
    """An endpoint picker serving (what :func:`run_epp` yields)."""

    gateway: RunningGateway
    picker: EndpointPicker
    grpc_port: int
    health_port: int
    server: grpc.aio.Server
    health_server: grpc.aio.Server
    readiness: asyncio.Task[None]

    @property
    def url(self) -> str:
        """The HTTP app's base URL (metrics, admin, dashboard)."""
        return self.gateway.url

    async def stop(self, grace_s: float = 1.0) -> None:
        self.readiness.cancel()
        await self.server.stop(grace_s)
        await self.health_server.stop(0)
        await self.gateway.runner.cleanup()


async def start_epp(config: FleetConfig, grpc_port: int = 9002, health_port: int = 9003,
                    host: str = "127.0.0.1", http_host: str | None = None,
                    http_port: int | None = None, rng: Random | None = None,
                    objectives: dict[str, int] | None = None,
                    single_endpoint: bool = False,
                    tls: tuple[str, str] | None = None) -> RunningPicker:
    """Start the picker (port 0: a free one, for each of the three). ``tls``: the
    certificate and key files (PEM) the ext_proc port serves TLS with; the gateways
    that dial their picker over TLS (Istio's guide, Envoy AI Gateway) need it."""
    gw = await start_gateway(config, http_host, http_port, rng)
    try:
        picker = EndpointPicker(gw.fleet, gw.metrics, objectives, gw.app[PROXY].gate,
                                single_endpoint)
        # A buffered body comes in one message: room for the largest the fleet accepts.
        size = config.max_body_bytes + (1 << 20)
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0),
                                          ("grpc.max_receive_message_length", size),
                                          ("grpc.max_send_message_length", size)])
        pb_grpc.add_ExternalProcessorServicer_to_server(picker, server)
        if tls is not None:
            cert, key = (Path(f).read_bytes() for f in tls)
            port = server.add_secure_port(f"{host}:{grpc_port}",
                                          grpc.ssl_server_credentials([(key, cert)]))
        else:
            port = server.add_insecure_port(f"{host}:{grpc_port}")
        health = health_aio.HealthServicer()
        health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(health, health_server)
        hport = health_server.add_insecure_port(f"{host}:{health_port}")
        await health.set("liveness", _SERVING)
        await server.start()
        await health_server.start()
    except BaseException:
        await gw.runner.cleanup()
        raise
    task = asyncio.create_task(_readiness(gw, health), name="epp-readiness")
    return RunningPicker(gw, picker, port, hport, server, health_server, task)


async def _readiness(gw: RunningGateway, health: health_aio.HealthServicer) -> None:
    """Ready while some node is routable: Envoy (and Kubernetes) stop sending otherwise."""
    last = None
    while True:
        status = _SERVING if gw.fleet.ready() else _NOT_SERVING
        if status != last:
            for name in ("", "readiness", SERVICE):
                await health.set(name, status)
            last = status
        await asyncio.sleep(READINESS_EVERY_S)


@asynccontextmanager
async def run_epp(config: FleetConfig, **kwargs: object) -> AsyncIterator[RunningPicker]:
    """:func:`start_epp` for the ``async with`` body (tests, benchmarks)."""
    epp = await start_epp(config, **kwargs)  # type: ignore[arg-type]
    try:
        yield epp
    finally:
        await epp.stop()


async def serve_epp(config: FleetConfig, grpc_port: int, health_port: int, host: str,
                    http_host: str | None, http_port: int | None,
                    objectives: dict[str, int] | None = None,
                    single_endpoint: bool = False,
                    tls: tuple[str, str] | None = None) -> None:
    epp = await start_epp(config, grpc_port, health_port, host, http_host, http_port,
                          objectives=objectives, single_endpoint=single_endpoint, tls=tls)
    collector = start_gc_tuning()  # as under serve: every message allocates
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if hasattr(signal, "SIGHUP"):
        loop.add_signal_handler(signal.SIGHUP, epp.gateway.reloader.trigger)
    print(f"tailguard epp: ext_proc on {host}:{epp.grpc_port}, gRPC health on "
          f"{host}:{epp.health_port}; metrics at {epp.url}/metrics, dashboard at "
          f"{epp.url}/dashboard", file=sys.stderr, flush=True)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await epp.stop(config.shutdown_timeout_s)
        if collector is not None:
            collector.cancel()


__all__ = ["RunningPicker", "run_epp", "serve_epp", "start_epp"]
