"""What fits where: memory of published model architectures under a precision and a parallel
layout (calculator.py), from their config.json numbers (configs/, architecture.py)."""
from __future__ import annotations

from workbench.plan.architecture import Architecture, architecture, known_models
from workbench.plan.calculator import memory_plan
from workbench.plan.plan import MemoryPlan

__all__ = ["Architecture", "MemoryPlan", "architecture", "known_models", "memory_plan"]
