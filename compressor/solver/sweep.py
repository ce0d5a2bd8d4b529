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
  * `SwapState` (swap rounds): A as its columns on demand, from the greedy's factors (or A0 formed
    once) and the stacked moves applied since; a column costs O(d1 R) or O(d1 N), never O(d1^2).
    The stack of moves and the cache of A0's columns are memory management, in `bookkeeping`; every
    change of A, Z and f (a sweep, an exchange) is here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .bookkeeping import ColumnCache, MoveStack
from .linalg import Cholesky, cholesky
from .problem import SLAB_ROWS, group_rows, host_index


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
        pivots = blocks.view(p)
        return torch.where(pivots > 0, 0.5 * gram.view(p) / pivots, torch.nan)
    chol, info = torch.linalg.cholesky_ex(blocks)
    traces = torch.cholesky_solve(gram, chol).diagonal(dim1=1, dim2=2).sum(1)
    return torch.where(info == 0, 0.5 * traces, torch.nan)


def pivot_inverse_ex(pivot: Tensor, sign: float) -> tuple[Tensor, Tensor]:
    """A_PP^-1 for a pivot block that is positive definite after multiplying by `sign`, and the
    Cholesky info (0: it is; else the inverse is garbage), without a host synchronisation."""
    chol, info = torch.linalg.cholesky_ex(sign * pivot)
    return sign * torch.cholesky_inverse(chol), info


def _pivot_inverse(pivot: Tensor, sign: float) -> Tensor:
    """A_PP^-1, checked: PivotError unless the block is positive definite after multiplying by `sign`."""
    pivot_inv, info = pivot_inverse_ex(pivot, sign)
    if int(info) != 0:
        raise PivotError(f"pivot block of {pivot.shape[0]} rows is not positive definite")
    return pivot_inv


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
                 factor: Cholesky | None = None) -> None:
        """`factor`: a Cholesky factor the caller already has (of H, possibly damped), consumed (its buffer
        becomes H^-1); H then only gives the shape, dtype and device."""
        d1, g = H.shape[0], group_size
        if factor is None:
            factor = cholesky(H)
            if factor is None:
                raise PivotError("H is not positive definite")
        self.group_size = g
        self.Hinv = factor.inverse(overwrite=True)  # d1 x d1: H^-1, never modified
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
        rows = group_rows(groups, self.group_size)
        # one broadcast gather: half the time of two boolean gathers (or two index_selects) at d1 = 4096-8192
        return self.Hinv[rows.unsqueeze(1), rows], self.W0.index_select(0, rows)

    def dense_prune_delta(self, groups: Tensor) -> float:
        """f(groups) - f({}) = 1/2 Tr(W0_P^T H^-1[P, P]^-1 W0_P), by one m x m factorisation."""
        M, X = self._dense_block(groups)
        factor = cholesky(M, overwrite=True)  # M is a gathered copy
        if factor is None:
            raise PivotError(f"pivot block of {M.shape[0]} rows is not positive definite")
        return float(0.5 * factor.half_solve(X).square().sum())

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


