"""One layer's pruning problem: validated inputs, the objective f and the refit every method shares.

    f(S) = min_W 1/2 Tr(W^T H W) - Tr(G^T W)   s.t. rows of the groups in S are zero,
    H = X^T X (d1 x d1), G = X^T X_hat W_hat (d1 x d2), groups = contiguous blocks of `group_size` rows.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .linalg import Cholesky, cholesky

log = logging.getLogger(__name__)

# Damping for factorisations of (sub-blocks of) H: delta = lambda * mean(diag H) with lambda taken from
# this ladder, first rung that factorises. 0 first: the answer is then exactly the caller's problem.
DAMPING_LADDER = (0.0, 1e-10, 1e-8, 1e-6, 1e-4, 1e-2)


# rows of H gathered at a time (`principal_block`, `LayerProblem.objective`): a gather of whole rows first
# makes a rows x d1 temporary, and a large layer's H is most of the solve's memory (d1 = 8,192: 0.5 GB)
SLAB_ROWS = 1024


class IllConditioned(ValueError):
    """H is too ill-conditioned for a method's search, or to factorise at all, even with the largest damping of
    DAMPING_LADDER (statistics at rounding level: an EfficientNet squeeze-excite conv whose inputs are ~1e-10
    measured eigenvalues of -8.7e-21 beside a mean diagonal of 6.2e-21)."""


@dataclass(frozen=True)
class LayerProblem:
    """Validated inputs of `solve_layer`, on the caller's device, in float64 for exact evaluation."""

    H: Tensor  # d1 x d1, symmetric PSD, float64
    G: Tensor  # d1 x d2, float64
    group_size: int
    num_prune: int
    dense_weight: Tensor | None  # d1 x d2 float64, or None
    out_dtype: torch.dtype  # dtype of the returned weight (the caller's G dtype)
    # an upper bound on rank(H) (the calibration rows behind it, one fewer once centred), or None: a
    # factorisation of more rows than that is singular, so it starts at the first positive damping rung
    rank: int | None = None
    # the column scale `dense_weight` carries (a post-norm's gamma, a next BatchNorm's gamma / sigma, which weight
    # the objective's error), or None: MP ranks the weight as the model holds it (the OSSCAR paper's MP and MP+)
    magnitude_scale: Tensor | None = None

    def singular(self, rows: int) -> bool:
        """Whether a principal block of `rows` rows of H is known to be singular (from `rank`)."""
        return self.rank is not None and self.rank < rows

    @property
    def d1(self) -> int:
        return self.H.shape[0]

    @property
    def num_groups(self) -> int:
        return self.d1 // self.group_size

    @property
    def device(self) -> torch.device:
        return self.H.device

    @property
    def mean_diag(self) -> float:
        return float(self.H.diagonal().mean())

    @classmethod
    def validate(
        cls,
        H: Tensor,
        G: Tensor,
        group_size: int,
        num_prune: int,
        dense_weight: Tensor | None = None,
        rank: int | None = None,
    ) -> LayerProblem:
        """Check every input and raise one ValueError that names each problem found."""
        errors: list[str] = []
        if not isinstance(H, Tensor) or not isinstance(G, Tensor):
            raise ValueError("H and G must be torch.Tensor")
        if not H.is_floating_point() or not G.is_floating_point():
            errors.append(f"H and G must be floating point (got {H.dtype}, {G.dtype})")
        if H.dim() != 2 or H.shape[0] != H.shape[1]:
            errors.append(f"H must be square d1 x d1 (got shape {tuple(H.shape)})")
        if G.dim() != 2 or (H.dim() == 2 and G.shape[0] != H.shape[0]):
            errors.append(f"G must be d1 x d2 with d1 = {H.shape[0]} (got shape {tuple(G.shape)})")
        if H.device != G.device:
            errors.append(f"H and G are on different devices ({H.device}, {G.device})")
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            errors.append(f"group_size must be a positive int (got {group_size!r})")
        elif H.dim() == 2 and H.shape[0] % group_size != 0:
            errors.append(f"d1 = {H.shape[0]} is not divisible by group_size = {group_size}")
        if dense_weight is not None:
            if not isinstance(dense_weight, Tensor) or dense_weight.shape != G.shape:
                shape = tuple(dense_weight.shape) if isinstance(dense_weight, Tensor) else None
                errors.append(f"dense_weight must have G's shape {tuple(G.shape)} (got {shape})")
            elif dense_weight.device != G.device:
                errors.append(f"dense_weight is on {dense_weight.device}, G on {G.device}")
            elif not _all_finite(dense_weight):
                errors.append("dense_weight contains NaN or Inf")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
            errors.append(f"rank must be a non-negative int or None (got {rank!r})")
        if errors:
            raise ValueError("invalid layer problem: " + "; ".join(errors))
        num_groups = H.shape[0] // group_size
        if isinstance(num_prune, bool) or not isinstance(num_prune, int):
            errors.append(f"num_prune must be an int (got {num_prune!r})")
        elif not 0 <= num_prune <= num_groups:
            errors.append(f"num_prune = {num_prune} is outside [0, {num_groups}] (number of groups)")
        lo, hi = (float(v) for v in torch.aminmax(H.detach()))
        if not (math.isfinite(lo) and math.isfinite(hi)):
            errors.append("H contains NaN or Inf")
        if not _all_finite(G):
            errors.append("G contains NaN or Inf")
        if errors:
            raise ValueError("invalid layer problem: " + "; ".join(errors))
        H64 = H.detach().to(torch.float64)
        if bool((H64.diagonal() < 0).any()):
            errors.append("H has negative diagonal entries, so it is not positive semi-definite")
        # Symmetry by a random-sign probe (O(d1^2), no transposed copy): for symmetric H the two
        # products agree to rounding; an unsymmetric H misses by ~ max|H| sqrt(d1).
        gen = torch.Generator(device=H.device).manual_seed(0)
        v = torch.randint(0, 2, (H64.shape[0], 1), generator=gen, device=H.device)
        v = v.to(torch.float64) * 2 - 1
        gap = float((H64 @ v - H64.T @ v).abs().max()) if H64.numel() else 0.0
        scale = max(abs(lo), abs(hi))
        if gap > 1e-4 * scale * math.sqrt(H64.shape[0]):
            errors.append(f"H is not symmetric (probe |Hv - H^T v| = {gap:.3g}, max |H| = {scale:.3g})")
        if errors:
            raise ValueError("invalid layer problem: " + "; ".join(errors))
        W_hat = None if dense_weight is None else dense_weight.detach().to(torch.float64).contiguous()
        G64 = G.detach().to(torch.float64).contiguous()
        return cls(H64.contiguous(), G64, group_size, num_prune, W_hat, G.dtype, rank)

    # ---- shared numerics -------------------------------------------------------------------
    def objective(self, W: Tensor) -> float:
        """1/2 Tr(W^T H W) - Tr(G^T W) with the caller's H (float64), over W's nonzero rows only."""
        W = W.to(torch.float64)
        rows = torch.nonzero((W != 0).any(1)).squeeze(1)  # zero rows contribute nothing
        W_r = W.index_select(0, rows)
        f = W.new_zeros(())
        # by slabs of rows: H_rr whole would be a copy of most of H beside it, and the linear term's product
        # a d1 x d2 temporary or two (a down projection's solve: 0.4 GB beside its H)
        for lo in range(0, rows.numel(), SLAB_ROWS):
            slab = rows[lo : lo + SLAB_ROWS]
            W_s = W_r[lo : lo + slab.numel()]
            f += (W_s * (0.5 * (self.H.index_select(0, slab).index_select(1, rows) @ W_r)
                         - self.G.index_select(0, slab))).sum()
        return float(f)

    def refit(self, pruned: Tensor) -> Tensor:
        """The optimal W (float64) for the support that excludes `pruned` groups."""
        kept = torch.ones(self.num_groups, dtype=torch.bool, device=self.device)
        kept[pruned] = False
        K = group_rows(torch.nonzero(kept).squeeze(1), self.group_size)
        W = torch.zeros_like(self.G)
        if K.numel():
            H_KK = principal_block(self.H, K)
            factor, _ = factorize(H_KK, self.mean_diag, what="H on the kept rows", singular=self.singular(K.numel()))
            W[K] = factor.solve(self.G.index_select(0, K))
        return W

    def magnitude_order(self) -> Tensor:
        """Groups of the dense weight by increasing Frobenius norm (MP's pruning order)."""
        if self.dense_weight is None:
            raise ValueError("this method needs dense_weight (the layer's dense weight W_hat)")
        weight = self.dense_weight if self.magnitude_scale is None else \
            self.dense_weight / self.magnitude_scale.to(self.dense_weight)  # d1 x d2, columns unscaled
        norms = weight.reshape(self.num_groups, -1).square().sum(1)
        return torch.argsort(norms, stable=True)


