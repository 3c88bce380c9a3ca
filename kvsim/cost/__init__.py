"""Step-time models: pure functions of a ``StepPlan``."""

from collections.abc import Callable

from kvsim.cost.base import CostInputs, StepCost
from kvsim.cost.fitted import FittedCost
from kvsim.cost.roofline import RooflineCost

# By [cost] model name (kvsim.schema.CostModelName).
COST_MODELS: dict[str, Callable[[CostInputs], StepCost]] = {
    "roofline": RooflineCost, "fitted": FittedCost}

__all__ = ["COST_MODELS", "CostInputs", "FittedCost", "RooflineCost", "StepCost"]
