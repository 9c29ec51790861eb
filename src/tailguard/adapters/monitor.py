"""Background probes of one node: engine metrics scrape and active health check.

Two loops per node, both plain ``GET`` requests on the shared client session:

* **scrape** ``{url}/metrics`` every ``scrape.interval_s`` (default 0.5 s),
  parsed with the node's :mod:`~tailguard.adapters.engine_metrics` adapter
  (configured, or detected from the first page). Each good sample goes to
  ``balancer.on_engine_metrics``. Data older than ``scrape.stale_s`` (default
  2 s, as Kubernetes' endpoint picker does) is *stale*: the monitor says so
  (admin API, ``tailguard_node_engine_metrics_stale``) and withdraws it from
  the balancer by reporting -1 ("not reported"), so no decision rests on a
  picture of the engine that is seconds old. A node without a metrics page
  (404, 405, or 501: llama-server started without ``--metrics``) is asked
  again only every 30 s, and scrapes that keep failing (the node is down, or
  its page names no known engine) back off exponentially up to 5 s.
* **health** ``{url}{health.path}`` every ``health.interval_s``: after
  ``failures`` consecutive failures (non-2xx, connect error, timeout) the node
  is reported down (the live fleet takes it out of rotation with
  ``NodeState.DOWN``), and after ``successes`` consecutive successes up again.
  A node starts *up*: a fleet started before its engines is routed at once,
  and the proxy's failover covers the first seconds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp

from tailguard.adapters.dcgm import DcgmError, GpuTelemetry, gpu_mismatch, parse_dcgm
from tailguard.adapters.engine_metrics import EngineSample, detect_engine, parse_engine_metrics
from tailguard.config.fleet import HealthSettings, NodeConfig, ScrapeSettings

log = logging.getLogger("tailguard.adapters.monitor")

NO_METRICS_RETRY_S = 30.0
SCRAPE_BACKOFF_MAX_S = 5.0
DCGM_INTERVAL_S = 2.0  # dcgm-exporter itself refreshes every 30 s by default; clocks move faster
DCGM_FRESH_S = 60.0  # older readings name no cause (two of the exporter's own refreshes)

SampleCallback = Callable[[str, float, EngineSample | None], None]
# A probe's result to the core's rule (Balancer.on_probe); returns its verdict
# when it changes (False: out of rotation, True: back), else None.
HealthCallback = Callable[[str, bool], "bool | None"]


class NodeMonitor:
    """Scrapes and health-checks one node until :meth:`stop`."""

    def __init__(
        self,
        node: NodeConfig,
        session: aiohttp.ClientSession,
        scrape: ScrapeSettings,
        health: HealthSettings,
        on_sample: SampleCallback,
        on_health: HealthCallback,
    ) -> None:
        self.node = node
        self.session = session
        self.scrape = scrape
        self.health = health
        self.on_sample = on_sample
        self.on_health = on_health
        self.engine = node.engine  # None until detected
        self.sample: EngineSample | None = None
        self.sample_at = -1.0  # monotonic time of the last good sample
        self.stale = False
        self.metrics_missing = False
        self.scrape_errors = 0
        self.failing = 0  # scrapes failed in a row: the next ones back off
        self.up = True
        self.gpus: list[GpuTelemetry] = []  # the DCGM page's GPUs, when dcgm_url is set
        self.gpus_at = -1.0
        self.dcgm_error: str | None = None
        self.gpu_warning: str | None = None  # a mismatch with the fleet file ("" when none)
        self.last_error: str | None = None
        self._tasks: list[asyncio.Task[None]] = []
        key = node.upstream_api_key()
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._scrape_loop(), name=f"scrape:{self.node.id}"),
            asyncio.create_task(self._health_loop(), name=f"health:{self.node.id}"),
        ]
        if self.node.dcgm_url:
            self._tasks.append(asyncio.create_task(self._dcgm_loop(),
                                                   name=f"dcgm:{self.node.id}"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        # gather, not a bare await: our own cancellation must still propagate.
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    def metrics_age(self, now: float) -> float | None:
        return now - self.sample_at if self.sample_at >= 0 else None

    # -- engine metrics ------------------------------------------------------

    async def scrape_once(self) -> None:
        url = self.node.url + self.scrape.path
        timeout = aiohttp.ClientTimeout(total=self.scrape.timeout_s)
        try:
            async with self.session.get(url, timeout=timeout, headers=self._headers) as resp:
                if resp.status in (404, 405, 501):
                    # No metrics served (llama-server without --metrics answers 501):
                    # ask again rarely, and say why.
                    self.metrics_missing = True
                    self.last_error = (f"metrics: HTTP {resp.status}: the engine serves no "
                                       f"metrics (llama-server needs --metrics)"
                                       if resp.status == 501 else
                                       f"metrics: HTTP {resp.status}: no metrics page")
                    return
                if resp.status != 200:
                    self.scrape_errors += 1
                    self.last_error = f"metrics: HTTP {resp.status}"
                    return
                text = await resp.text(errors="replace")
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            self.scrape_errors += 1
            self.last_error = f"metrics: {type(exc).__name__}: {exc}"
            return
        self.metrics_missing = False
        self.failing = 0
        if self.engine is None:
            self.engine = detect_engine(text)
            if self.engine is None:
                self.last_error = "metrics: no known engine metric on the page"
                return
            log.info("node %s: detected engine %s", self.node.id, self.engine)
        sample = parse_engine_metrics(text, self.engine)
        if sample is None:
            self.scrape_errors += 1
            self.last_error = f"metrics: none of the {self.engine} metrics on the page"
            return
        now = time.monotonic()
        self.sample = sample
        self.sample_at = now
        self.stale = False
        self.on_sample(self.node.id, now, sample)

    def check_stale(self, now: float) -> None:
        if not self.stale and self.sample_at >= 0 and now - self.sample_at > self.scrape.stale_s:
            self.stale = True
            self.on_sample(self.node.id, now, None)

    async def _scrape_loop(self) -> None:
        interval = self.scrape.interval_s
        while True:
            start = time.monotonic()
            await self.scrape_once()
            now = time.monotonic()
            self.check_stale(now)
            if self.metrics_missing:
                wait = NO_METRICS_RETRY_S
            elif self.sample_at < 0 or now - self.sample_at > interval * 1.5:
                # Failing (down, refusing, a page without engine metrics): back off
                # exponentially, up to SCRAPE_BACKOFF_MAX_S.
                self.failing += 1
                wait = min(interval * 2 ** min(self.failing, 8), SCRAPE_BACKOFF_MAX_S)
            else:
                wait = interval - (now - start)
            await asyncio.sleep(max(wait, 0.01))

    # -- GPU telemetry (DCGM) ----------------------------------------------------

    async def dcgm_once(self) -> None:
        url = self.node.dcgm_url
        assert url is not None
        timeout = aiohttp.ClientTimeout(total=self.scrape.timeout_s)
        try:
            async with self.session.get(url, timeout=timeout) as resp:
                if resp.status != 200:
                    self.dcgm_error = f"dcgm: HTTP {resp.status}"
                    return
                text = await resp.text()
            gpus = parse_dcgm(text)
        except (aiohttp.ClientError, TimeoutError, OSError, DcgmError) as exc:
            self.dcgm_error = f"dcgm: {type(exc).__name__}: {exc}"
            return
        self.gpus = gpus
        self.gpus_at = time.monotonic()
        self.dcgm_error = None
        if self.gpu_warning is None:
            self.gpu_warning = gpu_mismatch(self.node, gpus) or ""
            if self.gpu_warning:
                log.warning("node %s: %s", self.node.id, self.gpu_warning)

    def gpu_cause(self) -> str | None:
        """What slows one of the node's GPUs now (the first that is), from DCGM."""
        found = self.gpu_cause_kind()
        return found[1] if found is not None and found[0] != "gpus_healthy" else None

    def gpu_cause_kind(self) -> tuple[str, str, int | None] | None:
        """(kind, text, GPU index) of the first GPU with a cause; ("gpus_healthy",
        text, None) when fresh DCGM readings show none; None without readings."""
        if not self.gpus or time.monotonic() - self.gpus_at > DCGM_FRESH_S:
            return None
        n = len(self.gpus)
        for g in self.gpus:
            kind = g.cause_kind()
            text = g.cause(n if n > 1 else None)
            if kind is not None and text is not None:
                return kind, text, g.index
        return "gpus_healthy", f"{'all ' if n > 1 else ''}{n} GPU{'s' if n > 1 else ''} " \
                               "healthy (DCGM): the engine, host or network then", None

    async def _dcgm_loop(self) -> None:
        interval = max(self.scrape.interval_s, DCGM_INTERVAL_S)
        while True:
            await self.dcgm_once()
            await asyncio.sleep(interval)

    # -- health --------------------------------------------------------------

    async def check_once(self) -> bool:
        url = self.node.url + self.health.path
        timeout = aiohttp.ClientTimeout(total=self.health.timeout_s)
        try:
            async with self.session.get(url, timeout=timeout, headers=self._headers) as resp:
                await resp.read()
                ok = 200 <= resp.status < 300
                if not ok:
                    self.last_error = f"health: HTTP {resp.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            ok = False
            self.last_error = f"health: {type(exc).__name__}: {exc}"
        verdict = self.on_health(self.node.id, ok)
        if verdict is True:
            self.up = True
            log.warning("node %s: health check passes again; back in rotation", self.node.id)
        elif verdict is False:
            self.up = False
            log.warning("node %s: %d health checks failed (%s); out of rotation",
                        self.node.id, self.health.failures, self.last_error)
        return ok

    async def _health_loop(self) -> None:
        while True:
            await self.check_once()
            await asyncio.sleep(self.health.interval_s)
