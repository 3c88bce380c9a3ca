"""Step-time models: pure functions of a ``StepPlan``."""

from kvsim.cost.fitted import FittedCost
from kvsim.cost.roofline import RooflineCost

COST_MODELS = {"roofline": RooflineCost, "fitted": FittedCost}

__all__ = ["COST_MODELS", "FittedCost", "RooflineCost"]
