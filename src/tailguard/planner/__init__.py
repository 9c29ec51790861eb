"""Per-GPU engine settings and the gateway's initial limits, from the roofline model."""

from tailguard.planner.plan import GroupPlan, plan_groups

__all__ = ["GroupPlan", "plan_groups"]
