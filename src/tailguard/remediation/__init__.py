"""Automated remediation: act when the decision core quarantines or recovers a node.

Rules live in the fleet file's ``remediation:`` section
(:mod:`tailguard.remediation.config`); the gateway's
:class:`~tailguard.remediation.remediator.Remediator` matches the core's
events against them and runs the actions (:mod:`tailguard.remediation.actions`):
a command, a webhook, or deleting the node's Kubernetes pod.
"""

from tailguard.remediation.config import RemediationConfig, Rule, parse_remediation
from tailguard.remediation.remediator import Remediator

__all__ = ["RemediationConfig", "Remediator", "Rule", "parse_remediation"]