def principal_block(M: Tensor, rows: Tensor) -> Tensor:
    """M[rows][:, rows] (a copy), gathered SLAB_ROWS rows at a time."""
    out = M.new_empty(rows.numel(), rows.numel())
    for lo in range(0, rows.numel(), SLAB_ROWS):
        out[lo : lo + SLAB_ROWS] = M.index_select(0, rows[lo : lo + SLAB_ROWS]).index_select(1, rows)
    return out


def group_rows(groups: Tensor | Sequence[int], group_size: int) -> Tensor:
    """Row indices of `groups` (contiguous blocks of `group_size` rows), group by group in the given
    order, on the groups' device."""
    groups = torch.as_tensor(groups, dtype=torch.long)
    if group_size == 1:  # the groups are the rows (a view; the swap rounds call this a dozen times a round)
        return groups.reshape(-1)
    offsets = torch.arange(group_size, device=groups.device)
    return (groups.reshape(-1, 1) * group_size + offsets).reshape(-1)


def host_index(values: Sequence[int] | Sequence[Sequence[int]], device: torch.device | str) -> Tensor:
    """Indices known on the host as a long tensor on `device`, without making the host wait for the device:
    on a GPU a copy from pageable memory waits for the stream, one from pinned memory is queued behind it."""
    index = torch.tensor(values, dtype=torch.long)
    if torch.device(device).type == "cpu":
        return index
    return index.pin_memory().to(device, non_blocking=True)


