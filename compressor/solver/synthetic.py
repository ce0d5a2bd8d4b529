"""Synthetic layer problems with correlated features, for tests and solver benchmarks.

Activations of real layers are correlated and have uneven scales; independent Gaussian features
make every support look alike and hide the difference between solvers. Features here follow a
low-rank factor model plus noise, with log-uniform column scales, and the pruned model's inputs X
are the dense inputs X_hat plus a perturbation (the sequential setting of the paper's appendix B).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SyntheticProblem:
    H: Tensor  # d1 x d1 = X^T X
    G: Tensor  # d1 x d2 = X^T X_hat W_hat
    dense_weight: Tensor  # W_hat, d1 x d2
    group_size: int


def correlated_problem(
    d1: int,
    d2: int,
    group_size: int = 1,
    *,
    samples: int | None = None,
    rank_fraction: float = 0.25,
    noise: float = 0.3,
    shift: float = 0.1,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    device: str | torch.device = "cpu",
) -> SyntheticProblem:
    """A layer problem of size d1 x d2 with `samples` (default 2 d1) correlated input rows."""
    gen = torch.Generator().manual_seed(seed)
    n = samples if samples is not None else 2 * d1
    rank = max(1, int(d1 * rank_fraction))

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    factors = randn(n, rank) @ randn(rank, d1) / rank**0.5
    X_hat = (factors + noise * randn(n, d1)) * torch.exp(2 * torch.rand(d1, generator=gen, dtype=torch.float64))
    X = X_hat + shift * X_hat.std(0) * randn(n, d1)
    W_hat = randn(d1, d2)
    H, G = X.T @ X, X.T @ (X_hat @ W_hat)
    H = 0.5 * (H + H.T)

    def out(t: Tensor) -> Tensor:
        return t.to(dtype=dtype, device=device)

    return SyntheticProblem(out(H), out(G), out(W_hat), group_size)
