"""The fleet file's ``remediation:`` section::

    remediation:
      dry_run: false              # log and record what would run, run nothing
      cooldown_s: 300             # per node and rule: no second action sooner
      max_actions_per_hour: 20    # global rate limit over all nodes and rules
      rules:
        - on: quarantined
          command: [/usr/local/bin/page-oncall, --severity, low]   # argv, no shell
          timeout_s: 30
        - on: quarantined_repeatedly          # n quarantines of one node within window_s
          times: 3
          window_s: 3600
          kubernetes: {namespace: inference}  # delete the node's pod (label ``pod``)
        - on: recovered                       # healthy again after a quarantine
          webhook: {url: "https://hooks.example/tailguard", headers: {X-Token: abc}}
        - on: quarantined                     # only when the node's DCGM page shows
          cause: gpu_throttle                 # a throttled GPU (gpu_xid: XID errors;
          kubernetes: {namespace: inference}  # gpus_healthy: DCGM sees nothing wrong)

A command gets ``TAILGUARD_NODE_ID``, ``TAILGUARD_NODE_URL``,
``TAILGUARD_NODE_GPU``, ``TAILGUARD_NODE_REASON``, ``TAILGUARD_TRIGGER``,
``TAILGUARD_CAUSE`` and ``TAILGUARD_ADVICE`` (what to do, from the cause) in
its environment; a webhook gets the same as a JSON body. Every value is
checked when the file is read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tailguard.config_file import check_keys, integer, number, require_mapping
from tailguard.errors import ConfigError

TRIGGERS = ("quarantined", "quarantined_repeatedly", "recovered")
ACTIONS = ("command", "webhook", "kubernetes")
# What a rule's ``cause`` may require of the event (gateway: the node's DCGM page).
CAUSES = ("gpu_throttle", "gpu_xid", "gpus_healthy")
RULE_KEYS = ("on", "cause", "times", "window_s", "timeout_s", *ACTIONS)


@dataclass(frozen=True, slots=True)
class Rule:
    on: str
    action: str  # one of ACTIONS
    argv: tuple[str, ...] = ()  # command
    url: str = ""  # webhook
    headers: Mapping[str, str] = field(default_factory=dict)  # webhook
    namespace: str | None = None  # kubernetes: else the node's label ``namespace``, else default
    pod_label: str = "pod"  # kubernetes: the node label that names its pod
    timeout_s: float = 30.0
    times: int = 3  # quarantined_repeatedly
    window_s: float = 3600.0  # quarantined_repeatedly
    cause: str | None = None  # only events with this cause (CAUSES); None: any

    @property
    def name(self) -> str:
        return f"{self.on}:{self.action}" + (f":{self.cause}" if self.cause else "")


@dataclass(frozen=True, slots=True)
class RemediationConfig:
    rules: tuple[Rule, ...] = ()
    dry_run: bool = False
    cooldown_s: float = 300.0
    max_actions_per_hour: int = 20


def _parse_rule(raw: Any, where: str) -> Rule:
    m = require_mapping(raw, where)
    check_keys(m, RULE_KEYS, where)
    on = m.get("on")
    if on not in TRIGGERS:
        raise ConfigError(f"{where}.on", f"unknown trigger {on!r}", list(TRIGGERS))
    present = [a for a in ACTIONS if a in m]
    if len(present) != 1:
        raise ConfigError(where, "needs exactly one action", list(ACTIONS))
    action = present[0]
    times = m.get("times", 3)
    if isinstance(times, bool) or not isinstance(times, int) or times < 1:
        raise ConfigError(f"{where}.times", f"must be an integer >= 1, got {times!r}")
    cause = m.get("cause")
    if cause is not None and cause not in CAUSES:
        raise ConfigError(f"{where}.cause", f"unknown cause {cause!r}", list(CAUSES))
    common: dict[str, Any] = {"on": str(on), "action": action, "cause": cause,
                              "timeout_s": number(m, "timeout_s", where, 30.0),
                              "times": times, "window_s": number(m, "window_s", where, 3600.0)}
    body = m[action]
    if action == "command":
        if (not isinstance(body, list) or not body
                or not all(isinstance(a, str) and a for a in body)):
            raise ConfigError(f"{where}.command", "must be a non-empty list of strings (argv)")
        return Rule(argv=tuple(body), **common)
    b = require_mapping(body if body is not None else {}, f"{where}.{action}")
    if action == "webhook":
        check_keys(b, ("url", "headers"), f"{where}.webhook")
        url = b.get("url")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ConfigError(f"{where}.webhook.url", f"must be an http(s) URL, got {url!r}")
        headers = require_mapping(b.get("headers") or {}, f"{where}.webhook.headers")
        return Rule(url=url, headers={str(k): str(v) for k, v in headers.items()}, **common)
    check_keys(b, ("namespace", "pod_label"), f"{where}.kubernetes")
    ns = b.get("namespace")
    return Rule(namespace=str(ns) if ns is not None else None,
                pod_label=str(b.get("pod_label", "pod")), **common)


def parse_remediation(raw: Any, where: str = "remediation") -> RemediationConfig:
    if raw is None:
        return RemediationConfig()
    m = require_mapping(raw, where)
    check_keys(m, ("rules", "dry_run", "cooldown_s", "max_actions_per_hour"), where)
    rules_raw = m.get("rules") or []
    if not isinstance(rules_raw, list):
        raise ConfigError(f"{where}.rules", "must be a list")
    dry = m.get("dry_run", False)
    if not isinstance(dry, bool):
        raise ConfigError(f"{where}.dry_run", "must be true or false")
    cooldown = number(m, "cooldown_s", where, 300.0, positive=False, minimum=0.0)
    rate = integer(m, "max_actions_per_hour", where, 20)
    return RemediationConfig(
        rules=tuple(_parse_rule(r, f"{where}.rules[{i}]") for i, r in enumerate(rules_raw)),
        dry_run=dry, cooldown_s=float(cooldown), max_actions_per_hour=rate)
