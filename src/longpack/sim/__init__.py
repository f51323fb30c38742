"""Simulator: step time, overlap and memory of a Plan on the cost model, its metrics and lower bounds."""

from .bounds import sample_work, step_lower_bound
from .metrics import PlanMetrics, imbalance, plan_metrics
from .simulate import SimReport, StepReport, simulate, simulate_step

__all__ = ["sample_work", "step_lower_bound", "PlanMetrics", "imbalance", "plan_metrics", "SimReport",
           "StepReport", "simulate", "simulate_step"]
