"""The process runtime the live drivers share: their event loop and garbage collection.

``tailguard serve`` and ``tailguard epp`` run one event loop each, uvloop
where installed (its socket and timer handling is much of a Python proxy's
own latency), and collect garbage on a clock instead of on the request path's
allocation count. ``benchmarks/README.md`` has the measurements behind both.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time

log = logging.getLogger("tailguard.runtime")

GC_FULL_EVERY_S = 10.0
GC_GEN0_THRESHOLD = 50_000


def loop_factory() -> asyncio.AbstractEventLoop:
    """A uvloop event loop, or asyncio's own where uvloop has no build (Windows)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


def tune_gc() -> None:
    """Fewer, cheaper garbage collections on the request path.

    Each proxied request allocates many short-lived objects, so CPython's
    default threshold (700 allocations) runs a young collection every few
    requests. Objects alive after startup (modules, config, the fleet) are
    frozen out of the collector's scans, and the youngest generation is
    collected less often. Reference cycles are still collected (see
    :func:`start_gc_tuning`); memory grows by at most one threshold of young
    objects.
    """
    gc.collect()
    gc.freeze()
    gen0, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(max(gen0, GC_GEN0_THRESHOLD), gen1, gen2)


def start_gc_tuning() -> asyncio.Task[None] | None:
    """:func:`tune_gc` and the periodic full collection (cancel the task at exit);
    ``TAILGUARD_GC_TUNING=0`` leaves CPython's defaults (for diagnosis)."""
    if os.environ.get("TAILGUARD_GC_TUNING", "1") == "0":
        return None
    tune_gc()
    return asyncio.create_task(_collect_periodically(), name="gc")


async def _collect_periodically(every_s: float = GC_FULL_EVERY_S) -> None:
    """A full collection every ``every_s``, off the request path's allocation count.

    With young collections rare, reference cycles that survive them (a
    cancelled request's exception, traceback and frames) would wait for
    CPython's rare full collections and memory would creep under steady load.
    Objects frozen at startup are skipped, so one pass over what the requests
    left is short.
    """
    while True:
        await asyncio.sleep(every_s)
        t0 = time.perf_counter()
        found = gc.collect()
        log.debug("gc: %d unreachable objects collected in %.1f ms", found,
                  (time.perf_counter() - t0) * 1000)
