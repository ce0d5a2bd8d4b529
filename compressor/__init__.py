"""Layer-wise structured pruning: the OSSCAR solver, its baselines, and (later) calibration and surgery.

Imports nothing from `exporters` or `service`.
"""

from .osscar import OsscarConfig
from .problem import LayerSolution
from .solve import METHODS, solve_layer

__all__ = ["METHODS", "LayerSolution", "OsscarConfig", "solve_layer"]
