"""Helpers shared by the tests (importable: pytest puts tests/ on the path)."""

from __future__ import annotations

from longpack.cost import CostModel, TrainConfig
from longpack.hardware import get_hardware
from longpack.model import get_model


def make_cost(model="qwen2.5-0.5b", hw="h100", **cfg) -> CostModel:
    m = get_model(model) if isinstance(model, str) else model
    h = get_hardware(hw) if isinstance(hw, str) else hw
    return CostModel(m, h, TrainConfig(**cfg))
