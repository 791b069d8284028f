"""Capacity planning: collapse round, capacity per tier, expected hit ratios (docs/plan.md)."""

from kvtool.plan.capacity import CapacityPlan, Storage, Workload, plan

__all__ = ["CapacityPlan", "Storage", "Workload", "plan"]
