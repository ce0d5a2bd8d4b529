"""The layer problem's incremental state: Proposition 1 (cases 1-3) and Lemma A.1 of the paper.

For kept rows K and pruned rows S (unions of groups) the paper keeps H_KK^-1 and the optimal W.
The swap rounds also need the complement that case 2 works with, so the state here is the *swept*
matrix of the sweep operator (Goodnight 1979), in which pruning and restoring a group are the same
rank-t update and both kinds of impact B_j are read off diagonal blocks:

    A[K, K] = -H_KK^-1                      (case 1 downdates this: A - B C^-1 B^T)
    A[K, S] =  H_KK^-1 H_KS                 (case 2 grows the support with it)
    A[S, S] =  H_SS - H_SK H_KK^-1 H_KS     (Schur complement; its g x g blocks are case 2's "C^-1")
    Z[K]    =  W_K = H_KK^-1 G_K            (the optimal weight on the support)
    Z[S]    =  G_S - H_SK W_K               (minus the gradient at the pruned rows)
    f       =  -1/2 Tr(G_K^T H_KK^-1 G_K)

Pruning group j costs  B_j = 1/2 Tr(Z_j^T (-A_jj)^-1 Z_j)   (Lemma A.1: only the g x g block);
restoring it gains     B_j = 1/2 Tr(Z_j^T ( A_jj)^-1 Z_j)   (case 2);
a swap (case 3) is a restore followed by a prune (sweeps commute).

Two phases, two representations, neither of which ever touches all of A:
  * `NestedState` (nested greedy, case 1 only): a left-looking pivoted Cholesky of H^-1.
  * `SwapState` (swap rounds): A as its columns on demand, from H^-1, the greedy's factors and the
    list of moves applied since; a round costs O(d1 R), not O(d1^2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .problem import group_rows


class PivotError(RuntimeError):
    """A pivot block lost positive definiteness: the state drifted (or H is too ill-conditioned)."""


def block_gram(Z: Tensor, group_size: int) -> Tensor:
    """(p, g, g) Gram blocks Z_j Z_j^T of every group's rows."""
    if group_size == 1:
        return torch.linalg.vector_norm(Z, dim=1).square().view(-1, 1, 1)
    Zg = Z.view(-1, group_size, Z.shape[1])
    return Zg @ Zg.transpose(1, 2)


def block_scores(blocks: Tensor, gram: Tensor) -> Tensor:
    """1/2 Tr(Z_j^T blocks_j^-1 Z_j) = 1/2 Tr(blocks_j^-1 Z_j Z_j^T) for every group j.

    blocks (p, g, g) positive definite, gram (p, g, g) from `block_gram`: the solves stay g x g
    (batched triangular solves with d2 right-hand sides are slow). nan where a block is not PD.
    """
    p, g = blocks.shape[0], blocks.shape[1]
    if g == 1:
        return 0.5 * gram.view(p) / blocks.view(p)
    chol, info = torch.linalg.cholesky_ex(blocks)
    traces = torch.cholesky_solve(gram, chol).diagonal(dim1=1, dim2=2).sum(1)
    return torch.where(info == 0, 0.5 * traces, torch.nan)


def _pivot_inverse(pivot: Tensor, sign: float) -> Tensor:
    """A_PP^-1 for a pivot block that is positive definite after multiplying by `sign`."""
    chol, info = torch.linalg.cholesky_ex(sign * pivot)
    if int(info) != 0:
        raise PivotError(f"pivot block of {pivot.shape[0]} rows is not positive definite")
    return sign * torch.cholesky_inverse(chol)