def _all_finite(x: Tensor) -> bool:
    """No NaN or Inf, in one reduction pass (aminmax propagates both; isfinite allocates a mask)."""
    if x.numel() == 0:
        return True
    lo, hi = torch.aminmax(x.detach())
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def damping_delta(lam: float, mean_diag: float) -> float:
    """delta = lam * mean(diag H); a zero diagonal is damped by lam alone, so that an all-zero H still
    factorises."""
    return lam * (mean_diag if mean_diag > 0 else 1.0)


def damp(M: Tensor, lam: float, mean_diag: float) -> Tensor:
    """M + delta I (`damping_delta`; M itself for lam = 0)."""
    if not lam:
        return M
    damped = M.clone()
    damped.diagonal().add_(damping_delta(lam, mean_diag))
    return damped


def factorize(M: Tensor, mean_diag: float, what: str = "H", floor: float = 0.0,
              singular: bool = False) -> tuple[Cholesky, float]:
    """Cholesky factor of M + delta I, with delta the first rung of DAMPING_LADDER (at least `floor`)
    that works.

    Returns (factor, lambda used). H = X^T X is PSD but singular whenever a row of X is constant
    zero or there are fewer samples than features; the tiny damping then picks the minimum-norm-like
    solution among the optimal ones without changing f by more than rounding. `singular`: M is known
    to be singular (more rows than the rank bound of H), so the undamped rung is skipped: its Cholesky
    would fail part-way (0.28 s at d1 = 5504 here) or, worse, pass on rounding-level pivots.
    """
    for lam in DAMPING_LADDER:
        if lam < floor or (singular and not lam):  # M known singular: rung 0 would fail (or pass by rounding)
            continue
        factor = cholesky(M, damping_delta(lam, mean_diag) if lam else 0.0)
        if factor is not None and not lam and _rank_deficient(factor, M):
            factor = None  # passed on rounding-level pivots: its inverse and f would be noise
        if factor is not None:
            if lam:
                log.debug("factorised %s with damping %.0e * mean(diag H)", what, lam)
            return factor, lam
    raise IllConditioned(f"{what} is not positive semi-definite (Cholesky fails even with damping)")


def _rank_deficient(factor: Cholesky, M: Tensor) -> bool:
    """Whether an undamped factor of M has a pivot at rounding level: smallest pivot^2 below n eps max(diag M),
    LAPACK's rank tolerance (pstrf). An exactly singular M (an input that copies or combines others, which a
    rank bound from the calibration rows cannot see) factorises by rounding and its solves are noise."""
    n = M.shape[0]
    if not n:
        return False
    smallest = float(factor.data.diagonal().abs().min()) ** 2
    return smallest <= n * torch.finfo(M.dtype).eps * float(M.diagonal().max())


@dataclass
class LayerSolution:
    """What `solve_layer` returns."""

    pruned: list[int]  # sorted pruned group indices, len == num_prune
    weight: Tensor  # d1 x d2, optimal for the support (except the dense-row methods: DENSE_ROWS_METHODS); pruned rows 0
    objective: float  # 1/2 Tr(W^T H W) - Tr(G^T W) for `weight` and the caller's H
    method: str
    stats: dict[str, float | int | str] = field(default_factory=dict)  # timings, rounds, damping
