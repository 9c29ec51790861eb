"""``tailguard serve``: the gateway as a long-running process.

One process, one event loop (uvloop where installed: its faster socket and
timer handling is most of what separates a Python proxy that adds 1 ms from
one that adds 3). Signals:

* ``SIGTERM`` / ``SIGINT``: graceful shutdown. The listening socket closes at
  once, in-flight requests (streams included) get up to
  ``shutdown_timeout_s`` (default 30 s) to finish, then the rest are cut.
* ``SIGHUP``: reload the fleet file (it is also reloaded when it changes).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
import tracemalloc
from pathlib import Path

from tailguard.adapters.runtime import loop_factory, start_gc_tuning
from tailguard.config.fleet import FleetConfig
from tailguard.gateway.app import start_gateway
from tailguard.gateway.connections import default_max_connections, raise_fd_limit

log = logging.getLogger("tailguard.gateway")


async def serve_forever(config: FleetConfig, host: str | None = None, port: int | None = None,
                        access_log: bool = False, record: str | None = None) -> None:
    """Serve until SIGTERM/SIGINT, reloading on SIGHUP."""
    fds = raise_fd_limit()  # before the first connection: the default cap derives from it
    log.info("file descriptors: up to %d (client connections capped at %s)", fds,
             config.client.max_connections or default_max_connections())
    gw = await start_gateway(config, host, port, access_log=access_log, record=record)
    collector = start_gc_tuning()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if hasattr(signal, "SIGHUP"):
        loop.add_signal_handler(signal.SIGHUP, gw.reloader.trigger)
    snapshots = os.environ.get("TAILGUARD_TRACEMALLOC_DIR")
    if snapshots and hasattr(signal, "SIGUSR1"):
        loop.add_signal_handler(signal.SIGUSR1, _tracemalloc_snapshot, Path(snapshots))
    nodes = len(config.nodes)
    print(f"tailguard gateway on {gw.url} ({nodes} node{'s' * (nodes != 1)}, models: "
          f"{', '.join(config.models) or 'none'}); metrics at {gw.url}/metrics, dashboard at "
          f"{gw.url}/dashboard",
          file=sys.stderr, flush=True)
    try:
        await stop.wait()
        log.info("shutting down: waiting up to %g s for %d request(s) in flight",
                 config.shutdown_timeout_s, gw.fleet.in_flight())
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        if hasattr(signal, "SIGHUP"):
            loop.remove_signal_handler(signal.SIGHUP)
        await gw.runner.cleanup()
        if collector is not None:
            collector.cancel()


def _tracemalloc_snapshot(folder: Path) -> None:
    """SIGUSR1 with ``TAILGUARD_TRACEMALLOC_DIR`` set: write a tracemalloc snapshot there.

    For hunting leaks (``benchmarks/soak.py --tracemalloc`` diffs two of them);
    tracing starts at the first signal, so the first snapshot is the baseline.
    """
    if not tracemalloc.is_tracing():
        tracemalloc.start(12)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"snapshot-{time.time():.0f}.pickle"
    tracemalloc.take_snapshot().dump(str(path))
    log.info("tracemalloc snapshot written to %s", path)


def serve(config: FleetConfig, host: str | None = None, port: int | None = None,
          access_log: bool = False, record: str | None = None) -> int:
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(serve_forever(config, host, port, access_log, record))
    return 0
