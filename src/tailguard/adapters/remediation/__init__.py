"""Automated remediation: act when the decision core quarantines or recovers a node.

Rules live in the fleet file's ``remediation:`` section
(:mod:`tailguard.config.remediation`); the gateway's
:class:`~tailguard.adapters.remediation.remediator.Remediator` matches the core's
events against them and runs the actions (:mod:`tailguard.adapters.remediation.actions`):
a command, a webhook, or deleting the node's Kubernetes pod.
"""

from tailguard.adapters.remediation.remediator import Remediator
from tailguard.config.remediation import RemediationConfig, Rule, parse_remediation

__all__ = ["RemediationConfig", "Remediator", "Rule", "parse_remediation"]
