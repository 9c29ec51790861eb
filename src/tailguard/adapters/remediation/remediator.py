"""Match the core's events against the remediation rules and run the actions.

Triggers, per node:

* ``quarantined``: the core quarantined it (whatever the reason);
* ``quarantined_repeatedly``: the rule's ``times``-th quarantine within its
  ``window_s`` (and every one after it while the window holds that many);
* ``recovered``: healthy again after having been quarantined.

Guards: a rule acts on a node at most once per ``cooldown_s``; all rules
together at most ``max_actions_per_hour`` times (a fleet-wide incident must not
become a storm of pod deletions); ``dry_run`` records what would have run.
With several gateway replicas (``shared_state``), an action also needs the
fleet-wide lease on (node, rule) for ``cooldown_s``: it happens once, on
whichever replica takes the lease first; the others record ``elsewhere``.
Every action and its result goes to the event log (``GET /admin/events``),
the ``tailguard_remediations_total{action,result}`` counter and the log.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aiohttp

from tailguard.adapters.remediation.actions import delete_pod, post_webhook, run_command
from tailguard.config.remediation import RemediationConfig, Rule
from tailguard.core.events import Event

if TYPE_CHECKING:
    from tailguard.adapters.event_log import EventLog
    from tailguard.adapters.live_fleet import LiveFleet

log = logging.getLogger("tailguard.adapters.remediation")

HOUR_S = 3600.0


class Remediator:
    """Listens to the live fleet's events; runs actions as background tasks."""

    def __init__(self, fleet: LiveFleet, events: EventLog,
                 on_result: Callable[[str, str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.fleet = fleet
        self.events = events
        self.on_result = on_result
        self.clock = clock
        self.session: aiohttp.ClientSession | None = None
        self._quarantines: dict[str, deque[float]] = {}
        self._was_quarantined: set[str] = set()
        self._last: dict[tuple[str, str], float] = {}
        self._recent: deque[float] = deque()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def config(self) -> RemediationConfig:
        cfg: RemediationConfig = self.fleet.config.remediation
        return cfg

    def on_event(self, ev: Event) -> None:
        if ev.kind != "state":
            return
        now = self.clock()
        triggers: list[str] = []
        if ev.state == "quarantined":
            self._was_quarantined.add(ev.node)
            q = self._quarantines.setdefault(ev.node, deque())
            q.append(now)
            triggers.append("quarantined")
        elif ev.state == "healthy" and ev.node in self._was_quarantined:
            self._was_quarantined.discard(ev.node)
            triggers.append("recovered")
        for rule in self.config.rules:
            if rule.cause is not None and rule.cause != ev.cause:
                continue
            if rule.on == "quarantined_repeatedly" and "quarantined" in triggers:
                q = self._quarantines[ev.node]
                while q and q[0] < now - rule.window_s:
                    q.popleft()
                if len(q) >= rule.times:
                    self._fire(rule, ev, now)
            elif rule.on in triggers:
                self._fire(rule, ev, now)

    def _fire(self, rule: Rule, ev: Event, now: float) -> None:
        cfg = self.config
        key = (ev.node, rule.name)
        base = {"node": ev.node, "kind": "action", "trigger": rule.on, "action": rule.action}
        if ev.cause:
            base["cause"] = ev.cause
        if ev.advice:
            base["advice"] = ev.advice
        last = self._last.get(key)
        if last is not None and now - last < cfg.cooldown_s:
            self._record(base, "cooldown", f"acted {now - last:.0f} s ago")
            return
        while self._recent and self._recent[0] < now - HOUR_S:
            self._recent.popleft()
        if len(self._recent) >= cfg.max_actions_per_hour:
            self._record(base, "rate_limited",
                         f"{cfg.max_actions_per_hour} actions in the last hour")
            return
        self._last[key] = now
        self._recent.append(now)
        shared = self.fleet.shared
        if shared is None:
            if cfg.dry_run:
                self._record(base, "dry_run", self._describe(rule, ev))
                return
            coro = self._run(rule, ev, base)
        else:
            coro = self._leased(rule, ev, base)
        task = asyncio.get_running_loop().create_task(coro, name=f"remediate:{ev.node}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _leased(self, rule: Rule, ev: Event, base: dict[str, Any]) -> None:
        """With several replicas: act only with the fleet-wide lease on (node, rule)."""
        shared = self.fleet.shared
        assert shared is not None
        if not await shared.lease(f"{ev.node}:{rule.name}", self.config.cooldown_s):
            self._record(base, "elsewhere", "another replica holds this action's lease")
            return
        if self.config.dry_run:
            self._record(base, "dry_run", self._describe(rule, ev))
            return
        await self._run(rule, ev, base)

    def _env(self, ev: Event) -> dict[str, str]:
        node = self.fleet.nodes.get(ev.node)
        return {"TAILGUARD_NODE_ID": ev.node, "TAILGUARD_NODE_URL": node.url if node else "",
                "TAILGUARD_NODE_GPU": node.gpu_class if node else "",
                "TAILGUARD_NODE_REASON": ev.reason, "TAILGUARD_TRIGGER": ev.state,
                "TAILGUARD_CAUSE": ev.cause, "TAILGUARD_ADVICE": ev.advice}

    def _pod(self, rule: Rule, ev: Event) -> tuple[str, str | None]:
        node = self.fleet.nodes.get(ev.node)
        labels = dict(node.labels) if node else {}
        return rule.namespace or labels.get("namespace", "default"), labels.get(rule.pod_label)

    def _describe(self, rule: Rule, ev: Event) -> str:
        if rule.action == "command":
            return "would run " + " ".join(rule.argv)
        if rule.action == "webhook":
            return f"would POST {rule.url}"
        ns, pod = self._pod(rule, ev)
        return f"would delete pod {ns}/{pod}"

    async def _run(self, rule: Rule, ev: Event, base: dict[str, Any]) -> None:
        env = self._env(ev)
        try:
            if rule.action == "command":
                ok, detail = await run_command(rule.argv, env, rule.timeout_s)
            elif rule.action == "webhook":
                if self.session is None:
                    ok, detail = False, "no HTTP session (gateway not started)"
                else:
                    payload = {k.removeprefix("TAILGUARD_").lower(): v for k, v in env.items()}
                    ok, detail = await post_webhook(self.session, rule.url, payload,
                                                    rule.headers, rule.timeout_s)
            else:
                ns, pod = self._pod(rule, ev)
                if pod is None:
                    ok, detail = False, f"node has no label {rule.pod_label!r} naming its pod"
                else:
                    ok, detail = await delete_pod(ns, pod, rule.timeout_s)
        except Exception as exc:  # recorded, never lost in a background task
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        self._record(base, "ok" if ok else "failed", detail)

    def _record(self, base: dict[str, Any], result: str, detail: str) -> None:
        self.events.add({**base, "result": result, "detail": detail})
        if self.on_result is not None:
            self.on_result(base["action"], result)
        level = logging.WARNING if result in ("failed", "rate_limited") else logging.INFO
        log.log(level, "remediation %s on %s for node %s: %s (%s)", base["action"],
                base["trigger"], base["node"], result, detail)

    async def stop(self) -> None:
        """Wait for running actions (each is bounded by its own timeout)."""
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
