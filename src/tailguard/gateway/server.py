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
import gc
import logging
import os
import signal
import sys
import time
import tracemalloc
from pathlib import Path

from tailguard.gateway.app import start_gateway
from tailguard.gateway.config import FleetConfig
from tailguard.gateway.connections import default_max_connections, raise_fd_limit

log = logging.getLogger("tailguard.gateway")


def _loop_factory() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # uvloop has no Windows build
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


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


GC_FULL_EVERY_S = 10.0


def start_gc_tuning() -> asyncio.Task[None] | None:
    """:func:`tune_gc` and the periodic full collection (cancel the task at exit);
    ``TAILGUARD_GC_TUNING=0`` leaves CPython's defaults (for diagnosis)."""
    if os.environ.get("TAILGUARD_GC_TUNING", "1") == "0":
        return None
    tune_gc()
    return asyncio.create_task(_collect_periodically(), name="gc")


async def _collect_periodically(every_s: float = GC_FULL_EVERY_S) -> None:
    """A full collection every ``every_s``, off the request path's allocation count.

    With the young generation collected rarely (``tune_gc``), reference cycles
    that survive it (a cancelled request's exception, traceback and frames)
    waited for CPython's rare full collections: a 15 req/s soak grew 207 KiB/min
    against 54 with the default thresholds. Objects frozen at startup are
    skipped, so one pass over what the requests left is short.
    """
    while True:
        await asyncio.sleep(every_s)
        t0 = time.perf_counter()
        found = gc.collect()
        log.debug("gc: %d unreachable objects collected in %.1f ms", found,
                  (time.perf_counter() - t0) * 1000)


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


def tune_gc() -> None:
    """Fewer, cheaper garbage collections on the request path.

    Each proxied request allocates many short-lived objects, so with CPython's
    default threshold (700 allocations) young collections ran every few
    requests: 8.6% of the gateway's samples under wrk (py-spy --native). Objects
    alive after startup (modules, config, the fleet) are frozen out of the
    collector's scans, and the youngest generation is collected less often.
    Reference cycles are still collected; memory grows by at most one threshold
    of young objects.
    """
    gc.collect()
    gc.freeze()
    gen0, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(max(gen0, GC_GEN0_THRESHOLD), gen1, gen2)


GC_GEN0_THRESHOLD = 50_000


def serve(config: FleetConfig, host: str | None = None, port: int | None = None,
          access_log: bool = False, record: str | None = None) -> int:
    with asyncio.Runner(loop_factory=_loop_factory) as runner:
        runner.run(serve_forever(config, host, port, access_log, record))
    return 0
