"""OSSCAR's combinatorial local search (paper Algorithm 1).

Schedule: nested greedy steps (t_i = p_i) from S = {} until |S| = num_prune, then non-nested swap
rounds (p_i = 0) until no exchange lowers f. Where the paper ranks swap candidates by their separate
impacts B_j (restore the pruned groups whose return lowers f most, prune the kept groups that cost
least), each round here also evaluates the exact f of restoring i *and then* pruning j for the best
restore candidates i against every kept j (a g x g correction per pair), so a round never accepts a
move that raises f; several disjoint improving pairs go in one move when their joint exact change is
still an improvement.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor

from .problem import DAMPING_LADDER, LayerProblem, factorize, group_rows
from .sweep import NestedState, PivotError, SwapState

State = TypeVar("State", NestedState, SwapState)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OsscarConfig:
    """Options of method="osscar" (keyword arguments of `solve_layer`)."""

    # Nested greedy: each step prunes ceil(step_fraction * still-to-prune) groups at once (t = p),
    # so steps are large while many groups remain and single groups at the end, where it matters.
    step_fraction: float = 0.2
    # Upper bound on the non-nested swap rounds (p = 0); rounds stop earlier at a local optimum.
    swap_rounds: int = 100
    # Restore candidates (highest restore gain) evaluated exactly against every kept group per round.
    swap_candidates: int = 8
    # Most disjoint improving pairs exchanged in one move.
    swap_pairs: int = 8
    # When no single exchange improves: try every 2-for-2 exchange among the this many highest-gain
    # pruned and lowest-cost kept groups (exhaustive on small layers; 0 disables).
    double_swap_candidates: int = 12
    # Precision of the search state. The returned weight is the tracked optimum when the search ran
    # in float64 without damping, and a float64 refit on the caller's H otherwise.
    dtype: torch.dtype = torch.float64
    # Also evaluate the magnitude (MP+) support and, if it is better, improve it with swap rounds,
    # so osscar is never worse than mp+ whenever dense_weight is given.
    guard_mp: bool = True

    def __post_init__(self) -> None:
        errors = []
        if not isinstance(self.step_fraction, (int, float)) or not 0 < self.step_fraction <= 1:
            errors.append(f"step_fraction must be in (0, 1] (got {self.step_fraction!r})")
        for name in ("swap_rounds", "swap_candidates", "swap_pairs", "double_swap_candidates"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                errors.append(f"{name} must be a non-negative int (got {value!r})")
        if self.dtype not in (torch.float32, torch.float64):
            errors.append(f"dtype must be torch.float32 or torch.float64 (got {self.dtype!r})")
        if errors:
            raise ValueError("invalid osscar options: " + "; ".join(errors))


class OsscarSolver:
    """One layer problem: `start()` (factorise) -> `greedy()` -> `swaps()`; see `search()`."""

    def __init__(self, problem: LayerProblem, config: OsscarConfig) -> None:
        self.problem = problem
        self.config = config
        self.stats: dict[str, float | int | str] = {}
        self.damping = 0.0  # lambda of the damping delta = lambda * mean(diag H) in use
        self._nested: NestedState | None = None  # kept by search(): H^-1 and W0 for improve()
        self._tol = 1e-10 if config.dtype == torch.float64 else 1e-5

    def _count(self, name: str, n: int = 1) -> None:
        """Add to a counter of `stats` (search() and improve() both run swap rounds: they add up)."""
        self.stats[name] = int(self.stats.get(name, 0)) + n

    def _threshold(self, state: SwapState) -> float:
        """Changes of f below this (negative) value improve it beyond rounding: accepting changes
        within rounding could cycle forever."""
        return -self._tol * max(abs(state.f), 1e-300)

    # ---- factorisation ---------------------------------------------------------------------
    def start(self, floor: float = 0.0) -> NestedState:
        """NestedState of the dense support with the smallest damping >= floor that factorises."""
        pb = self.problem
        H = pb.H.to(self.config.dtype)
        chol, self.damping = factorize(H, pb.mean_diag, floor=floor)
        return NestedState(H, pb.G.to(self.config.dtype), pb.group_size, pb.num_prune, factor=chol)

    @property
    def exact(self) -> bool:
        """Whether the tracked weight is the optimum of the caller's problem (no refit needed)."""
        return self.config.dtype == torch.float64 and self.damping == 0.0

    def _refactorise(self, state: NestedState | SwapState, pruned: Tensor | None = None) -> NestedState | SwapState:
        """The same support (`pruned`, default the state's) from scratch, one damping rung up (drift or
        ill-conditioning)."""
        log.warning("osscar: a pivot lost positive definiteness; refactorising the support")
        self._count("refactorisations")
        higher = [lam for lam in DAMPING_LADDER if lam > self.damping]
        if not higher:
            raise ValueError("H is too ill-conditioned for the search even with the largest damping")
        fresh = self.start(floor=higher[0])
        pruned = state.pruned() if pruned is None else pruned
        if pruned.numel():
            fresh.prune(pruned)
        return fresh if isinstance(state, NestedState) else fresh.to_swap()

    def _guarded(self, state: State, update: Callable[[State], None]) -> State:
        """Apply a low-rank update; on a lost pivot, refactorise and apply it again."""
        before = state.pruned()  # a swap that fails in its second half has already restored its first
        try:
            update(state)
            return state
        except PivotError:
            fresh = self._refactorise(state, before)
            update(fresh)
            return fresh

    # ---- Algorithm 1 ---------------------------------------------------------------------------
    def greedy(self, state: NestedState) -> NestedState:
        """Nested greedy (t_i = p_i): prune the groups with the smallest impact B_j, step by step."""
        steps = 0
        while (remaining := self.problem.num_prune - int((~state.kept).sum())) > 0:
            t = min(remaining, max(1, math.ceil(self.config.step_fraction * remaining)))
            groups = torch.topk(state.scores(), t, largest=False).indices
            state = self._guarded(state, lambda s, q=groups: s.prune(q))
            steps += 1
        self._count("greedy_steps", steps)
        return state

    def swaps(self, state: SwapState) -> SwapState:
        """Non-nested rounds (p_i = 0): exchange pruned and kept groups while f decreases."""
        rounds = accepted = 0
        while rounds < self.config.swap_rounds:
            move = self._best_exchange(state)
            if move is None:
                move = self._best_double_exchange(state)
                if move is None:
                    break
                self._count("double_swaps")
            restore, prune = move
            state = self._guarded(state, lambda s, r=restore, q=prune: s.swap(r, q))
            rounds += 1
            accepted += restore.numel()
        self._count("swap_rounds", rounds)
        self._count("swaps", accepted)
        return state

    def _best_exchange(self, state: SwapState) -> tuple[Tensor, Tensor] | None:
        """Disjoint (restore, prune) pairs whose joint exact change of f is an improvement."""
        num_pruned = int((~state.kept).sum())
        if num_pruned in (0, state.num_groups) or self.config.swap_candidates == 0:
            return None
        scores = state.scores()
        gains = torch.where(state.kept, -torch.inf, scores)
        cand = torch.topk(gains, min(self.config.swap_candidates, num_pruned)).indices
        delta = self._pair_deltas(state, cand, scores[cand])  # (c, p)
        threshold = self._threshold(state)
        flat = delta.flatten()
        n_improving = int((flat < threshold).sum())
        if n_improving == 0:
            return None
        p = state.num_groups
        pairs: list[tuple[int, int]] = []
        used_in: set[int] = set()
        used_out: set[int] = set()
        for k in torch.topk(flat, n_improving, largest=False).indices.tolist():
            i, j = int(cand[k // p]), k % p
            if i not in used_in and j not in used_out:
                pairs.append((i, j))
                used_in.add(i)
                used_out.add(j)
                if len(pairs) == self.config.swap_pairs:
                    break
        device = state.kept.device
        while pairs:
            restore = torch.tensor([i for i, _ in pairs], device=device)
            prune = torch.tensor([j for _, j in pairs], device=device)
            if len(pairs) == 1:
                return restore, prune
            try:
                if state.swap_delta(restore, prune) < threshold:
                    return restore, prune
            except PivotError:
                pass
            pairs = pairs[: len(pairs) // 2]
        return None

    def _best_double_exchange(self, state: SwapState) -> tuple[Tensor, Tensor] | None:
        """The best 2-for-2 exchange among the top candidates, evaluated exactly in one batch."""
        g = state.group_size
        c = self.config.double_swap_candidates
        # bound the batch of (4g x 4g) sub-blocks, C(c, 2)^2 of them, to ~2^22 entries
        while c > 2 and math.comb(c, 2) ** 2 * (4 * g) ** 2 > 1 << 22:
            c -= 1
        num_pruned = int((~state.kept).sum())
        if c < 2 or num_pruned < 2 or state.num_groups - num_pruned < 2:
            return None
        scores = state.scores()
        cand_in = torch.topk(torch.where(state.kept, -torch.inf, scores), min(c, num_pruned)).indices
        cand_out = torch.topk(torch.where(state.kept, scores, torch.inf),
                              min(c, state.num_groups - num_pruned), largest=False).indices
        cand = torch.cat([cand_in, cand_out])
        rows = group_rows(cand, g)
        block = state.columns(rows)[rows].view(cand.numel(), g, cand.numel(), g)
        z = state.Z[rows]
        gram = (z @ z.T).view(cand.numel(), g, cand.numel(), g)
        pairs_in = torch.combinations(torch.arange(cand_in.numel(), device=cand.device), 2)
        pairs_out = torch.combinations(torch.arange(cand_out.numel(), device=cand.device), 2) + cand_in.numel()
        combos = torch.cat([pairs_in.repeat_interleave(pairs_out.shape[0], 0),
                            pairs_out.repeat(pairs_in.shape[0], 1)], 1)  # (b, 4) local group ids
        b = combos.shape[0]

        def sub_blocks(M: Tensor) -> Tensor:  # (b, 4g, 4g) blocks of M at the combos' groups
            sub = M[combos[:, :, None], :, combos[:, None, :], :]  # (b, 4, 4, g, g)
            return sub.permute(0, 1, 3, 2, 4).reshape(b, 4 * g, 4 * g)

        delta = _batched_swap_delta(sub_blocks(block), sub_blocks(gram), 2 * g)
        best = int(torch.argmin(delta))
        if not float(delta[best]) < self._threshold(state):
            return None
        return cand[combos[best, :2]], cand[combos[best, 2:]]

    @staticmethod
    def _pair_deltas(state: SwapState, cand: Tensor, gain: Tensor) -> Tensor:
        """delta[i, j] = f(S - {cand_i} + {j}) - f(S) for every kept j (inf elsewhere)."""
        g, p = state.group_size, state.num_groups
        rows_c = group_rows(cand, g)
        cols = state.columns(rows_c)  # d1 x (c g): A[:, cand]
        Z = state.Z
        if g == 1:
            a_ii = cols[cand, torch.arange(cand.numel(), device=cand.device)]  # Schur complements
            r = cols / a_ii  # d1 x c
            a_jj = state.blocks.view(p, 1) - cols * r  # A_jj after restoring i (< 0 for kept j)
            z2 = (torch.linalg.vector_norm(Z, dim=1).square().unsqueeze(1)
                  - 2 * r * (Z @ Z[cand].T) + r.square() * torch.linalg.vector_norm(Z[cand], dim=1).square())
            delta = (0.5 * z2 / (-a_jj) - gain).T  # (c, p)
        else:
            Zg = Z.view(p, g, -1)
            gram = Zg @ Zg.transpose(1, 2)  # (p, g, g): Z_j Z_j^T
            rows = []
            for k in range(cand.numel()):
                ri = rows_c[k * g:(k + 1) * g]
                col_i = cols[:, k * g:(k + 1) * g]  # d1 x g: A[:, i]
                a_ji = col_i.view(p, g, g)
                t = a_ji @ torch.cholesky_inverse(torch.linalg.cholesky(col_i[ri]))  # A_ji A_ii^-1
                neg_a_jj = -(state.blocks - t @ a_ji.transpose(1, 2))  # -A_jj after restoring i
                cross = (Z[ri] @ Z.T).view(g, p, g).permute(1, 0, 2)  # (p, g, g): Z_i Z_j^T
                tc = t @ cross
                gram_i = (Z[ri] @ Z[ri].T).expand(p, g, g)  # Z_i Z_i^T
                # Z'_j Z'_j^T with Z'_j = Z_j - t Z_i
                gram_j = gram - tc - tc.transpose(1, 2) + t @ gram_i @ t.transpose(1, 2)
                chol, info = torch.linalg.cholesky_ex(neg_a_jj)
                cost = 0.5 * torch.cholesky_solve(gram_j, chol).diagonal(dim1=1, dim2=2).sum(1)
                rows.append(torch.where(info == 0, cost, torch.inf) - gain[k])
            delta = torch.stack(rows)  # (c, p)
        return torch.where(state.kept.unsqueeze(0), delta, torch.inf)

    # ---- entry points ----------------------------------------------------------------------------
    def search(self) -> SwapState:
        """Algorithm 1 from the dense support; the final state."""
        clock = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            self.stats[name] = now - clock
            clock = now

        nested = self.start()
        lap("factorise_s")
        nested = self.greedy(nested)
        lap("greedy_s")
        state = nested.to_swap()
        lap("swap_setup_s")
        state = self.swaps(state)
        lap("swap_s")
        self.stats["damping"] = self.damping
        self._nested = nested  # H^-1 and W0 stay valid: improve() reuses them
        return state

    def improve(self, pruned: Tensor) -> SwapState:
        """Swap rounds from a given support (e.g. MP's), reusing the factorisation of search()."""
        assert self._nested is not None, "improve() needs search() first"
        nested = self._nested
        nested.reset()
        if pruned.numel():
            nested = self._guarded(nested, lambda s: s.prune(pruned))
        return self.swaps(nested.to_swap())

    def dense_objective(self, pruned: Tensor, lower_bound: bool = False) -> float:
        """f(pruned) (or a cheap lower bound on it) in the search's problem, from the
        factorisation of search(), without a refit."""
        assert self._nested is not None, "dense_objective() needs search() first"
        nested = self._nested
        if not pruned.numel():
            return nested.f0
        if lower_bound:
            return nested.f0 + nested.dense_prune_delta_lower_bound(pruned)
        return nested.f0 + nested.dense_prune_delta(pruned)


def _batched_swap_delta(A: Tensor, Q: Tensor, m_in: int) -> Tensor:
    """Exact f change of restoring the first m_in rows, then pruning the rest, for a batch of
    sub-blocks A (b, m, m) of the swept state with Q = Z Z^T of their rows (b, m, m); the traces
    1/2 Tr(Z^T M^-1 Z) = 1/2 Tr(M^-1 Z Z^T) never touch d2. inf where a pivot is not PD."""
    A_II, A_IJ, A_JJ = A[:, :m_in, :m_in], A[:, :m_in, m_in:], A[:, m_in:, m_in:]
    Q_II, Q_IJ, Q_JJ = Q[:, :m_in, :m_in], Q[:, :m_in, m_in:], Q[:, m_in:, m_in:]
    L1, info1 = torch.linalg.cholesky_ex(A_II)  # Schur complements of the restored rows
    gain = 0.5 * torch.cholesky_solve(Q_II, L1).diagonal(dim1=1, dim2=2).sum(1)
    T = torch.cholesky_solve(A_IJ, L1)  # A_II^-1 A_IJ
    neg_A_JJ = -(A_JJ - A_IJ.transpose(1, 2) @ T)  # -A_JJ after the restore: an H^-1 block
    TtQ = T.transpose(1, 2) @ Q_IJ
    Q_JJ = Q_JJ - TtQ - TtQ.transpose(1, 2) + T.transpose(1, 2) @ Q_II @ T  # Z'_J Z'_J^T
    L2, info2 = torch.linalg.cholesky_ex(neg_A_JJ)
    cost = 0.5 * torch.cholesky_solve(Q_JJ, L2).diagonal(dim1=1, dim2=2).sum(1)
    return torch.where((info1 == 0) & (info2 == 0), cost - gain, torch.inf)
