"""Step-time models: pure functions of a ``StepPlan``."""

from collections.abc import Callable

from kvsim.cost.base import CostInputs, StepCost
from kvsim.cost.fitted import FittedCost
from kvsim.cost.interpolated import InterpolatedCost
from kvsim.cost.roofline import RooflineCost

# By [cost] model name (kvsim.schema.CostModelName).
COST_MODELS: dict[str, Callable[[CostInputs], StepCost]] = {
    "roofline": RooflineCost, "fitted": FittedCost, "interpolated": InterpolatedCost}

__all__ = ["COST_MODELS", "CostInputs", "FittedCost", "InterpolatedCost", "RooflineCost", "StepCost"]
