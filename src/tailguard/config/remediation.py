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
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from tailguard.config.parse import Block, parse

ACTIONS = ("command", "webhook", "kubernetes")


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


class WebhookBlock(Block):
    url: str
    headers: dict[str, str | int | float | bool] = Field(default_factory=dict)

    @field_validator("url")
    @classmethod
    def _http(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"must be an http(s) URL, got {url!r}")
        return url


class KubernetesBlock(Block):
    namespace: str | None = Field(default=None, min_length=1)
    pod_label: str = Field(default="pod", min_length=1)


class RuleBlock(Block):
    """One rule: a trigger (``on``), an optional ``cause``, exactly one action."""

    on: Literal["quarantined", "quarantined_repeatedly", "recovered"]
    cause: Literal["gpu_throttle", "gpu_xid", "gpus_healthy"] | None = None
    times: int = Field(default=3, ge=1)
    window_s: float = Field(default=3600.0, gt=0.0)
    timeout_s: float = Field(default=30.0, gt=0.0)
    command: list[Annotated[str, Field(min_length=1)]] | None = Field(default=None, min_length=1)
    webhook: WebhookBlock | None = None
    kubernetes: KubernetesBlock | None = None

    @model_validator(mode="after")
    def _one_action(self) -> RuleBlock:
        present = [a for a in ACTIONS if a in self.model_fields_set]
        if len(present) != 1:
            raise ValueError(f"needs exactly one action: one of {', '.join(ACTIONS)}")
        return self

    def core(self) -> Rule:
        common: dict[str, Any] = {"on": self.on, "cause": self.cause, "timeout_s": self.timeout_s,
                                  "times": self.times, "window_s": self.window_s}
        if self.command is not None:
            return Rule(action="command", argv=tuple(self.command), **common)
        if self.webhook is not None:
            return Rule(action="webhook", url=self.webhook.url,
                        headers={k: str(v) for k, v in self.webhook.headers.items()}, **common)
        k8s = self.kubernetes
        return Rule(action="kubernetes", namespace=k8s.namespace if k8s else None,
                    pod_label=k8s.pod_label if k8s else "pod", **common)


class RemediationBlock(Block):
    """The ``remediation:`` block (see the module docstring)."""

    rules: list[RuleBlock] = Field(default_factory=list)
    dry_run: bool = False
    cooldown_s: float = Field(default=300.0, ge=0.0)
    max_actions_per_hour: int = Field(default=20, ge=1)

    def core(self) -> RemediationConfig:
        return RemediationConfig(tuple(r.core() for r in self.rules), self.dry_run,
                                 self.cooldown_s, self.max_actions_per_hour)


def parse_remediation(raw: Any, where: str = "remediation") -> RemediationConfig:
    """A ``remediation:`` block (None: no rules)."""
    config: RemediationConfig = parse(RemediationBlock, raw, where).core()
    return config
