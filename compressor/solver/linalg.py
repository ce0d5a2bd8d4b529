"""Cholesky factorisation, solve and inverse of the solver's large symmetric positive definite matrices.

On the CPU, torch's routines copy the input to column-major order, call LAPACK, then clear (`tril`) or
mirror the triangle LAPACK leaves alone; at the sizes the solver factorises, those passes cost more than
LAPACK's own work (d1 = 4096, 2 threads: `torch.linalg.cholesky` 0.38 s, LAPACK's `dpotrf` 0.13 s).
A symmetric matrix needs no reordering (its row-major buffer *is* its column-major one), so here LAPACK
runs in place on one copy, through the LAPACK that torch itself links (MKL in the x86-64 wheels; it obeys
`torch.set_num_threads`) when that library exports it and passes a check on a known problem. Everywhere
else (CUDA, builds without those symbols) torch's routines do the same work.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger(__name__)

_PREFIX = {torch.float64: "d", torch.float32: "s"}
_LIBRARY = {"linux": "libtorch_cpu.so", "darwin": "libtorch_cpu.dylib"}
# mirroring a triangle tile by tile keeps both the read and the write cache-friendly (one strided pass
# over the whole matrix costs about as much as LAPACK's inverse of it)
_TILE = 256


@dataclass(frozen=True)
class _Lapack:
    """LAPACK's potrf / potri / potrs (LP64 interface) for each supported dtype."""

    potrf: dict[torch.dtype, Callable[..., Any]]
    potri: dict[torch.dtype, Callable[..., Any]]
    potrs: dict[torch.dtype, Callable[..., Any]]


@functools.cache
def _lapack() -> _Lapack | None:
    """torch's own LAPACK, or None when it is not reachable or fails the check."""
    name = _LIBRARY.get(sys.platform)
    if name is None:
        return None
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / name))
        found = _Lapack(*({dt: getattr(lib, f"{p}{routine}_") for dt, p in _PREFIX.items()}
                          for routine in ("potrf", "potri", "potrs")))
    except (OSError, AttributeError) as err:
        log.debug("LAPACK not reachable through torch (%s): torch's Cholesky routines are used", err)
        return None
    if not _passes_check(found):
        log.warning("torch's LAPACK failed a known Cholesky problem: torch's Cholesky routines are used")
        return None
    return found


def _passes_check(lapack: _Lapack) -> bool:
    """Factor, solve and invert [[4, 2], [2, 3]] (L = [[2, 0], [1, sqrt 2]], inverse [[3, -2], [-2, 4]] / 8):
    a wrong integer width or calling convention gives other numbers (or a nonzero info)."""
    M = torch.tensor([[4.0, 2.0], [2.0, 3.0]], dtype=torch.float64)
    for dtype in _PREFIX:
        tol = 1e-6 if dtype == torch.float32 else 1e-12
        buf = M.to(dtype, copy=True)
        if _call(lapack.potrf[dtype], buf) != 0 or abs(float(buf[0, 1]) - 1.0) > tol:
            return False
        b = torch.tensor([[1.0, 0.0]], dtype=dtype)  # column-major 2 x 1
        if _call(lapack.potrs[dtype], buf, b) != 0 or abs(float(b[0, 0]) - 3 / 8) > tol:
            return False
        if _call(lapack.potri[dtype], buf) != 0 or abs(float(buf[0, 1]) + 2 / 8) > tol:
            return False
    return True


def _call(routine: Callable[..., Any], A: Tensor, B: Tensor | None = None, uplo: bytes = b"L") -> int:
    """routine(uplo, n, [nrhs,] A, lda, [B, ldb,] info) on column-major buffers; returns info."""
    n, info, u = ctypes.c_int(A.shape[0]), ctypes.c_int(0), ctypes.c_char(uplo)
    a = ctypes.c_void_p(A.data_ptr())
    if B is None:
        routine(ctypes.byref(u), ctypes.byref(n), a, ctypes.byref(n), ctypes.byref(info))
    else:
        nrhs, b = ctypes.c_int(B.shape[0]), ctypes.c_void_p(B.data_ptr())
        routine(ctypes.byref(u), ctypes.byref(n), ctypes.byref(nrhs), a, ctypes.byref(n), b, ctypes.byref(n),
                ctypes.byref(info))
    if info.value < 0:  # an argument LAPACK rejected: a bug here, not a property of the matrix
        raise RuntimeError(f"LAPACK rejected argument {-info.value}")
    return info.value


