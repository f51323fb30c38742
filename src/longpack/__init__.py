"""longpack: cost-model-driven packing, chunking and balancing for long-context supervised fine-tuning.

The core (model, hardware, cost, plan, workloads, planners, sim) is numpy only; torch is imported lazily by the
runtime alone.
"""

from .cost import CostModel, TrainConfig
from .hardware import HardwareSpec, get_hardware, load_hardware
from .model import ModelSpec, get_model
from .plan import MicroBatch, Piece, Plan, PlanError, Replica, Step

__version__ = "0.1.0"
__all__ = ["CostModel", "TrainConfig", "HardwareSpec", "get_hardware", "load_hardware", "ModelSpec", "get_model",
           "MicroBatch", "Piece", "Plan", "PlanError", "Replica", "Step", "__version__"]