def sweep_dense(A: Tensor, Z: Tensor, rows: Tensor, restore: bool) -> float:
    """Sweep `rows` of an explicit (A, Z) in place; restore=True moves them into the support.

    Returns the change of f. Used on small sub-blocks, to evaluate a candidate move exactly.
    """
    sign = 1.0 if restore else -1.0
    pivot_inv = _pivot_inverse(A[rows][:, rows], sign)  # A_PP^-1
    col = A[:, rows]  # d1 x m (a copy: advanced indexing)
    z_rows = Z[rows]  # m x d2
    F = col @ pivot_inv  # d1 x m
    A.addmm_(F, col.T, alpha=-1.0)  # A_QQ - A_QP A_PP^-1 A_PQ; zeroes rows/cols P
    Z.addmm_(F, z_rows, alpha=-1.0)
    pz = pivot_inv @ z_rows  # m x d2
    A[:, rows] = sign * F
    A[rows, :] = sign * F.T
    A[rows.unsqueeze(1), rows] = -pivot_inv
    Z[rows] = sign * pz
    return float(-0.5 * (z_rows * pz).sum())


class NestedState:
    """The nested greedy phase (t_i = p_i, case 1 only) as a left-looking pivoted Cholesky of H^-1.

    Pruning rows P downdates H_cur^-1 by H_cur^-1[:, P] C^-1 H_cur^-1[P, :] (case 1). Applying every
    downdate to the whole matrix costs 2 R d1 (d1 + d2) over R pruned rows. Here H^-1 stays as it
    is and the downdates accumulate as factors U (H_cur^-1 = H^-1 - U U^T); a step forms only the m
    rows it pivots on, d1 R^2 flops in all.

    Life cycle: __init__ (one factorisation of H) -> scores / prune -> to_swap (or reset).
    """

    def __init__(self, H: Tensor, G: Tensor, group_size: int, capacity: int, *,
                 factor: Tensor | None = None) -> None:
        """`factor`: a Cholesky factor the caller already has (of H, possibly damped); H then only gives
        the shape, dtype and device."""
        d1, g = H.shape[0], group_size
        chol = factor
        if chol is None:
            chol, info = torch.linalg.cholesky_ex(H)
            if int(info) != 0:
                raise PivotError("H is not positive definite")
        self.group_size = g
        self.Hinv = torch.cholesky_inverse(chol)  # d1 x d1: H^-1, never modified
        self.W0 = self.Hinv @ G  # d1 x d2: optimal W with nothing pruned
        self.f0 = float(-0.5 * (G * self.W0).sum())
        self.U = torch.empty(d1, capacity * g, dtype=H.dtype, device=H.device)  # downdate factors
        self.reset()

    def reset(self) -> None:
        """Back to the dense support (H^-1 and W0 are kept, so this costs no factorisation)."""
        p, g = self.Hinv.shape[0] // self.group_size, self.group_size
        self.W = self.W0.clone()  # optimal W on the current support
        self.f = self.f0
        self.kept = torch.ones(p, dtype=torch.bool, device=self.W.device)
        # g x g diagonal blocks of H_cur^-1, in step with U
        self.blocks = self.Hinv.view(p, g, p, g).diagonal(dim1=0, dim2=2).permute(2, 0, 1).clone()
        self.n = 0  # columns of U in use
        self.order: list[Tensor] = []  # pruned groups, in pivot order

    @property
    def num_groups(self) -> int:
        return self.kept.numel()

    def scores(self) -> Tensor:
        """Prune cost B_j = 1/2 Tr(W_j^T C_j^-1 W_j) of every kept group (Lemma A.1); inf if pruned."""
        gram = block_gram(self.W, self.group_size)
        cost = torch.where(self.kept, block_scores(self.blocks, gram), torch.inf)
        if bool(cost.isnan().any()):
            raise PivotError("a kept group's block of H^-1 is not positive definite")
        return cost

    def _rows_of_inverse(self, rows: Tensor) -> Tensor:
        """H_cur^-1[rows, :] (m x d1), formed from H^-1 and U (H^-1 is symmetric: row gathers only)."""
        out = self.Hinv.index_select(0, rows)
        if self.n:
            U = self.U[:, : self.n]
            out.addmm_(U.index_select(0, rows), U.T, alpha=-1.0)
        return out

    def _dense_block(self, groups: Tensor) -> tuple[Tensor, Tensor]:
        """H^-1[P, P] and W0[P] for the rows P of `groups` (sorted)."""
        mask = torch.zeros(self.Hinv.shape[0], dtype=torch.bool, device=groups.device)
        mask[group_rows(groups, self.group_size)] = True  # boolean gathers beat index_select(1)
        return self.Hinv[mask][:, mask], self.W0[mask]

    def dense_prune_delta(self, groups: Tensor) -> float:
        """f(groups) - f({}) = 1/2 Tr(W0_P^T H^-1[P, P]^-1 W0_P), by one m x m factorisation."""
        M, X = self._dense_block(groups)
        chol, info = torch.linalg.cholesky_ex(M)
        if int(info) != 0:
            raise PivotError(f"pivot block of {M.shape[0]} rows is not positive definite")
        return float(0.5 * torch.linalg.solve_triangular(chol, X, upper=False).square().sum())

    def dense_prune_delta_lower_bound(self, groups: Tensor) -> float:
        """A lower bound on dense_prune_delta(groups) without a factorisation.

        For M positive definite and any Y, Tr(X^T M^-1 X) >= 2 Tr(Y^T X) - Tr(Y^T M Y); with
        Y = alpha D^-1 X (D = diag M) and the best alpha this is a^2 / b, a = Tr(X^T D^-1 X),
        b = Tr(Y^T M Y) at alpha = 1: one GEMM instead of a Cholesky and a triangular solve.
        """
        M, X = self._dense_block(groups)
        Y = X / M.diagonal().unsqueeze(1)
        a = float((X * Y).sum())
        b = float((Y * (M @ Y)).sum())
        return 0.5 * a * a / b if b > 0 else 0.0

    def prune(self, groups: Tensor) -> None:
        """Case 1 for `groups` (all kept): downdate the inverse and the weight, update f."""
        assert bool(self.kept[groups].all()), "prune() takes kept groups only"
        rows = group_rows(groups, self.group_size)
        m, n = rows.numel(), self.n
        cols_t = self._rows_of_inverse(rows)  # m x d1
        chol, info = torch.linalg.cholesky_ex(cols_t[:, rows])  # C = H_cur^-1[P, P] = Lc Lc^T
        if int(info) != 0:
            raise PivotError(f"pivot block of {m} rows is not positive definite")
        u_new = torch.linalg.solve_triangular(chol, cols_t, upper=False).T  # d1 x m: cols Lc^-T
        u_new[~self.kept.repeat_interleave(self.group_size)] = 0  # exactly 0 there, not rounding
        y = torch.linalg.solve_triangular(chol, self.W[rows], upper=False)  # Lc^-1 W_P, m x d2
        self.W.addmm_(u_new, y, alpha=-1.0)
        self.W[rows] = 0
        self.f += float(0.5 * y.square().sum())
        self.U[:, n : n + m] = u_new
        self.n = n + m
        p, g = self.num_groups, self.group_size
        if g == 1:
            self.blocks.view(p).sub_(u_new.square().sum(1))
        else:
            ub = u_new.contiguous().view(p, g, m)
            self.blocks -= ub @ ub.transpose(1, 2)
        self.kept[groups] = False
        self.order.append(groups)

    def pruned(self) -> Tensor:
        return torch.nonzero(~self.kept).squeeze(1)

    def to_swap(self) -> SwapState:
        """The swap phase's state for the current support; shares H^-1 and U (no copy)."""
        return SwapState(self)


