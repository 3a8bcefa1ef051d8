"""`vlm-sdk plan`: how a model's memory would be split, from config.json alone. `planner.py` computes a
`MemoryPlan` by the engine's own sizing rules; `report.py` formats it (table or JSON) and runs the command."""
from vlm_sdk.plan.planner import FAMILY_OPTIONS, PLAN_OPTIONS, MemoryPlan, Problem, plan

__all__ = ["FAMILY_OPTIONS", "MemoryPlan", "PLAN_OPTIONS", "Problem", "plan"]
