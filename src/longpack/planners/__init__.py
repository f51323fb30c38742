"""Planners: turn sequence lengths into a Plan. ``get_planner(name)`` returns one; ``PLANNERS`` lists them."""

from . import baselines, chunkflow, hbp, skrull, unified  # noqa: F401  (registers the built-in planners)
from .base import Batch, OverlongError, PlanContext, global_batches
from .registry import PLANNERS, Planner, check_options, get_planner, register
from .stream import make_plan

__all__ = ["PLANNERS", "Batch", "OverlongError", "PlanContext", "Planner", "check_options", "get_planner",
           "global_batches",
           "make_plan", "register"]
