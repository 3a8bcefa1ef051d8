"""`vlm-sdk plan`: how a model's memory would be split, from config.json alone. `planner.py` computes a
`MemoryPlan` by the engine's own sizing rules; `report.py` formats it (table or JSON) and runs the command;
`flags.py` holds the command's flags. The names below load on first use, so the command line's flags
(and `--help`) import no torch."""
from __future__ import annotations

import importlib

__all__ = ["FAMILY_OPTIONS", "MemoryPlan", "PLAN_OPTIONS", "Problem", "plan"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("vlm_sdk.plan.planner"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
