"""Layer statistics: centring equals least squares with an intercept, and the kept solution undoes it."""

import torch

from compressor import solve_layer
from compressor.layerstats import LayerStatistics, kept_solution


def _statistics(seed=0, n=64, d1=6, d2=3):
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d1, generator=gen, dtype=torch.float64) + 2.0  # a mean to centre away
    X_hat = X + 0.1 * torch.randn(n, d1, generator=gen, dtype=torch.float64)
    W_hat = torch.randn(d1, d2, generator=gen, dtype=torch.float64)
    stats = LayerStatistics(W_hat)
    for rows in range(0, n, 16):  # several batches add up to one
        stats.add(X[rows:rows + 16], X_hat[rows:rows + 16])
    return stats, X, X_hat, W_hat


def test_finish_without_centring_is_the_raw_statistics():
    stats, X, X_hat, W_hat = _statistics()
    finished = stats.finish(center=False)
    Y = X_hat @ W_hat
    assert torch.allclose(finished.H, X.T @ X)
    assert torch.allclose(finished.G, X.T @ Y)
    assert abs(finished.energy - 0.5 * float(Y.square().sum())) < 1e-9 * finished.energy
    assert torch.allclose(finished.mean_x, X.mean(0)) and torch.allclose(finished.mean_y, Y.mean(0))


def test_centred_statistics_give_the_least_squares_fit_with_an_intercept():
    stats, X, X_hat, W_hat = _statistics(seed=1)
    finished = stats.finish(center=True)
    Xc, Yc = X - X.mean(0), X_hat @ W_hat - (X_hat @ W_hat).mean(0)
    assert torch.allclose(finished.H, Xc.T @ Xc)
    assert torch.allclose(finished.G, Xc.T @ Yc)
    sol = solve_layer(finished.H, finished.G, 1, 2, "osscar", dense_weight=W_hat)
    kept = kept_solution(sol, 1, None, finished)
    # the intercept makes the mean output match the dense one
    out = X[:, kept.keep] @ kept.weight + kept.shift
    assert torch.allclose(out.mean(0), (X_hat @ W_hat).mean(0))
    # and the fit is the ordinary least squares with an intercept on the kept inputs
    A = torch.cat([X[:, kept.keep], torch.ones(X.shape[0], 1, dtype=X.dtype)], 1)
    coef = torch.linalg.lstsq(A, X_hat @ W_hat).solution
    assert torch.allclose(kept.weight, coef[:-1], atol=1e-8) and torch.allclose(kept.shift, coef[-1], atol=1e-8)


def test_the_rank_bound_is_the_rows_one_fewer_once_centred():
    stats, X, _, _ = _statistics(n=5, d1=8)  # fewer rows than features: H is singular
    assert stats.finish(center=False).rank == 5 == int(torch.linalg.matrix_rank(X.T @ X))
    stats, _, _, _ = _statistics(n=5, d1=8)
    finished = stats.finish(center=True)
    assert finished.rank == 4 == int(torch.linalg.matrix_rank(finished.H))
