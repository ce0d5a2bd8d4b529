"""The layer solver: min_W 1/2 Tr(Wᵀ H W) − Tr(Gᵀ W) with whole input groups of W set to zero.

`problem` (the layer problem, factorisation and damping, group -> row indices), `linalg` (Cholesky factor,
solve and inverse: LAPACK directly on the CPU, torch elsewhere), `sweep` (the swept-matrix state and its
rank-g updates), `bookkeeping` (the swap phase's stack of moves and cache of columns), `osscar` (Algorithm 1:
nested greedy then swap rounds), `baselines` (mp, mp+, thinet, exact supports), `solve` (`solve_layer`, the
method registry), `synthetic` (correlated test problems).
Imports nothing else of `compressor`.
"""

from .osscar import OsscarConfig
from .problem import LayerSolution
from .solve import METHODS, solve_layer

__all__ = ["METHODS", "LayerSolution", "OsscarConfig", "solve_layer"]