@dataclass(frozen=True)
class _Move:
    """One sweep applied in the swap phase: A' = A - F col^T, then rows/cols P replaced."""

    rows: Tensor  # P (m,)
    F: Tensor  # d1 x m: col A_PP^-1
    col: Tensor  # d1 x m: A[:, P] before the move
    pivot_inv: Tensor  # m x m: A_PP^-1
    sign: float  # +1 restore, -1 prune


class SwapState:
    """The swept state during the swap rounds, with A held implicitly.

    With the greedy's pruned rows S in pivot order, U_S = U[S] is lower triangular with
    H^-1[S, S] = U_S U_S^T and H^-1[K, S] = U_K U_S^T, so the swept matrix at the end of the greedy is
        A_KK = -(H^-1[K, K] - U_K U_K^T),   A_KS = -U_K U_S^-1,   A_SS = (U_S U_S^T)^-1,
    and every column of it costs O(d1 R). Moves (sweeps) are recorded and replayed on the columns a
    later step asks for; the diagonal blocks, Z and f are kept up to date eagerly.
    """

    def __init__(self, nested: NestedState) -> None:
        g = nested.group_size
        self.group_size = g
        self.kept = nested.kept.clone()  # current support, by group
        self.f = nested.f
        self._Hinv = nested.Hinv
        d1 = self._Hinv.shape[0]
        base_kept = nested.kept.repeat_interleave(g)
        self._K = torch.nonzero(base_kept).squeeze(1)  # the greedy's kept rows
        self._S = group_rows(torch.cat(nested.order), g) if nested.order else self._K[:0]
        U = nested.U[:, : nested.n]
        self._U_K = U.index_select(0, self._K)  # |K| x R (copies: the greedy's buffer may be reused)
        self._U_S = U.index_select(0, self._S)  # R x R, lower triangular
        # position of each row within K (natural order) or S (pivot order); -1 elsewhere
        self._k_pos = torch.full((d1,), -1, dtype=torch.long, device=U.device)
        self._k_pos[self._K] = torch.arange(self._K.numel(), device=U.device)
        self._s_pos = torch.full((d1,), -1, dtype=torch.long, device=U.device)
        self._s_pos[self._S] = torch.arange(self._S.numel(), device=U.device)
        self.Z = nested.W  # taken over: NestedState.reset() allocates a new W
        self.blocks = -nested.blocks  # kept groups: -H_cur^-1 blocks
        if self._S.numel():
            sigma = torch.cholesky_inverse(self._U_S)  # A_SS = (U_S U_S^T)^-1, R x R
            self.Z[self._S] = sigma @ nested.W0.index_select(0, self._S)
            r = self._S.numel() // g
            sigma_blocks = sigma.view(r, g, r, g).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
            self.blocks[torch.cat(nested.order)] = sigma_blocks
        self.moves: list[_Move] = []

    @property
    def num_groups(self) -> int:
        return self.kept.numel()

    def columns(self, rows: Tensor) -> Tensor:
        """A[:, rows] of the current state (d1 x m)."""
        out = self._base_columns(rows)
        for mv in self.moves:
            out.addmm_(mv.F, mv.col[rows].T, alpha=-1.0)
            out[mv.rows] = mv.sign * mv.F[rows].T
            # columns that were pivots of this move: A'[:, P] = sign F, A'[P, P] = -A_PP^-1
            hit = torch.nonzero(torch.isin(rows, mv.rows)).squeeze(1)
            if hit.numel():
                where = torch.nonzero(mv.rows.unsqueeze(0) == rows[hit].unsqueeze(1))[:, 1]
                out[:, hit] = mv.sign * mv.F[:, where]
                out[mv.rows.unsqueeze(1), hit] = -mv.pivot_inv[:, where]
        return out

    def _base_columns(self, rows: Tensor) -> Tensor:
        """Columns of the swept matrix at the end of the greedy (see the class docstring)."""
        K, S = self._K, self._S
        m = rows.numel()
        pos = self._s_pos[rows]
        was_kept = pos < 0
        kept_cols = torch.nonzero(was_kept).squeeze(1)
        pruned_cols = torch.nonzero(~was_kept).squeeze(1)
        col_K = torch.empty(K.numel(), m, dtype=self._Hinv.dtype, device=self._Hinv.device)
        col_S = torch.empty(S.numel(), m, dtype=self._Hinv.dtype, device=self._Hinv.device)
        if kept_cols.numel():
            r = rows[kept_cols]
            u_r = self._U_K.index_select(0, self._k_pos[r])  # m_k x R
            hinv_r = self._Hinv.index_select(0, r).index_select(1, K)  # H^-1[r, K]
            col_K[:, kept_cols] = self._U_K @ u_r.T - hinv_r.T  # -(H^-1[K, r] - U_K U_r^T)
            if S.numel():
                col_S[:, kept_cols] = -torch.linalg.solve_triangular(self._U_S.T, u_r.T, upper=True)
        if pruned_cols.numel():
            e = torch.zeros(S.numel(), pruned_cols.numel(), dtype=col_S.dtype, device=col_S.device)
            e[pos[pruned_cols], torch.arange(pruned_cols.numel(), device=e.device)] = 1.0
            x = torch.linalg.solve_triangular(self._U_S, e, upper=False)  # U_S^-1 e
            col_K[:, pruned_cols] = -(self._U_K @ x)
            col_S[:, pruned_cols] = torch.linalg.solve_triangular(self._U_S.T, x, upper=True)
        out = torch.empty(K.numel() + S.numel(), m, dtype=col_K.dtype, device=col_K.device)
        out.index_copy_(0, K, col_K)
        out.index_copy_(0, S, col_S)
        return out

    def scores(self) -> Tensor:
        """B_j for every group in one pass: prune cost if kept, restore gain if pruned (>= 0)."""
        sign = torch.where(self.kept, -1.0, 1.0).to(self.blocks.dtype).view(-1, 1, 1)
        scores = block_scores(self.blocks * sign, block_gram(self.Z, self.group_size))
        if bool(scores.isnan().any()):
            raise PivotError("a group's pivot block is not positive definite")
        return scores

    def _sweep(self, groups: Tensor, restore: bool) -> None:
        rows = group_rows(groups, self.group_size)
        sign = 1.0 if restore else -1.0
        col = self.columns(rows)  # d1 x m
        pivot_inv = _pivot_inverse(col[rows], sign)
        F = col @ pivot_inv
        z_rows = self.Z[rows]
        pz = pivot_inv @ z_rows
        self.Z.addmm_(F, z_rows, alpha=-1.0)
        self.Z[rows] = sign * pz
        self.f += float(-0.5 * (z_rows * pz).sum())
        p, g, m = self.num_groups, self.group_size, rows.numel()
        self.blocks -= F.view(p, g, m) @ col.view(p, g, m).transpose(1, 2)
        pinv_g = pivot_inv.view(-1, g, groups.numel(), g).diagonal(dim1=0, dim2=2)
        self.blocks[groups] = -pinv_g.permute(2, 0, 1)
        self.kept[groups] = restore
        self.moves.append(_Move(rows, F, col, pivot_inv, sign))

    def prune(self, groups: Tensor) -> None:
        """Case 1: remove `groups` (all kept) from the support."""
        assert bool(self.kept[groups].all()), "prune() takes kept groups only"
        self._sweep(groups, restore=False)

    def restore(self, groups: Tensor) -> None:
        """Case 2: return `groups` (all pruned) to the support."""
        assert not bool(self.kept[groups].any()), "restore() takes pruned groups only"
        self._sweep(groups, restore=True)

    def swap(self, restore: Tensor, prune: Tensor) -> None:
        """Case 3: restore some groups and prune others (through the intermediate support)."""
        self.restore(restore)
        self.prune(prune)

    def swap_delta(self, restore: Tensor, prune: Tensor) -> float:
        """Exact change of f if `swap(restore, prune)` were applied, from the small sub-block only."""
        rows_in = group_rows(restore, self.group_size)
        rows = torch.cat([rows_in, group_rows(prune, self.group_size)])
        sub_A = self.columns(rows)[rows]
        sub_Z = self.Z[rows]
        local = torch.arange(rows.numel(), device=rows.device)
        m = rows_in.numel()
        return sweep_dense(sub_A, sub_Z, local[:m], True) + sweep_dense(sub_A, sub_Z, local[m:], False)

    def pruned(self) -> Tensor:
        return torch.nonzero(~self.kept).squeeze(1)

    def weight(self) -> Tensor:
        """The optimal W for the current support (pruned rows exactly zero)."""
        W = self.Z.clone()
        W[~self.kept.repeat_interleave(self.group_size)] = 0
        return W
