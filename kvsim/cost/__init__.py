"""Step-time models: pure functions of a ``StepPlan``."""

from kvsim.cost.roofline import RooflineCost

COST_MODELS = {"roofline": RooflineCost}

__all__ = ["COST_MODELS", "RooflineCost"]
