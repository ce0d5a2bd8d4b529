"""`compressor.solver.linalg`: Cholesky factor, solve and inverse, through LAPACK directly and through torch."""

import sys

import pytest
import torch

from compressor.solver import linalg
from compressor.solver.linalg import Cholesky, cholesky, lapack_in_use


@pytest.fixture(params=["lapack", "torch"])
def path(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setattr(linalg, "_lapack_for", lambda M: None)
    return request.param


def spd(n, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    A = torch.randn(2 * n, n, generator=gen, dtype=torch.float64)
    return (A.T @ A / n).to(dtype)


def test_lapack_is_called_directly_where_torch_links_mkl():
    M = spd(8)
    if torch.backends.mkl.is_available() and sys.platform == "linux":
        assert lapack_in_use(M)
    assert not lapack_in_use(M.T[:, :4])  # not a square contiguous buffer: torch's routines
    assert not lapack_in_use(M.half())


def test_the_check_rejects_a_lapack_that_computes_something_else():
    """The known problem that guards the direct calls: a wrong calling convention (here: a factorisation
    that does nothing) fails it."""
    found = linalg._lapack()
    assert found is not None or not (torch.backends.mkl.is_available() and sys.platform == "linux")
    if found is not None:
        broken = linalg._Lapack({dt: (lambda *args: None) for dt in found.potrf}, found.potri, found.potrs)
        assert linalg._passes_check(found)
        assert not linalg._passes_check(broken)


@pytest.mark.parametrize("n", [1, 5, 300, 600])  # beyond one mirroring tile (256), and not a multiple of it
def test_solve_and_inverse_match_torch(path, n):
    M = spd(n, seed=n)
    before = M.clone()
    factor = cholesky(M)
    assert factor is not None and factor.upper == (path == "lapack")
    B = torch.randn(n, 7, dtype=torch.float64)
    B_before = B.clone()
    assert torch.allclose(factor.solve(B), torch.linalg.solve(M, B), rtol=1e-9, atol=1e-9)
    assert torch.equal(B, B_before)
    assert torch.allclose(factor.solve(B[:, :1]), torch.linalg.solve(M, B[:, :1]), rtol=1e-9, atol=1e-9)
    assert torch.equal(B, B_before)
    inverse = factor.inverse()
    assert torch.equal(inverse, inverse.T)  # both triangles, exactly symmetric
    assert torch.allclose(inverse, torch.linalg.inv(M), rtol=1e-8, atol=1e-10)
    assert torch.equal(M, before)
    assert torch.allclose(factor.solve(B), torch.linalg.solve(M, B), rtol=1e-9, atol=1e-9)  # still a factor


def test_overwriting_inverse_reuses_the_factor_buffer(path):
    M = spd(40)
    factor = cholesky(M)
    inverse = factor.inverse(overwrite=True)
    assert torch.allclose(inverse, torch.linalg.inv(M), rtol=1e-8, atol=1e-10)
    if path == "lapack":
        assert inverse.data_ptr() == factor.data.data_ptr()


def test_an_overwritten_input_becomes_the_factor(path):
    M = spd(50)
    scratch = M.clone()
    factor = cholesky(scratch, overwrite=True)
    assert torch.allclose(factor.inverse(), torch.linalg.inv(M), rtol=1e-8, atol=1e-10)
    assert (factor.data.data_ptr() == scratch.data_ptr()) == (path == "lapack")


def test_half_solve_gives_the_quadratic_form(path):
    M = spd(300)
    B = torch.randn(300, 5, dtype=torch.float64)
    quad = float(cholesky(M).half_solve(B).square().sum())
    assert quad == pytest.approx(float((B * torch.linalg.solve(M, B)).sum()), rel=1e-10)


def test_shift_factors_the_damped_matrix(path):
    M = spd(30)
    M[:, 0] = M[0, :] = 0.0  # singular: a feature that is always zero
    assert cholesky(M) is None
    factor = cholesky(M, shift=1e-3)
    assert factor is not None
    damped = M + 1e-3 * torch.eye(30, dtype=torch.float64)
    assert torch.allclose(factor.inverse(), torch.linalg.inv(damped), rtol=1e-8, atol=1e-8)
    assert float(M[0, 0]) == 0.0  # the caller's matrix is not damped


def test_not_positive_definite_gives_none(path):
    M = -spd(10)
    assert cholesky(M) is None


def test_float32(path):
    M = spd(64, torch.float32)
    factor = cholesky(M)
    assert factor.data.dtype == torch.float32
    B = torch.randn(64, 3)
    assert torch.allclose(factor.solve(B), torch.linalg.solve(M.double(), B.double()).float(), rtol=1e-3, atol=1e-3)
    assert torch.allclose(factor.inverse(), torch.linalg.inv(M.double()).float(), rtol=1e-3, atol=1e-3)


def test_a_lower_factor_in_torch_layout_inverts_like_cholesky_inverse(path):
    """The swap phase inverts the greedy's lower triangular U_S U_S^T from U_S itself."""
    L = torch.linalg.cholesky(spd(300))
    L_garbage_above = L + torch.triu(torch.ones_like(L), 1)  # the upper triangle is never read
    inverse = Cholesky(L_garbage_above if path == "lapack" else L, upper=False).inverse()
    assert torch.equal(inverse, inverse.T)
    assert torch.allclose(inverse, torch.cholesky_inverse(L), rtol=1e-9, atol=1e-9)