class SwapState:
    """The swept state during the swap rounds; A as its state at the end of the greedy (A0) plus the
    moves made since.

    With the greedy's pruned rows S in pivot order, U_S = U[S] is lower triangular with
    H^-1[S, S] = U_S U_S^T and H^-1[K, S] = U_K U_S^T, so the swept matrix at the end of the greedy is
        A_KK = -(H^-1[K, K] - U_K U_K^T),   A_KS = -U_K U_S^-1,   A_SS = (U_S U_S^T)^-1
    (A0); its columns come from these factors, or from A0 formed once the search has asked for enough
    of them (`materialise`). Every sweep since is a symmetric low-rank change of A, recorded in
    `moves` (a `MoveStack`), so a column of the current A costs one matmul with the stack; A0's
    columns formed from the factors are kept in `cache` (a `ColumnCache`) for reuse.
    The diagonal blocks, Z and f are kept up to date eagerly. Nothing here synchronises with the
    host except the set-up and the checked public moves (`prune`, `restore`, `swap`): the swap rounds
    decide on the device (see `OsscarSolver`), and tell `columns` the rows they learnt on the host.
    """

    def __init__(self, nested: NestedState) -> None:
        g = nested.group_size
        self.group_size = g
        self.kept = nested.kept.clone()  # current support, by group
        self.num_pruned = int((~self.kept).sum())  # swaps keep it constant
        self._Hinv = nested.Hinv
        dtype, device = self._Hinv.dtype, self._Hinv.device
        self.f_tensor = torch.tensor(nested.f, dtype=dtype, device=device)  # f, on the device
        d1 = self._Hinv.shape[0]
        K = torch.nonzero(nested.kept.repeat_interleave(g)).squeeze(1)  # the greedy's kept rows
        S = group_rows(torch.cat(nested.order), g) if nested.order else K[:0]  # in pivot order
        U = nested.U[:, : nested.n]
        U_K, U_S = U.index_select(0, K), U.index_select(0, S)  # |K| x R, R x R lower triangular
        self.Z = nested.W  # taken over: NestedState.reset() allocates a new W
        # A0 is held as the greedy's factors first (a column costs O(d1 R)); `materialise()` forms
        # it explicitly when a search runs long enough to repay that (a column is then a gather).
        self._K, self._S, self._U_K, self._U_S = K, S, U_K, U_S
        self._s_pos = torch.full((d1,), -1, dtype=torch.long, device=device)
        self._s_pos[S] = torch.arange(S.numel(), device=device)  # position in S, -1 for K
        self._k_pos = torch.full((d1,), -1, dtype=torch.long, device=device)
        self._k_pos[K] = torch.arange(K.numel(), device=device)  # position in K, -1 for S
        self._A0: Tensor | None = None
        self._released = False  # see `release`
        self._factored_rows = 0  # cost of the columns formed from the factors so far (see _base_columns)
        self._sigma: Tensor | None = None
        self.blocks = -nested.blocks  # kept groups: -H_cur^-1 blocks
        if S.numel():
            sigma = Cholesky(U_S, upper=False).inverse()  # A_SS = (U_S U_S^T)^-1, R x R
            self.Z[S] = sigma @ nested.W0.index_select(0, S)
            r = S.numel() // g
            self.blocks[torch.cat(nested.order)] = sigma.view(r, g, r, g).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
            self._sigma = sigma
        # rows known on the host pick their columns' formula by kind (see `_cached_base_columns`)
        self._s_pos_host: list[int] = self._s_pos.tolist()  # one synchronisation, at the start of the phase
        self.cache = ColumnCache(d1, dtype, device)  # A0's columns formed from the factors, for reuse
        self.moves = MoveStack(d1, dtype, device)  # the sweeps since the greedy

    @property
    def num_groups(self) -> int:
        return self.kept.numel()

    @property
    def f(self) -> float:
        return float(self.f_tensor)

    def columns(self, rows: Tensor, known: Sequence[int] | None = None) -> Tensor:
        """A[:, rows] of the current state (d1 x m), without a host synchronisation. `known`: the same rows as
        host ints, when the caller has them: A0's columns are then reused from earlier calls and formed by
        the cheaper formula of their kind (pruned or kept at the end of the greedy)."""
        assert not self._released, "a released state has no columns"
        if known is not None and self._materialise_if_repaid() is None:
            out = self._cached_base_columns(known)
        else:
            out = self._base_columns(rows)
        return self.moves.add_to_columns(out, rows)

    def block(self, rows: Tensor) -> Tensor:
        """A[rows, rows] of the current state (m x m), without a host synchronisation and without forming
        the columns: from the greedy's factors O(R^2 m), a gather once A0 is formed, O(N m^2) for the moves."""
        assert not self._released, "a released state has no blocks"
        return self.moves.add_to_block(self._base_block(rows), rows)

    def materialise(self) -> None:
        """Form A0 (the swept matrix at the end of the greedy) explicitly, in the row order
        [K, S]: d1^2 floats, as H^-1, and |K|^2 R + |K| R^2 multiply-adds once; a column of it is
        then a gather instead of O(d1 R) work. The factors are dropped."""
        if self._A0 is not None:
            return
        K, S, U_K, U_S = self._K, self._S, self._U_K, self._U_S
        d1, k = self._Hinv.shape[0], K.numel()
        order = torch.cat([K, S])
        self._pos = torch.empty_like(order)
        self._pos[order] = torch.arange(d1, device=order.device)  # row r of A0 is row _pos[r]
        A0 = torch.empty(d1, d1, dtype=self._Hinv.dtype, device=self._Hinv.device)
        # A0_KK = U_K U_K^T - H^-1[K, K] by slabs of rows (`SLAB_ROWS`, as H's gathers): whole, its gathers and
        # product are three more k x d1 temporaries beside A0 and H^-1 (a down projection of d1 = 8,192: 1.2 GB)
        for lo in range(0, k, SLAB_ROWS):
            rows = K[lo : lo + SLAB_ROWS]
            slab = torch.mm(U_K[lo : lo + rows.numel()], U_K.T)
            slab -= self._Hinv.index_select(0, rows).index_select(1, K)
            A0[lo : lo + rows.numel(), :k] = slab
        if S.numel():
            A0[k:, :k] = torch.linalg.solve_triangular(U_S.T, U_K.T, upper=True).neg_()  # -U_S^-T U_K^T
            A0[:k, k:] = A0[k:, :k].T
            A0[k:, k:] = self._sigma
        self._A0 = A0
        self._U_K = self._U_S = self._sigma = None
        self.cache.clear()  # a gather of A0 is cheaper

    # Cost model of the two ways, in units of one column formed from the factors (both scale as d1^2 per
    # column; measured on 2 CPU threads at d1 = 4096): a batch of m columns costs about m + 48 (reading
    # the factors: 7.6 ms for a batch of 8, 0.09 s for 512), forming A0 about 0.75 d1 (0.35-0.67 s).
    # A0 is formed once the batches so far have cost that much (a ski-rental rule: never more than
    # twice the cost of the better choice in hindsight).
    BATCH_COST_ROWS = 48
    MATERIALISE_COST_PER_D1 = 0.75

    def _materialise_if_repaid(self) -> Tensor | None:
        """A0 once the columns formed from the factors have cost about as much as forming it (else None)."""
        if self._A0 is None and self._factored_rows >= self.MATERIALISE_COST_PER_D1 * self._Hinv.shape[0]:
            self.materialise()
        return self._A0

    def _vectors(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """(v, was_kept): one R-vector per row, without branching on the device values: kept r (at the end
        of the greedy): v = -U_K[r]^T; pruned r: v = U_S^-1 e_r. (R x m, m)"""
        pos = self._s_pos[rows]
        was_kept = pos < 0
        x = self._pruned_vectors(pos, ~was_kept)
        u_r = self._U_K.index_select(0, self._k_pos[rows].clamp_min(0))  # m x R
        return torch.where(was_kept.unsqueeze(0), -u_r.T, x), was_kept

    def _pruned_vectors(self, pos: Tensor, pruned: Tensor | None = None) -> Tensor:
        """U_S^-1 e_r for the rows at positions `pos` in S (R x m): the R-vectors of rows the greedy pruned;
        zero columns where `pruned` is False (their positions are then ignored)."""
        m = pos.numel()
        e = torch.zeros(self._S.numel(), m, dtype=self._Hinv.dtype, device=self._Hinv.device)
        e[pos.clamp_min(0), torch.arange(m, device=e.device)] = 1.0 if pruned is None else pruned.to(e.dtype)
        return torch.linalg.solve_triangular(self._U_S, e, upper=False)

    def _base_columns(self, rows: Tensor) -> Tensor:
        """Columns of the swept matrix at the end of the greedy (see the class docstring)."""
        A0 = self._materialise_if_repaid()
        if A0 is not None:  # symmetric: gather rows
            return A0.index_select(0, self._pos[rows]).index_select(1, self._pos).T.contiguous()
        return self._factored_columns(rows)

    def _factored_columns(self, rows: Tensor, kind: str | None = None) -> Tensor:
        """`_base_columns` from the greedy's factors. `kind`: "pruned" or "kept" when every row is known (on
        the host) to have been so at the end of the greedy."""
        K, S = self._K, self._S
        m = rows.numel()
        self._factored_rows += m + self.BATCH_COST_ROWS
        dtype, device = self._Hinv.dtype, self._Hinv.device
        out = torch.empty(K.numel() + S.numel(), m, dtype=dtype, device=device)
        if kind == "pruned":  # A[S, r] = (U_S U_S^T)^-1 e_r is a column of sigma: one triangular solve less
            pos = self._s_pos[rows]
            out.index_copy_(0, S, self._sigma.index_select(0, pos).T)
            out.index_copy_(0, K, -(self._U_K @ self._pruned_vectors(pos)))
            return out
        hinv_r = self._Hinv.index_select(0, rows).index_select(1, K)  # H^-1[rows, K]
        if not S.numel():
            out.index_copy_(0, K, -hinv_r.T)
            return out
        # A[S, r] = U_S^-T v and A[K, r] = -U_K v (- H^-1[K, r] if r was kept)
        if kind == "kept":  # no solve for the R-vectors
            v, hinv_kept = -self._U_K.index_select(0, self._k_pos[rows]).T, hinv_r.T
        else:
            v, was_kept = self._vectors(rows)
            hinv_kept = hinv_r.T * was_kept.to(dtype)
        out.index_copy_(0, S, torch.linalg.solve_triangular(self._U_S.T, v, upper=True))
        out.index_copy_(0, K, -(self._U_K @ v) - hinv_kept)
        return out

    def _cached_base_columns(self, rows: Sequence[int]) -> Tensor:
        """A0[:, rows] (d1 x m) for rows known on the host, A0 not formed: the ones formed before are gathered,
        the others formed by kind and kept (the least recently used dropped beyond `ColumnCache.MAX_ROWS`)."""
        device = self._Hinv.device
        wanted = list(dict.fromkeys(rows))
        if len(wanted) > self.cache.MAX_ROWS:  # more than it holds: formed, not kept
            return self._factored_columns(host_index(rows, device))
        missing = self.cache.missing(wanted)
        for kind, batch in (("pruned", [r for r in missing if self._s_pos_host[r] >= 0]),
                            ("kept", [r for r in missing if self._s_pos_host[r] < 0])):
            if batch:
                self.cache.put(batch, self._factored_columns(host_index(batch, device), kind), keep=set(wanted))
        return self.cache.get(rows)

    def _base_block(self, rows: Tensor) -> Tensor:
        """A0[rows, rows]: with the R-vectors of `_vectors`, every entry is v_r^T v_r' (minus H^-1[r, r'] when
        both were kept): U_K U_K^T, -U_K U_S^-1 and (U_S U_S^T)^-1 are exactly those products."""
        A0 = self._materialise_if_repaid()
        if A0 is not None:
            pos = self._pos[rows]
            return A0[pos.unsqueeze(1), pos]
        hinv = self._Hinv[rows.unsqueeze(1), rows]
        if not self._S.numel():
            return -hinv
        v, was_kept = self._vectors(rows)
        both = (was_kept.unsqueeze(1) & was_kept.unsqueeze(0)).to(hinv.dtype)
        return v.T @ v - hinv * both

    def scores(self, check: bool = True, gram: Tensor | None = None) -> Tensor:
        """B_j for every group in one pass: prune cost if kept, restore gain if pruned (>= 0).

        nan marks a pivot block that is not positive definite; `check` raises PivotError on one
        (a host synchronisation: the swap rounds check later, together with their other flags)."""
        sign = torch.where(self.kept, -1.0, 1.0).to(self.blocks.dtype).view(-1, 1, 1)
        gram = block_gram(self.Z, self.group_size) if gram is None else gram  # one pass over Z
        scores = block_scores(self.blocks * sign, gram)
        if check and bool(scores.isnan().any()):
            raise PivotError("a group's pivot block is not positive definite")
        return scores

    def sweep(self, groups: Tensor, restore: bool, col: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Restore (or prune) `groups`, given or computing col = A[:, rows]; no host
        synchronisation. Returns the Cholesky info of the pivot block (0: positive definite; on
        any other value the state is invalid and must be rebuilt) and A_PP^-1."""
        rows = group_rows(groups, self.group_size)
        if col is None:
            col = self.columns(rows)  # d1 x m
        z_rows = self.Z[rows]
        info, pivot_inv, Ft = self._sweep_but_Z(groups, rows, restore, col, z_rows)
        self.Z.addmm_(Ft, z_rows, alpha=-1.0)
        return info, pivot_inv

    def _sweep_but_Z(self, groups: Tensor, rows: Tensor, restore: bool, col: Tensor,
                     z_rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """A sweep's changes to everything but Z, given col = A[:, rows] and z_rows = Z[rows]; returns
        (info, A_PP^-1, Ft) where the sweep changes Z to Z - Ft z_rows (rows P become s A_PP^-1 z_rows),
        so that the caller can apply several sweeps to Z in one pass."""
        sign = 1.0 if restore else -1.0
        pivot_inv, info = pivot_inverse_ex(col[rows], sign)  # A_PP^-1
        F = col @ pivot_inv
        pz = pivot_inv @ z_rows
        self.f_tensor = self.f_tensor - 0.5 * (z_rows * pz).sum()
        p, g, m = self.num_groups, self.group_size, rows.numel()
        self.blocks -= F.view(p, g, m) @ col.view(p, g, m).transpose(1, 2)
        pinv_g = pivot_inv.view(-1, g, groups.numel(), g).diagonal(dim1=0, dim2=2)
        self.blocks[groups] = -pinv_g.permute(2, 0, 1)
        self.kept[groups] = restore
        self.moves.push(rows, col, pivot_inv, sign)
        Ft = F.clone()
        Ft[rows] = torch.eye(m, dtype=F.dtype, device=F.device) - sign * pivot_inv
        return info, pivot_inv, Ft

    def exchange(self, restore: Tensor, prune: Tensor, col_in: Tensor | None = None,
                 col_out: Tensor | None = None) -> Tensor:
        """Case 3 without a host synchronisation: restore some groups, then prune others, given (or
        computing) their current columns. Returns the worst pivot info (0: the state is valid)."""
        rows_in = group_rows(restore, self.group_size)
        rows_out = group_rows(prune, self.group_size)
        if col_in is None or col_out is None:
            cols = self.columns(torch.cat([rows_in, rows_out]))
            col_in, col_out = cols[:, : rows_in.numel()], cols[:, rows_in.numel():]
        # The restore, then the pruned groups' columns and Z rows after it (one sweep applied to
        # them), then the prune; Z itself is updated once for both, in one pass over its d1 x d2.
        z_in = self.Z[rows_in]
        info_in, pivot_inv, Ft_in = self._sweep_but_Z(restore, rows_in, True, col_in, z_in)
        y = pivot_inv @ col_out[rows_in]  # A_II^-1 A[I, J]
        col_out = col_out - col_in @ y
        col_out[rows_in] = y
        z_out = self.Z[rows_out] - Ft_in[rows_out] @ z_in
        info_out, _, Ft_out = self._sweep_but_Z(prune, rows_out, False, col_out, z_out)
        self.Z.addmm_(torch.cat([Ft_in, Ft_out], 1), torch.cat([z_in, z_out]), alpha=-1.0)
        return torch.maximum(info_in, info_out)

    def prune(self, groups: Tensor) -> None:
        """Case 1: remove `groups` (all kept) from the support."""
        assert bool(self.kept[groups].all()), "prune() takes kept groups only"
        self._checked(self.sweep(groups, restore=False)[0], groups)

    def restore(self, groups: Tensor) -> None:
        """Case 2: return `groups` (all pruned) to the support."""
        assert not bool(self.kept[groups].any()), "restore() takes pruned groups only"
        self._checked(self.sweep(groups, restore=True)[0], groups)

    def swap(self, restore: Tensor, prune: Tensor) -> None:
        """Case 3: restore some groups and prune others (through the intermediate support)."""
        self._checked(self.exchange(restore, prune), torch.cat([restore, prune]))

    @staticmethod
    def _checked(info: Tensor, groups: Tensor) -> None:
        if int(info) != 0:
            raise PivotError(f"pivot block of {groups.numel()} groups is not positive definite")

    def swap_delta(self, restore: Tensor, prune: Tensor) -> float:
        """Exact change of f if `swap(restore, prune)` were applied, from the small sub-block only."""
        rows_in = group_rows(restore, self.group_size)
        rows = torch.cat([rows_in, group_rows(prune, self.group_size)])
        sub_A = self.block(rows)
        sub_Z = self.Z[rows]
        local = torch.arange(rows.numel(), device=rows.device)
        m = rows_in.numel()
        return sweep_dense(sub_A, sub_Z, local[:m], True) + sweep_dense(sub_A, sub_Z, local[m:], False)

    def pruned(self) -> Tensor:
        return torch.nonzero(~self.kept).squeeze(1)

    def release(self) -> None:
        """Drop what only further moves need (A0 or the greedy's factors, the cached columns, the move stack):
        `pruned`, `weight` and `f` stay valid. For a state that is only compared and returned while another
        search runs (the MP guard), whose A0 would otherwise double the solve's largest buffer."""
        self._A0 = self._U_K = self._U_S = self._sigma = self._Hinv = None
        d1, dtype, device = self.Z.shape[0], self.Z.dtype, self.Z.device
        self.cache, self.moves = ColumnCache(d1, dtype, device), MoveStack(d1, dtype, device)
        self._released = True

    def weight(self) -> Tensor:
        """The optimal W for the current support (pruned rows exactly zero)."""
        W = self.Z.clone()
        W[~self.kept.repeat_interleave(self.group_size)] = 0
        return W
