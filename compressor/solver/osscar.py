"""OSSCAR's combinatorial local search (paper Algorithm 1).

Schedule: nested greedy steps (t_i = p_i) from S = {} until |S| = num_prune, then non-nested swap
rounds (p_i = 0) until no exchange lowers f. Where the paper ranks swap candidates by their separate
impacts B_j (restore the pruned groups whose return lowers f most, prune the kept groups that cost
least), each round here also evaluates the exact f of restoring i *and then* pruning j for the best
restore candidates i against every kept j (a g x g correction per pair), so a round never accepts a
move that raises f; disjoint pairs are accepted in turn, each only if its exact change after the ones
accepted before it still lowers f, and go in one move. A round decides on the device and synchronises
with the host twice (`swap_round`).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor

from .problem import DAMPING_LADDER, IllConditioned, LayerProblem, damping_delta, factorize, group_rows, host_index
from .sweep import NestedState, PivotError, SwapState, block_gram, pivot_inverse_ex

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
    swap_candidates: int = 16
    # Most disjoint pairs tried (and exchanged) per round, each accepted in turn.
    swap_pairs: int = 16
    # When no single exchange improves: try every 2-for-2 exchange among the this many highest-gain
    # pruned and lowest-cost kept groups (exhaustive on small layers; 0 disables).
    double_swap_candidates: int = 12
    # Precision of the search state. The returned weight is the tracked optimum when the search ran
    # in float64 with at most TRACKED_DAMPING, and a float64 refit on the caller's H otherwise.
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

    # A singular H (fewer calibration rows than features: an FFN projection calibrated on 1,024 tokens) is
    # searched as H + delta I, delta = damping * mean(diag H). Up to this rung the tracked optimum of that
    # problem is returned as is: it is worse than the caller's optimum on the same support by at most
    # delta/2 |W|^2 (~1e-10 relative); a refit on the kept rows is that optimum when H_KK is positive
    # definite, and damps by the same delta when H_KK is singular too (kept rows beyond the calibration rows).
    TRACKED_DAMPING = 1e-8

    def __init__(self, problem: LayerProblem, config: OsscarConfig) -> None:
        self.problem = problem
        self.config = config
        self.stats: dict[str, float | int | str] = {}
        self.damping = 0.0  # lambda of the damping delta = lambda * mean(diag H) in use
        self._nested: NestedState | None = None  # kept by search(): H^-1 and W0 for improve()
        # the last exchange, whose pivots' check waits for the next synchronisation (see `_exchange`)
        self._pending: _Pending | None = None
        self._tol = 1e-10 if config.dtype == torch.float64 else 1e-5

    def _count(self, name: str, n: int = 1) -> None:
        """Add to a counter of `stats` (search() and improve() both run swap rounds: they add up)."""
        self.stats[name] = int(self.stats.get(name, 0)) + n

    def _threshold(self, state: SwapState) -> Tensor:
        """Changes of f below this (negative) value improve it beyond rounding: accepting changes
        within rounding could cycle forever. On the device, like f."""
        return -self._tol * state.f_tensor.abs().clamp_min(1e-300)

    # ---- factorisation ---------------------------------------------------------------------
    def start(self, floor: float = 0.0) -> NestedState:
        """NestedState of the dense support with the smallest damping >= floor that factorises."""
        pb = self.problem
        H = pb.H.to(self.config.dtype)
        factor, self.damping = factorize(H, pb.mean_diag, floor=floor, singular=pb.singular(pb.d1))
        return NestedState(H, pb.G.to(self.config.dtype), pb.group_size, pb.num_prune, factor=factor)

    @property
    def tracked(self) -> bool:
        """Whether the tracked weight is returned as it is (no refit): a float64 search of H + delta I with
        damping <= TRACKED_DAMPING (delta = 0 for a positive definite H)."""
        return self.config.dtype == torch.float64 and self.damping <= self.TRACKED_DAMPING

    @property
    def delta(self) -> float:
        """The damping added to H's diagonal in the search's problem (0.0 without damping)."""
        return damping_delta(self.damping, self.problem.mean_diag) if self.damping else 0.0

    def caller_objective(self, state: SwapState) -> float:
        """f of the state's tracked weight on the caller's H: the search's f_delta minus delta/2 |W|^2
        (1/2 W^T (H + delta I) W - G^T W = f_delta), without a product with H."""
        if not self.delta:
            return state.f
        return state.f - 0.5 * self.delta * float(state.weight().square().sum())

    def _refactorise(self, state: NestedState | SwapState, pruned: Tensor | None = None) -> NestedState | SwapState:
        """The same support (`pruned`, default the state's) from scratch, one damping rung up (drift or
        ill-conditioning)."""
        log.warning("osscar: a pivot lost positive definiteness; refactorising the support")
        self._count("refactorisations")
        higher = [lam for lam in DAMPING_LADDER if lam > self.damping]
        if not higher:
            raise IllConditioned("H is too ill-conditioned for the search even with the largest damping")
        fresh = self.start(floor=higher[0])
        # what improve() and dense_objective() reuse must be of the same (damped) problem as the states
        self._nested = fresh
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
            try:
                scores = state.scores()
            except PivotError:  # a pivot lost since the last step: the same support, one damping rung up
                state = self._refactorise(state)
                scores = state.scores()
            groups = torch.topk(scores, t, largest=False).indices
            state = self._guarded(state, lambda s, q=groups: s.prune(q))
            steps += 1
        self._count("greedy_steps", steps)
        return state

    # Bounds on the rows of a round's restore candidates (c g: columns formed, pair deltas batched) and
    # of the block on which it accepts its pairs in turn (2 pairs g); they matter for wide groups (heads,
    # conv channels), where the number of groups is small anyway.
    SWAP_CANDIDATE_ROWS = 512
    SWAP_BLOCK_ROWS = 512
    # Up to this many rows on the pruning side of a round's pairs, their columns are formed before the
    # pairs are accepted (a gather each once A0 is formed; fewer ops than the block alone plus the accepted
    # columns later); beyond it, only A[out, out] first and the accepted pairs' columns after (wide groups:
    # most pairs of a late round are not accepted, and a column costs O(d1 R) from the greedy's factors).
    EAGER_OUT_ROWS = 64

    def swaps(self, state: SwapState) -> SwapState:
        """Non-nested rounds (p_i = 0): exchange pruned and kept groups while f decreases."""
        rounds = accepted = 0
        # Pairs tried per round: all that may be exchanged at first, then twice the number of
        # individually improving pairs the last round found (late rounds find few).
        slots = self._max_pairs(state)
        while rounds < self.config.swap_rounds:
            state, n, improving = self.swap_round(state, slots)
            if n == 0:
                state, n = self.double_swap_round(state)
                if n == 0:
                    break
                self._count("double_swaps")
            slots = min(self._max_pairs(state), max(2, 2 * improving))
            rounds += 1
            accepted += n
        state = self.settle(state)
        self._count("swap_rounds", rounds)
        self._count("swaps", accepted)
        return state

    def _candidates(self, state: SwapState) -> int:
        per_rows = max(1, self.SWAP_CANDIDATE_ROWS // state.group_size)
        return min(self.config.swap_candidates, state.num_pruned, per_rows)

    def _max_pairs(self, state: SwapState) -> int:
        per_block = max(1, self.SWAP_BLOCK_ROWS // (2 * state.group_size))
        return max(0, min(self.config.swap_pairs, self._candidates(state),
                          state.num_groups - state.num_pruned, per_block))

    def swap_round(self, state: SwapState, pairs: int) -> tuple[SwapState, int, int]:
        """One round of single exchanges, trying up to `pairs` pairs; returns the state, how many
        pairs it exchanged and how many were improving on their own.

        Everything is decided on the device; the round synchronises with the host twice: once to
        learn the restore candidates (with the checks that every score is finite and that the last
        round's exchange kept its pivots positive definite), once to learn which pairs were accepted.
          1. restore candidates: the `swap_candidates` pruned groups with the highest gain;
          2. exact f change of every (candidate i, kept j) exchange, in one batch;
          3. up to `swap_pairs` disjoint pairs, best first;
          4. each pair accepted only if its exact change, given the pairs accepted before it in
             this round, still lowers f (on the small block of the pairs' rows: no d1 work);
          5. the accepted pairs applied as one restore and one prune of the full state, its pivots
             checked at the next synchronisation (`settle`).
        """
        g, p = state.group_size, state.num_groups
        pairs = min(pairs, self._max_pairs(state))
        if state.num_pruned in (0, p) or pairs == 0:
            return state, 0, 0
        c = self._candidates(state)
        gram = block_gram(state.Z, g)  # (p, g, g): Z_j Z_j^T, shared by the scores and the pair deltas
        scores = state.scores(check=False, gram=gram)
        gain, cand = torch.topk(torch.where(state.kept, -torch.inf, scores), c)
        head = torch.cat([cand, scores.isnan().any().view(1), *self._pending_info()]).tolist()  # sync 1
        if self._pending is not None and head[c + 1]:  # the last exchange lost a pivot: redone from its support
            return self.swap_round(self._resolve(state, ok=False), pairs)
        state = self._resolve(state, ok=True)
        if head[c]:  # a pivot block drifted: the same support from scratch (one damping rung up), again
            return self.swap_round(self._refactorise(state), pairs)
        # the candidates' rows on the host too: A0's columns of last round's candidates are reused
        cols_c = state.columns(group_rows(cand, g), known=_host_rows(head[:c], g))  # d1 x (c g)
        delta = self._pair_deltas(state, cand, gain, cols_c, gram)  # (c, p)
        threshold = self._threshold(state)
        slot_i, slot_j, slot_delta = _disjoint_pairs(delta, pairs)
        d1 = cols_c.shape[0]
        col_in = cols_c.view(d1, c, g).index_select(1, slot_i).reshape(d1, pairs * g)
        rows_out = group_rows(slot_j, g)
        rows = torch.cat([group_rows(cand[slot_i], g), rows_out])
        col_out = None
        if pairs * g <= self.EAGER_OUT_ROWS:  # few: the columns of the groups to prune, then their block
            col_out = state.columns(rows_out)  # d1 x (pairs g)
            B = torch.cat([col_in, col_out], 1)[rows]
        else:  # wide groups: A[out, out] alone; full columns only for the pairs accepted
            left = col_in[rows]  # (2 pairs g) x (pairs g): A[in, in] over A[out, in]
            B = torch.cat([left, torch.cat([left[pairs * g:].T, state.block(rows_out)])], 1)
        improving = slot_delta < threshold
        accepted = _accept_in_turn(state, rows, B, improving, threshold)
        flags = torch.cat([accepted, improving, slot_j]).tolist()  # sync 2
        chosen = [t for t in range(pairs) if flags[t]]
        n_improving = sum(flags[pairs:2 * pairs])
        if not chosen:
            return state, 0, n_improving
        sel = host_index(chosen, cand.device)
        rows_sel = group_rows(sel, g)
        if col_out is None:
            known = _host_rows([flags[2 * pairs + t] for t in chosen], g)
            col_out = state.columns(rows_out[rows_sel], known=known)
        else:
            col_out = col_out.index_select(1, rows_sel)
        state = self._exchange(state, cand[slot_i[sel]], slot_j[sel], col_in.index_select(1, rows_sel), col_out)
        return state, len(chosen), n_improving

    def double_swap_round(self, state: SwapState) -> tuple[SwapState, int]:
        """When no single exchange improves: the best 2-for-2 exchange among the top candidates,
        evaluated exactly in one batch (exhaustive on small layers); at most two host synchronisations
        (one to settle an exchange still unchecked, which a single round before it has always done)."""
        state = self.settle(state)
        move = self._best_double_exchange(state)
        if move is None:
            return state, 0
        return self._exchange(state, *move), 2

    def _exchange(self, state: SwapState, restore: Tensor, prune: Tensor, col_in: Tensor | None = None,
                  col_out: Tensor | None = None) -> SwapState:
        """`state.exchange` without a host synchronisation: its pivots' check waits for the next one (the next
        round's first, or `settle`), which redoes it from the support before it if a pivot was lost."""
        assert self._pending is None, "the previous exchange is settled first"
        before = state.kept.clone()
        info = state.exchange(restore, prune, col_in, col_out)
        self._pending = _Pending(info, before, restore, prune)
        return state

    def _pending_info(self) -> list[Tensor]:
        """The unchecked exchange's pivot info as a flag to synchronise with (none without one)."""
        return [] if self._pending is None else [(self._pending.info != 0).view(1)]

    def settle(self, state: SwapState) -> SwapState:
        """Check the last exchange's pivots (one host synchronisation, none without one) and redo it from the
        support before it if a pivot was lost; the state to go on with."""
        if self._pending is None:
            return state
        return self._resolve(state, ok=int(self._pending.info) == 0)

    def _resolve(self, state: SwapState, ok: bool) -> SwapState:
        """The pending exchange checked: kept if `ok`, else the support before it refactorised (one damping
        rung up) and the exchange made again, checked."""
        pending, self._pending = self._pending, None
        if pending is None or ok:
            return state
        state = self._refactorise(state, torch.nonzero(~pending.before).squeeze(1))
        return self._guarded(state, lambda s: s.swap(pending.restore, pending.prune))

    def _best_double_exchange(self, state: SwapState) -> tuple[Tensor, Tensor] | None:
        """The best 2-for-2 exchange among the top candidates, evaluated exactly in one batch."""
        g = state.group_size
        c = self.config.double_swap_candidates
        # bound the batch of (4g x 4g) sub-blocks, C(c, 2)^2 of them, to ~2^22 entries
        while c > 2 and math.comb(c, 2) ** 2 * (4 * g) ** 2 > 1 << 22:
            c -= 1
        num_pruned = state.num_pruned
        if c < 2 or num_pruned < 2 or state.num_groups - num_pruned < 2:
            return None
        scores = state.scores(check=False)
        cand_in = torch.topk(torch.where(state.kept, -torch.inf, scores), min(c, num_pruned)).indices
        cand_out = torch.topk(torch.where(state.kept, scores, torch.inf),
                              min(c, state.num_groups - num_pruned), largest=False).indices
        cand = torch.cat([cand_in, cand_out])
        rows = group_rows(cand, g)
        block = state.block(rows).view(cand.numel(), g, cand.numel(), g)
        z = state.Z[rows]
        gram = (z @ z.T).view(cand.numel(), g, cand.numel(), g)
        n_in, n_out = cand_in.numel(), cand_out.numel()
        combos = host_index([(a, b, n_in + x, n_in + y)  # (b, 4) local group ids, built on the host:
                             for a, b in itertools.combinations(range(n_in), 2)  # torch.combinations
                             for x, y in itertools.combinations(range(n_out), 2)],  # would synchronise
                            cand.device)
        b = combos.shape[0]

        def sub_blocks(M: Tensor) -> Tensor:  # (b, 4g, 4g) blocks of M at the combos' groups
            sub = M[combos[:, :, None], :, combos[:, None, :], :]  # (b, 4, 4, g, g)
            return sub.permute(0, 1, 3, 2, 4).reshape(b, 4 * g, 4 * g)

        delta = _batched_swap_delta(sub_blocks(block), sub_blocks(gram), 2 * g)
        best = torch.argmin(delta).view(1)  # indexing with a 0-d tensor would read it on the host
        threshold = self._threshold(state)
        improves, bad = torch.cat([delta.index_select(0, best) < threshold,
                                   scores.isnan().any().view(1)]).tolist()  # sync 1
        if bad:
            raise PivotError("a group's pivot block is not positive definite")
        if not improves:
            return None
        groups = cand[combos.index_select(0, best)[0]]
        return groups[:2], groups[2:]

    @staticmethod
    def _pair_deltas(state: SwapState, cand: Tensor, gain: Tensor, cols: Tensor | None = None,
                     gram: Tensor | None = None) -> Tensor:
        """delta[i, j] = f(S - {cand_i} + {j}) - f(S) for every kept j (inf elsewhere), in batches;
        `cols` (A[:, rows of cand]) and `gram` (block_gram of Z) when the caller has them."""
        g, p = state.group_size, state.num_groups
        rows_c = group_rows(cand, g)
        if cols is None:
            cols = state.columns(rows_c)  # d1 x (c g): A[:, cand]
        Z = state.Z
        c = cand.numel()
        if gram is None:
            gram = block_gram(Z, g)  # (p, g, g): Z_j Z_j^T
        if g == 1:
            a_ii = cols[cand, torch.arange(c, device=cand.device)]  # Schur complements
            r = cols / a_ii  # d1 x c
            a_jj = state.blocks.view(p, 1) - cols * r  # A_jj after restoring i (< 0 for kept j)
            norms = gram.view(p)  # |Z_j|^2
            z2 = norms.unsqueeze(1) - 2 * r * (Z @ Z[cand].T) + r.square() * norms[cand]
            delta = (0.5 * z2 / (-a_jj) - gain).T  # (c, p)
            return torch.where(state.kept.unsqueeze(0), delta, torch.inf)
        # only the kept groups j can be pruned: their indices without a synchronisation (the count is known)
        kept = torch.argsort((~state.kept).to(torch.uint8), stable=True)[: p - state.num_pruned]  # (q,)
        q = kept.numel()
        cols_g = cols.view(p, g, c, g)
        blocks, gram = state.blocks.index_select(0, kept), gram.index_select(0, kept)  # (q, g, g)
        Z_kept = Z.view(p, g, -1).index_select(0, kept).view(q * g, -1)  # (q g, d2)
        # candidates per batch: (chunk, q, g, g) bounded to 4 MiB in float64. Larger batches are no faster, and
        # on the CPU each of their ~10 temporaries (16 MiB at d1 = 8192, g = 64) was page-faulted afresh
        # (0.41-0.48 s a call against 0.13 s)
        chunk = max(1, (1 << 19) // (q * g * g))
        parts = []
        for k0 in range(0, c, chunk):
            k1 = min(c, k0 + chunk)
            n = k1 - k0
            a_ji = cols_g[:, :, k0:k1].index_select(0, kept).permute(2, 0, 1, 3)  # (n, q, g, g): A_ji
            a_ii = cols_g[cand[k0:k1], :, torch.arange(k0, k1, device=cand.device)]  # (n, g, g)
            t = a_ji @ pivot_inverse_ex(a_ii, 1.0)[0].unsqueeze(1)  # A_ji A_ii^-1
            neg_a_jj = -(blocks - t @ a_ji.transpose(-1, -2))  # -A_jj after restoring i
            z_i = Z[rows_c[k0 * g:k1 * g]].view(n, g, -1)  # (n, g, d2)
            cross = (z_i.reshape(n * g, -1) @ Z_kept.T).view(n, g, q, g).permute(0, 2, 1, 3)  # Z_i Z_j^T
            tc = t @ cross
            gram_i = (z_i @ z_i.transpose(1, 2)).unsqueeze(1)  # (n, 1, g, g): Z_i Z_i^T
            # Z'_j Z'_j^T with Z'_j = Z_j - t Z_i
            gram_j = gram - tc - tc.transpose(-1, -2) + t @ gram_i @ t.transpose(-1, -2)
            chol, info = torch.linalg.cholesky_ex(neg_a_jj)
            cost = 0.5 * torch.cholesky_solve(gram_j, chol).diagonal(dim1=-2, dim2=-1).sum(-1)
            parts.append(torch.where(info == 0, cost, torch.inf) - gain[k0:k1].unsqueeze(1))
        delta = torch.full((c, p), torch.inf, dtype=Z.dtype, device=Z.device)
        return delta.index_copy_(1, kept, torch.cat(parts))  # (c, p), inf for the pruned j

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
        self._nested = nested  # H^-1 and W0 stay valid: improve() reuses them (a refactorisation replaces them)
        state = nested.to_swap()
        lap("swap_setup_s")
        state = self.swaps(state)
        lap("swap_s")
        self.stats["damping"] = self.damping
        return state

    def improve(self, pruned: Tensor) -> SwapState:
        """Swap rounds from a given support (e.g. MP's), reusing the factorisation of search()."""
        assert self._nested is not None, "improve() needs search() first"
        nested = self._nested
        nested.reset()
        if pruned.numel():
            nested = self._guarded(nested, lambda s: s.prune(pruned))
        return self.swaps(nested.to_swap())

    def release(self) -> None:
        """Drop the factorisation search() kept (H^-1 and the greedy's factors): improve() and dense_objective()
        are then unavailable."""
        self._nested = None

    def dense_objective(self, pruned: Tensor) -> float:
        """f(pruned) in the search's problem, from the factorisation of search(), without a refit."""
        assert self._nested is not None, "dense_objective() needs search() first"
        nested = self._nested
        if not pruned.numel():
            return nested.f0
        return nested.f0 + nested.dense_prune_delta(pruned)


@dataclass(frozen=True)
class _Pending:
    """An exchange made but not yet checked: its worst pivot info (0: positive definite) and what redoing it
    needs (the support before it, the groups restored and pruned)."""

    info: Tensor
    before: Tensor  # kept groups before the exchange (bool, p)
    restore: Tensor
    prune: Tensor


def _host_rows(groups: list[int], group_size: int) -> list[int]:
    """`group_rows` on the host."""
    return [j * group_size + k for j in groups for k in range(group_size)]


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


def _joint_sweep_trace(A: Tensor, Q: Tensor) -> tuple[Tensor, Tensor]:
    """(Tr(A^-1 Q), LU info) for a block A (m, m) of the swept state and Q = Z Z^T of its rows: restoring the
    pruned ones and pruning the kept ones, in any order (sweeps commute), is one sweep of the whole set, which
    changes f by -1/2 Tr(A^-1 Q). One LU solve instead of `_batched_swap_delta`'s two Choleskys and their
    Schur complement: a third of the ops. The trace is meaningless where info != 0 (A singular); the pivots'
    definiteness is checked when the exchange is applied."""
    X, info = torch.linalg.solve_ex(A, Q)
    return torch.trace(X), info


def _disjoint_pairs(delta: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor]:
    """n (row, column, value) picks of the smallest entries of delta (c, p), each row and column
    used once, best first, decided on the device (no host synchronisation). Once no finite
    entry is left the picks repeat arbitrary ones with value inf.

    The picks only ever come from each row's n smallest entries: before pick t at most t - 1 < n
    columns are used, so a row's smallest remaining entry is among its n smallest. The loop runs on
    that (c, n) shortlist instead of the (c, p) matrix (p is every group of the layer)."""
    k = min(n, delta.shape[1])
    short, cols = torch.topk(delta, k, dim=1, largest=False)  # (c, k) each row's k best, their columns
    D = short.contiguous()
    flat, flat_cols = D.view(-1), cols.view(-1)
    rows, picked, values = [], [], []
    for _ in range(n):
        value, at = torch.min(flat, 0, keepdim=True)  # the first smallest, as argmin: one op for both
        col = flat_cols[at]
        rows.append(at // k)
        picked.append(col)
        values.append(value)
        D.index_fill_(0, rows[-1], torch.inf)  # the row is used
        D.masked_fill_(cols == col, torch.inf)  # and the column, wherever it is shortlisted
    return torch.cat(rows), torch.cat(picked), torch.cat(values)


def _accept_in_turn(state: SwapState, rows: Tensor, B: Tensor, valid: Tensor, threshold: Tensor) -> Tensor:
    """Which of the pairs' exchanges to make, in turn: pair t (restore rows t g.., prune rows (n + t) g..
    of `rows`, n pairs) is accepted when it is valid and f(accepted + t) - f(accepted) is below threshold,
    each joint change exact, on B = A[rows, rows] (the rows of pairs not in the set masked out: identity
    pivots, no coupling, zero Gram rows). Returns a bool tensor without synchronising."""
    g, n_pairs = state.group_size, valid.numel()
    z = state.Z[rows]
    Q = z @ z.T
    pair = torch.arange(n_pairs, device=rows.device).repeat_interleave(g).repeat(2)  # (m,): pair of each row
    members = pair == torch.arange(n_pairs, device=rows.device).unsqueeze(1)  # (n, m): rows of each pair
    sign = B.new_ones(2 * n_pairs * g)  # pivots: restore +, prune - (made on B's device: no host copy)
    sign[n_pairs * g:] = -1
    # a trial's block: B on the trial's rows, the sign of the pivot on the other rows' diagonal, 0 elsewhere
    # (a gather, so B's entries stay exact whatever their scale)
    D = torch.diag(sign)
    zeros = torch.zeros_like(Q)
    # f changes by -1/2 trace (`_joint_sweep_trace`): a pair improves the accepted set's f beyond the threshold
    # when its trial's trace exceeds theirs by more than -2 threshold (an invalid pair never: margin inf)
    margins = torch.where(valid, -2 * threshold, torch.inf)
    chosen = torch.zeros_like(pair, dtype=torch.bool)  # rows of the accepted pairs
    trace_chosen = torch.zeros((), dtype=B.dtype, device=B.device)  # -2 x their joint change of f
    accepted = []
    for member, margin in zip(members.unbind(0), margins.unbind(0), strict=True):
        trial = chosen | member
        both = trial.unsqueeze(1) & trial
        trace, info = _joint_sweep_trace(torch.where(both, B, D), torch.where(both, Q, zeros))
        ok = (info == 0) & (trace - trace_chosen > margin)
        chosen = torch.where(ok, trial, chosen)
        trace_chosen = torch.where(ok, trace, trace_chosen)
        accepted.append(ok)
    return torch.stack(accepted)