def _lapack_for(M: Tensor) -> _Lapack | None:
    if M.device.type != "cpu" or M.dtype not in _PREFIX or M.dim() != 2 or M.shape[0] == 0 or not M.is_contiguous():
        return None
    return _lapack()


def lapack_in_use(M: Tensor) -> bool:
    """Whether `cholesky(M)` calls LAPACK directly (CPU, float32/64, torch's LAPACK reachable)."""
    return _lapack_for(M) is not None


@dataclass(frozen=True)
class Cholesky:
    """M = L L^T, held as one square row-major buffer of which one triangle is the factor: the upper
    one holds L^T (`upper`, LAPACK's in-place result), the lower one L (torch's layout). The other triangle
    is never read: LAPACK's result leaves M's entries there."""

    data: Tensor  # n x n
    upper: bool

    def _uplo(self) -> bytes:
        # the row-major upper triangle is the column-major lower one
        return b"L" if self.upper else b"U"

    def solve(self, B: Tensor) -> Tensor:
        """M^-1 B (B: n x k)."""
        lapack = _lapack_for(self.data)
        if lapack is None:
            return torch.cholesky_solve(B, self.data, upper=self.upper)
        # k x n row-major = n x k column-major; always a copy (LAPACK overwrites it, and for k = 1 or n = 1
        # B.T is already "contiguous", sharing B's memory)
        X = B.T.to(self.data.dtype, memory_format=torch.contiguous_format, copy=True)
        if _call(lapack.potrs[self.data.dtype], self.data, X, self._uplo()):
            raise RuntimeError("LAPACK potrs failed on a factor it produced")
        return X.T

    def half_solve(self, B: Tensor) -> Tensor:
        """L^-1 B (B: n x k): |L^-1 B|^2 = Tr(B^T M^-1 B) at half the cost of a solve. The triangular solve
        reads only the factor's triangle (torch's contract), so LAPACK's buffer needs no clearing."""
        return torch.linalg.solve_triangular(self.data.T if self.upper else self.data, B, upper=False)

    def inverse(self, overwrite: bool = False) -> Tensor:
        """M^-1, symmetric (both triangles). `overwrite`: reuse the factor's buffer (the factor is then gone)."""
        lapack = _lapack_for(self.data)
        if lapack is None:
            return torch.cholesky_inverse(self.data, upper=self.upper)
        A = self.data if overwrite else self.data.clone()
        if _call(lapack.potri[A.dtype], A, uplo=self._uplo()):
            raise RuntimeError("LAPACK potri found a zero pivot in a factor it produced")
        return _mirror(A, self.upper)


def cholesky(M: Tensor, shift: float = 0.0, overwrite: bool = False) -> Cholesky | None:
    """The Cholesky factor of M + shift I (M symmetric: only one triangle is read), or None when that is not
    positive definite. `overwrite`: M is a scratch copy that may become the factor (on LAPACK's path; M is
    then invalid either way); otherwise M is not modified."""
    lapack = _lapack_for(M)
    if lapack is None:
        if shift:
            M = M.clone()
            M.diagonal().add_(shift)
        L, info = torch.linalg.cholesky_ex(M)
        return Cholesky(L, upper=False) if int(info) == 0 else None
    A = M if overwrite else M.clone()
    if shift:
        A.diagonal().add_(shift)
    return Cholesky(A, upper=True) if _call(lapack.potrf[A.dtype], A) == 0 else None


def _mirror(A: Tensor, from_upper: bool) -> Tensor:
    """Copy A's upper (or lower) triangle onto the other one, in place, tile row by tile row."""
    n = A.shape[0]
    for i in range(0, n, _TILE):
        j = min(i + _TILE, n)
        if i:
            if from_upper:
                A[i:j, :i] = A[:i, i:j].T
            else:
                A[:i, i:j] = A[i:j, :i].T
        D = A[i:j, i:j]
        D.copy_(D.triu() + D.triu(1).T if from_upper else D.tril() + D.tril(-1).T)
    return A
