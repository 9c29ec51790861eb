"""Hot reload of the fleet file: on SIGHUP, and when the file changes.

The file's modification time and size are polled every ``reload.poll_s``
(default 1 s; 0 turns polling off, SIGHUP still works); polling works the same
on every filesystem and in containers where inotify does not reach mounted
ConfigMaps. A new file is parsed completely before anything changes: a file
with an error is logged and counted (``tailguard_config_reloads_total{result="error"}``)
and the running fleet stays as it was. A good one is applied by
:meth:`tailguard.adapters.live_fleet.LiveFleet.apply`, which keeps every
in-flight request on its node.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path

from tailguard.adapters.live_fleet import LiveFleet, ReloadSummary
from tailguard.adapters.metrics import GatewayMetrics
from tailguard.config.fleet import load_fleet
from tailguard.errors import ConfigError

log = logging.getLogger("tailguard.gateway.reload")


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


class ConfigReloader:
    """Watches the fleet file of a running gateway and applies its changes."""

    def __init__(self, fleet: LiveFleet, metrics: GatewayMetrics) -> None:
        self.fleet = fleet
        self.metrics = metrics
        self.path = fleet.config.path
        self._stamp = _stamp(self.path) if self.path else None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    def start(self) -> None:
        if self.path is not None:
            self._task = asyncio.create_task(self._loop(), name="config-reload")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def trigger(self) -> None:
        """Reload now (the SIGHUP handler calls this)."""
        self._wake.set()

    async def reload(self) -> ReloadSummary | None:
        """Read the file and apply it; None when it has an error (nothing changes)."""
        if self.path is None:
            return None
        async with self._lock:
            self._stamp = _stamp(self.path)
            try:
                new = load_fleet(self.path, self.fleet.config.catalog)
            except ConfigError as exc:
                self.metrics.reloads.labels("error").inc()
                log.error("fleet file %s not reloaded: %s", self.path, exc)
                return None
            except Exception:  # a parser bug must not end hot reload for good
                self.metrics.reloads.labels("error").inc()
                log.exception("fleet file %s not reloaded: unexpected error", self.path)
                return None

            for w in new.warnings:
                log.warning("%s", w)
            summary = await self.fleet.apply(new)
            self.metrics.reloads.labels("ok").inc()
            log.info("fleet file %s reloaded: %s", self.path, summary)
            return summary

    async def _loop(self) -> None:
        assert self.path is not None
        while True:
            poll = self.fleet.config.reload_poll_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), poll if poll > 0 else None)
            triggered = self._wake.is_set()
            self._wake.clear()
            if triggered or _stamp(self.path) != self._stamp:
                try:
                    await self.reload()
                except Exception:  # applying failed: keep watching, say so
                    self.metrics.reloads.labels("error").inc()
                    log.exception("fleet file %s: applying the reload failed", self.path)
