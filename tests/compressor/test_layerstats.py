"""Layer statistics: centring equals least squares with an intercept, and the kept solution undoes it."""

import torch

from compressor import solve_layer
from compressor.layerstats import LayerStatistics, energy_weights, kept_solution, token_weights


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


def test_token_weights_cap_a_row_at_cap_medians_and_leave_the_rest_alone():
    rows = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [100.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    # squared norms 1, 1, 2, 10,000, 0: median 1
    torch.testing.assert_close(token_weights(rows, 4.0), torch.tensor([1, 1, 1, 4e-4, 1], dtype=torch.float64))
    torch.testing.assert_close(token_weights(rows, 1.0), torch.tensor([1, 1, 0.5, 1e-4, 1], dtype=torch.float64))
    zeros = torch.zeros(3, 2, dtype=torch.float64)
    zeros[0, 0] = 3.0  # a zero median: weighed against the mean (3), never against 0
    torch.testing.assert_close(token_weights(zeros, 1.0), torch.tensor([1 / 3, 1, 1], dtype=torch.float64))


def test_energy_weights_take_the_median_of_the_counted_tokens_only():
    energy = torch.tensor([[1.0, 1.0, 10_000.0], [4.0, 4.0, 4.0]])
    counted = torch.tensor([[True, True, True], [False, False, True]])  # 1, 1, 10,000, 4: median 1 (the lower)
    torch.testing.assert_close(energy_weights(energy, 2.0, counted), torch.tensor([[1, 1, 2e-4], [0.5, 0.5, 0.5]]))
    torch.testing.assert_close(energy_weights(energy, 2.0), torch.tensor([[1, 1, 8e-4], [1, 1, 1]]))  # median 4
    nothing = torch.zeros_like(counted)
    torch.testing.assert_close(energy_weights(energy, 2.0, nothing), torch.ones_like(energy))


def test_capped_statistics_are_the_weighted_least_squares_with_a_weighted_intercept():
    _, X, X_hat, W_hat = _statistics(seed=2)
    X[0] *= 50
    X_hat[0] *= 50  # one token of massive activation
    stats = LayerStatistics(W_hat, token_cap=1.0)
    for rows in range(0, 64, 16):
        stats.add(X[rows:rows + 16], X_hat[rows:rows + 16])
    w = torch.cat([token_weights(X_hat[r:r + 16], 1.0) for r in range(0, 64, 16)])  # per batch, as added
    assert w[0] < 1e-2 and (w > 0).all()
    finished = stats.finish(center=True)
    Y = X_hat @ W_hat
    mu, nu = (w[:, None] * X).sum(0) / w.sum(), (w[:, None] * Y).sum(0) / w.sum()
    torch.testing.assert_close(finished.mean_x, mu)
    torch.testing.assert_close(finished.H, (X - mu).T @ (w[:, None] * (X - mu)))
    torch.testing.assert_close(finished.G, (X - mu).T @ (w[:, None] * (Y - nu)))
    sol = solve_layer(finished.H, finished.G, 1, 2, "osscar", dense_weight=W_hat)
    kept = kept_solution(sol, 1, None, finished)
    A = torch.cat([X[:, kept.keep], torch.ones(64, 1, dtype=X.dtype)], 1) * w.sqrt()[:, None]
    coef = torch.linalg.lstsq(A, Y * w.sqrt()[:, None]).solution
    torch.testing.assert_close(kept.weight, coef[:-1], atol=1e-8, rtol=1e-8)
    torch.testing.assert_close(kept.shift, coef[-1], atol=1e-8, rtol=1e-8)
