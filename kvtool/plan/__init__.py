"""Capacity planning: collapse round, capacity per tier, expected hit ratios (docs/plan.md)."""

from kvtool.plan.capacity import Plan, Storage, Workload, plan

__all__ = ["Plan", "Storage", "Workload", "plan"]
