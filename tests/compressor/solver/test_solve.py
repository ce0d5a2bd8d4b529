"""`solve_layer`: the public contract, every method, every bad input."""

import itertools
import math

import numpy as np
import pytest
import torch

from compressor import METHODS, solve_layer
from compressor.solver import problem as problem_module
from compressor.solver import solve as solve_module
from compressor.solver.baselines import flap_allocation, magnitude_support
from compressor.solver.osscar import OsscarConfig, OsscarSolver
from compressor.solver.problem import LayerProblem
from compressor.solver.solve import DENSE_ROWS_METHODS
from compressor.solver.sweep import SwapState
from compressor.solver.synthetic import correlated_problem


def brute_force_f(H, G, g, pruned):
    """f(S) the textbook way (numpy least squares on the kept rows), independent of the package."""
    p = H.shape[0] // g
    kept = [j for j in range(p) if j not in set(pruned)]
    rows = [j * g + a for j in kept for a in range(g)]
    if not rows:
        return 0.0
    Hn, Gn = H.numpy(), G.numpy()
    W = np.linalg.lstsq(Hn[np.ix_(rows, rows)], Gn[rows], rcond=None)[0]
    return float(-0.5 * (Gn[rows] * W).sum())


def literal_objective(H, G, W):
    W = W.double()
    return float(0.5 * (W * (H @ W)).sum() - (G * W).sum())


@pytest.mark.parametrize("g,d1,num_prune", [(1, 10, 4), (2, 16, 3), (3, 18, 4)])
def test_exact_is_the_optimum(g, d1, num_prune):
    pb = correlated_problem(d1, 4, g, samples=40, seed=11)
    sol = solve_layer(pb.H, pb.G, g, num_prune, "exact")
    p = d1 // g
    best = min(brute_force_f(pb.H, pb.G, g, S) for S in itertools.combinations(range(p), num_prune))
    assert sol.objective == pytest.approx(best, rel=1e-9)
    assert sol.objective == pytest.approx(brute_force_f(pb.H, pb.G, g, sol.pruned), rel=1e-9)


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("g", [1, 4])
def test_contract_of_every_method(method, g):
    d1 = 16 * g if method == "exact" else 64  # exact enumerates: at most 20 groups
    pb = correlated_problem(d1, 12, g, seed=5)
    p, k = d1 // g, (d1 // g) // 2
    sol = solve_layer(pb.H, pb.G, g, k, method, dense_weight=pb.dense_weight)
    assert sol.pruned == sorted(sol.pruned) and len(set(sol.pruned)) == k
    assert all(0 <= j < p for j in sol.pruned)
    assert sol.weight.shape == pb.G.shape and sol.weight.dtype == pb.G.dtype
    rows = torch.tensor([j * g + a for j in sol.pruned for a in range(g)])
    assert torch.count_nonzero(sol.weight[rows]) == 0  # pruned rows exactly zero
    # the reported objective is the objective of the returned weight, with the caller's H
    assert sol.objective == pytest.approx(literal_objective(pb.H, pb.G, sol.weight), rel=1e-9)
    if method in DENSE_ROWS_METHODS:  # the dense weight's kept rows as they are
        expected = pb.dense_weight.clone()
        expected[rows] = 0
        assert torch.equal(sol.weight, expected)
    else:  # optimal for its support: equals f(S) recomputed from scratch, and KKT holds
        assert sol.objective == pytest.approx(brute_force_f(pb.H, pb.G, g, sol.pruned), rel=1e-9)
        kept = torch.tensor([r for r in range(d1) if r not in set(rows.tolist())])
        residual = pb.H[kept][:, kept] @ sol.weight[kept] - pb.G[kept]
        assert float(residual.abs().max()) < 1e-8 * float(pb.G.abs().max())
    assert sol.objective <= 0


def test_osscar_support_keeps_osscars_choice_with_the_dense_rows():
    pb = correlated_problem(48, 8, 4, seed=9)
    searched = solve_layer(pb.H, pb.G, 4, 5, "osscar", dense_weight=pb.dense_weight)
    kept = solve_layer(pb.H, pb.G, 4, 5, "osscar-support", dense_weight=pb.dense_weight)
    assert kept.pruned == searched.pruned
    assert kept.objective >= searched.objective  # the refit is optimal on that support; the dense rows are not
    with pytest.raises(ValueError, match="needs dense_weight"):
        solve_layer(pb.H, pb.G, 4, 5, "osscar-support")


def test_osscar_never_worse_than_mp_plus_on_random_structured_problems():
    wins = 0
    for seed in range(40):
        g = (1, 2, 3, 4)[seed % 4]
        d1 = g * (8 + seed % 17)
        pb = correlated_problem(d1, 6, g, samples=3 * d1, seed=100 + seed, shift=0.05 * (seed % 7))
        k = max(1, (d1 // g) * (1 + seed % 3) // 4)
        os_ = solve_layer(pb.H, pb.G, g, k, dense_weight=pb.dense_weight).objective
        mp = solve_layer(pb.H, pb.G, g, k, "mp+", dense_weight=pb.dense_weight).objective
        assert os_ <= mp + 1e-10 * abs(mp), seed
        wins += os_ < mp - 1e-9 * abs(mp)
    assert wins >= 30  # and it is usually strictly better


def test_guard_keeps_mp_plus_when_a_crippled_search_loses_to_it():
    """With one greedy step and no swaps the search loses to MP+ on some problems; the guard
    must then return a support at least as good as MP+'s (here: MP+'s itself)."""
    sources = set()
    for seed in range(40):
        pb = correlated_problem(24, 6, 2, samples=60, seed=seed, shift=0.5)
        sol = solve_layer(pb.H, pb.G, 2, 6, dense_weight=pb.dense_weight, step_fraction=1.0, swap_rounds=0)
        mp = solve_layer(pb.H, pb.G, 2, 6, "mp+", dense_weight=pb.dense_weight)
        assert sol.objective <= mp.objective + 1e-10 * abs(mp.objective)
        sources.add(sol.stats["source"])
    assert "mp+" in sources and "osscar" in sources


def test_a_search_that_loses_definiteness_at_every_damping_falls_back_to_mp_plus(monkeypatch):
    """Where the search's exchanges lose positive definiteness even at the largest damping, the layer gets
    MP+'s support and refit (what the search had to beat anyway) and the stats say so; without a dense
    weight there is no MP+ and the error stands."""
    from compressor.solver.problem import IllConditioned

    def hopeless(self, *args, **kwargs):
        raise IllConditioned("H is too ill-conditioned for the search even with the largest damping")

    monkeypatch.setattr(OsscarSolver, "search", hopeless)
    pb = correlated_problem(24, 6, 2, samples=60, seed=0, shift=0.5)
    sol = solve_layer(pb.H, pb.G, 2, 6, dense_weight=pb.dense_weight)
    mp = solve_layer(pb.H, pb.G, 2, 6, "mp+", dense_weight=pb.dense_weight)
    assert sol.pruned == mp.pruned and sol.objective == pytest.approx(mp.objective)
    assert sol.method == "osscar" and sol.stats["fallback"].startswith("mp+ (H is too ill-conditioned")
    with pytest.raises(IllConditioned):
        solve_layer(pb.H, pb.G, 2, 6)


def test_osscar_matches_exact_on_small_problems_most_of_the_time():
    gaps = []
    for seed in range(12):
        pb = correlated_problem(16, 6, 1, samples=48, seed=200 + seed, rank_fraction=0.3)
        ex = solve_layer(pb.H, pb.G, 1, 8, "exact").objective
        os_ = solve_layer(pb.H, pb.G, 1, 8, dense_weight=pb.dense_weight).objective
        f0 = solve_layer(pb.H, pb.G, 1, 0, "exact").objective
        assert os_ >= ex - 1e-9 * abs(ex)
        gaps.append((os_ - ex) / (ex - f0))
    assert sorted(gaps)[len(gaps) // 2] <= 1e-9  # median: the optimum itself
    assert max(gaps) < 0.05


def test_edge_counts_and_no_dense_weight():
    pb = correlated_problem(12, 3, 3, samples=30, seed=1)
    none = solve_layer(pb.H, pb.G, 3, 0)
    assert none.pruned == [] and none.objective == pytest.approx(brute_force_f(pb.H, pb.G, 3, []), rel=1e-9)
    every = solve_layer(pb.H, pb.G, 3, 4)
    assert every.pruned == [0, 1, 2, 3] and torch.count_nonzero(every.weight) == 0 and every.objective == 0
    for method in ("osscar", "thinet", "exact"):  # these need no dense weight
        assert len(solve_layer(pb.H, pb.G, 3, 2, method).pruned) == 2


def test_singular_H_is_damped_and_still_optimal_for_its_support():
    # fewer samples than features: H has rank 20 < 40
    pb = correlated_problem(40, 5, 1, samples=20, seed=4)
    sol = solve_layer(pb.H, pb.G, 1, 10, dense_weight=pb.dense_weight)
    mp = solve_layer(pb.H, pb.G, 1, 10, "mp+", dense_weight=pb.dense_weight)
    assert math.isfinite(sol.objective) and sol.objective <= mp.objective + 1e-8 * abs(mp.objective)
    assert sol.objective == pytest.approx(literal_objective(pb.H, pb.G, sol.weight), rel=1e-9)
    assert sol.stats["damping"] > 0


def test_singular_H_returns_the_tracked_weight_without_a_refit(monkeypatch):
    """A damped search of a singular H returns its tracked optimum of H + delta I: no refit on the kept
    rows (the refit's Cholesky and solve cost about what MP+ costs in all), its objective evaluated on H."""
    pb = correlated_problem(48, 6, 1, samples=24, seed=5)
    tracked = solve_layer(pb.H, pb.G, 1, 12, dense_weight=pb.dense_weight, guard_mp=False)
    assert tracked.stats["damping"] > 0 and tracked.stats["drift"] <= solve_module.MAX_DRIFT * abs(tracked.objective)
    assert tracked.objective == pytest.approx(literal_objective(pb.H, pb.G, tracked.weight), rel=1e-12)

    def no_refit(*args):
        raise AssertionError("refit called")

    monkeypatch.setattr(LayerProblem, "refit", no_refit)
    again = solve_layer(pb.H, pb.G, 1, 12, dense_weight=pb.dense_weight, guard_mp=False)
    assert again.pruned == tracked.pruned and torch.equal(again.weight, tracked.weight)


def test_a_rank_bound_skips_the_cholesky_that_would_fail(monkeypatch):
    """rank(H) <= rank < d1: the undamped factorisations of H (and of the kept rows in a refit) are known to
    fail, so they are not attempted; the damped ones, and so the results, are the same."""
    pb = correlated_problem(48, 6, 1, samples=24, seed=5)
    cholesky = problem_module.cholesky
    calls = []

    def counted(M, *args, **kwargs):
        calls.append(M.shape[-1])
        return cholesky(M, *args, **kwargs)

    monkeypatch.setattr(problem_module, "cholesky", counted)
    for method in ("osscar", "mp+"):
        calls.clear()
        plain = solve_layer(pb.H, pb.G, 1, 12, method, dense_weight=pb.dense_weight)
        without = list(calls)
        calls.clear()
        bounded = solve_layer(pb.H, pb.G, 1, 12, method, dense_weight=pb.dense_weight, rank=24)
        assert bounded.pruned == plain.pruned and bounded.objective == plain.objective
        big = 48 if method == "osscar" else 36  # the whole H, or the kept rows of the refit
        assert without.count(big) == 2 and calls.count(big) == 1, (method, without, calls)


def test_drifted_tracked_values_fall_back_to_a_refit(monkeypatch):
    pb = correlated_problem(48, 6, 1, samples=24, seed=5)
    monkeypatch.setattr(solve_module, "MAX_DRIFT", -1.0)  # no drift is small enough
    sol = solve_layer(pb.H, pb.G, 1, 12, dense_weight=pb.dense_weight, guard_mp=False)
    problem = LayerProblem.validate(pb.H, pb.G, 1, 12, pb.dense_weight)
    assert torch.equal(sol.weight, problem.refit(torch.tensor(sol.pruned)))


def test_a_damping_raised_while_improving_mp_plus_falls_back_to_a_refit(monkeypatch):
    """If improving MP+'s support refactorises one damping rung up, the improved state is the optimum of
    another (damped) problem: the weight returned is the refit on the caller's H, not that state's."""
    improve = OsscarSolver.improve

    def improve_damped(self, pruned):
        state = improve(self, pruned)
        self.damping = 1e-2  # as _refactorise would
        return state

    monkeypatch.setattr(OsscarSolver, "improve", improve_damped)
    for seed in range(40):
        pb = correlated_problem(24, 6, 2, samples=60, seed=seed, shift=0.5)
        sol = solve_layer(pb.H, pb.G, 2, 6, dense_weight=pb.dense_weight, step_fraction=1.0, swap_rounds=0)
        if sol.stats["source"].startswith("mp+"):
            break
    else:
        pytest.fail("the guard never improved MP+'s support")
    problem = LayerProblem.validate(pb.H, pb.G, 2, 6, pb.dense_weight)
    assert sol.stats["damping"] == 1e-2
    assert torch.equal(sol.weight, problem.refit(torch.tensor(sol.pruned)))


def test_the_guard_releases_the_searched_state_before_a_second_search(monkeypatch):
    """Improving MP+'s support is a second swap phase with an A0 of its own: the searched state, only compared
    and returned from then on, gives up its A0 first (a down projection's is 0.5 GB in float64)."""
    released, improved = [], []
    release, improve = SwapState.release, OsscarSolver.improve

    def recording_release(self):
        released.append(self)
        release(self)

    def checking_improve(self, pruned):
        improved.append(len(released))
        return improve(self, pruned)

    monkeypatch.setattr(SwapState, "release", recording_release)
    monkeypatch.setattr(OsscarSolver, "improve", checking_improve)
    for seed in range(40):
        pb = correlated_problem(24, 6, 2, samples=60, seed=seed, shift=0.5)
        mp = solve_layer(pb.H, pb.G, 2, 6, "mp+", dense_weight=pb.dense_weight)
        sol = solve_layer(pb.H, pb.G, 2, 6, dense_weight=pb.dense_weight, step_fraction=1.0, swap_rounds=0)
        assert sol.objective <= mp.objective + 1e-10 * abs(mp.objective)  # the released state still compares
        if improved:
            break
    else:
        pytest.fail("the guard never improved MP+'s support")
    assert improved[0] >= 1 and released[0]._A0 is None and released[0]._Hinv is None


def test_objective_and_refit_by_slabs_of_rows_match_the_whole_gathers(monkeypatch):
    """f and the refit gather H a few rows at a time (slabs that do not divide the rows): the same numbers as
    the whole gathers, to rounding."""
    pb = correlated_problem(40, 7, 1, samples=200, seed=2)
    problem = LayerProblem.validate(pb.H, pb.G, 1, 10, pb.dense_weight)
    pruned = torch.tensor([0, 3, 4, 9, 17, 21, 22, 30, 31, 39])
    kept = torch.tensor([j for j in range(40) if j not in set(pruned.tolist())])
    H_KK = pb.H.double()[kept][:, kept]
    W = torch.zeros(40, 7, dtype=torch.float64)
    W[kept] = torch.linalg.solve(H_KK, pb.G.double()[kept])
    f = float(0.5 * (W[kept] * (H_KK @ W[kept])).sum() - (pb.G.double()[kept] * W[kept]).sum())
    monkeypatch.setattr(problem_module, "SLAB_ROWS", 7)
    assert torch.allclose(problem.refit(pruned), W, rtol=1e-9, atol=1e-12)
    assert math.isclose(problem.objective(W), f, rel_tol=1e-12)
    assert torch.equal(problem_module.principal_block(pb.H.double(), kept), H_KK)


def test_guard_improves_mp_plus_only_when_it_beats_the_search_by_more_than_the_drift():
    """A crippled search that loses to MP+: with exact tracked values the guard switches to MP+'s
    support; told that the values drift by more than the gap, it keeps the search's."""
    for seed in range(40):
        pb = correlated_problem(24, 6, 2, samples=60, seed=seed, shift=0.5)
        problem = LayerProblem.validate(pb.H, pb.G, 2, 6, pb.dense_weight)
        solver = OsscarSolver(problem, OsscarConfig(step_fraction=1.0, swap_rounds=0))
        state = solver.search()
        mp = solver.dense_objective(magnitude_support(problem))
        if mp < state.f - 1e-6 * abs(state.f):  # MP+ clearly better
            break
    else:
        pytest.fail("no problem where the crippled search loses to MP+")
    stats = {}
    assert solve_module._guard_mp(problem, solver, state, stats, 0.0).f < state.f
    assert stats["source"].startswith("mp+")
    gap = state.f - mp
    stats = {}
    assert solve_module._guard_mp(problem, solver, state, stats, 2 * gap) is state and not stats


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lower_precision_inputs(dtype):
    pb = correlated_problem(32, 8, 2, seed=9)
    H, G, W = pb.H.to(dtype), pb.G.to(dtype), pb.dense_weight.to(dtype)
    sol = solve_layer(H, G, 2, 8, dense_weight=W)
    assert sol.weight.dtype == dtype
    assert sol.objective == pytest.approx(literal_objective(H.double(), G.double(), sol.weight),
                                          rel=1e-6 if dtype == torch.float32 else 1e-3)


def test_float32_search_is_refit_in_float64():
    pb = correlated_problem(96, 24, 1, seed=12)
    s32 = solve_layer(pb.H, pb.G, 1, 48, dense_weight=pb.dense_weight, dtype=torch.float32)
    s64 = solve_layer(pb.H, pb.G, 1, 48, dense_weight=pb.dense_weight)
    assert s32.objective == pytest.approx(brute_force_f(pb.H, pb.G, 1, s32.pruned), rel=1e-9)
    assert s32.objective == pytest.approx(s64.objective, rel=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu():
    pb = correlated_problem(256, 64, 4, seed=13)
    cpu = solve_layer(pb.H, pb.G, 4, 32, dense_weight=pb.dense_weight)
    gpu = solve_layer(pb.H.cuda(), pb.G.cuda(), 4, 32, dense_weight=pb.dense_weight.cuda())
    assert gpu.weight.is_cuda
    assert gpu.objective == pytest.approx(cpu.objective, rel=1e-9)
    assert gpu.pruned == cpu.pruned


def _bad(**overrides):
    pb = correlated_problem(12, 3, 1, samples=30, seed=0)
    args = dict(H=pb.H, G=pb.G, group_size=1, num_prune=4, method="osscar", dense_weight=pb.dense_weight)
    args.update(overrides)
    return args


def _nan_H():
    H = correlated_problem(12, 3, 1, samples=30, seed=0).H.clone()
    H[2, 3] = H[3, 2] = float("nan")
    return H


def _inf_G():
    G = correlated_problem(12, 3, 1, samples=30, seed=0).G.clone()
    G[0, 0] = float("inf")
    return G


def _asymmetric_H():
    H = correlated_problem(12, 3, 1, samples=30, seed=0).H.clone()
    H[0, 5] += 10 * float(H.abs().max())
    return H


def _negative_diag_H():
    H = correlated_problem(12, 3, 1, samples=30, seed=0).H.clone()
    H[4, 4] = -1.0
    return H


BAD_INPUTS = {
    "H not square": (lambda: _bad(H=torch.ones(12, 11, dtype=torch.float64)), "square"),
    "H 3-d": (lambda: _bad(H=torch.ones(2, 12, 12, dtype=torch.float64)), "square"),
    "G rows differ": (lambda: _bad(G=torch.ones(11, 3, dtype=torch.float64)), "G must be"),
    "integer H": (lambda: _bad(H=torch.ones(12, 12, dtype=torch.int64)), "floating point"),
    "d1 not divisible": (lambda: _bad(group_size=5), "not divisible"),
    "group_size zero": (lambda: _bad(group_size=0), "group_size"),
    "group_size float": (lambda: _bad(group_size=1.0), "group_size"),
    "num_prune negative": (lambda: _bad(num_prune=-1), "outside"),
    "num_prune too large": (lambda: _bad(num_prune=13), "outside"),
    "num_prune float": (lambda: _bad(num_prune=2.0), "num_prune"),
    "num_prune bool": (lambda: _bad(num_prune=True), "num_prune"),
    "rank negative": (lambda: {**_bad(), "rank": -1}, "rank must be"),
    "rank float": (lambda: {**_bad(), "rank": 3.0}, "rank must be"),
    "NaN in H": (lambda: _bad(H=_nan_H()), "NaN"),
    "Inf in G": (lambda: _bad(G=_inf_G()), "NaN or Inf"),
    "NaN in dense_weight": (
        lambda: _bad(dense_weight=torch.full((12, 3), float("nan"), dtype=torch.float64)), "dense_weight"),
    "dense_weight shape": (lambda: _bad(dense_weight=torch.ones(12, 4, dtype=torch.float64)), "dense_weight"),
    "H not symmetric": (lambda: _bad(H=_asymmetric_H()), "symmetric"),
    "H negative diagonal": (lambda: _bad(H=_negative_diag_H()), "semi-definite"),
    "mp without dense_weight": (lambda: _bad(method="mp", dense_weight=None), "dense_weight"),
    "mp+ without dense_weight": (lambda: _bad(method="mp+", dense_weight=None), "dense_weight"),
    "unknown method": (lambda: _bad(method="random"), "unknown method"),
    "unknown option": (lambda: {**_bad(), "step": 3}, "unknown osscar options"),
    "bad option value": (lambda: {**_bad(), "step_fraction": 0.0}, "step_fraction"),
    "bad dtype option": (lambda: {**_bad(), "dtype": torch.float16}, "dtype"),
    "options for mp+": (lambda: {**_bad(method="mp+"), "swap_rounds": 1}, "takes no options"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_raises_a_value_error_naming_the_problem(case):
    make, words = BAD_INPUTS[case]
    args = make()
    with pytest.raises(ValueError, match=words):
        solve_layer(args.pop("H"), args.pop("G"), args.pop("group_size"), args.pop("num_prune"),
                    args.pop("method"), **args)


def test_exact_refuses_large_problems():
    pb = correlated_problem(24, 3, 1, samples=60, seed=0)
    with pytest.raises(ValueError, match="refuses more than 20 groups"):
        solve_layer(pb.H, pb.G, 1, 12, "exact")


def test_indefinite_H_is_refused():
    H = torch.diag(torch.tensor([1.0, 1.0, 1.0, 1.0], dtype=torch.float64))
    H[0, 1] = H[1, 0] = 5.0  # symmetric, positive diagonal, but indefinite
    with pytest.raises(ValueError, match="positive semi-definite"):
        solve_layer(H, torch.ones(4, 2, dtype=torch.float64), 1, 2)


def test_wanda_sp_and_flap_score_rows_by_input_size_and_weight():
    """Wanda-sp scores a row ||X_j|| sum_i |W_ji|, FLAP H_jj ||W_j||^2: on rows of equal inputs, one weight
    concentrated (4, 0) and one spread (2.5, 2.5), Wanda-sp drops the first (4 < 5) and FLAP the second
    (12.5 < 16); a third row with large inputs and weights stays under both."""
    H = torch.diag(torch.tensor([1.0, 1.0, 9.0], dtype=torch.float64))
    W = torch.tensor([[4.0, 0.0], [2.5, 2.5], [3.0, 3.0]], dtype=torch.float64)
    G = H @ W
    assert solve_layer(H, G, 1, 1, "wanda-sp", dense_weight=W).pruned == [0]
    assert solve_layer(H, G, 1, 1, "flap", dense_weight=W).pruned == [1]
    for method in ("wanda-sp", "flap"):
        assert solve_layer(H, G, 1, 2, method, dense_weight=W).pruned == [0, 1]
        with pytest.raises(ValueError, match="dense_weight"):
            solve_layer(H, G, 1, 1, method)


def test_flap_ranks_heads_by_their_rows_scores_squared_as_its_allocation_does():
    """Head 0's rows score 1, 1, 1, 1 (sum 4), head 1's 0, 0, 0, 3.5 (sum 3.5): summed, head 1 went, where FLAP (and
    `flap_allocation`: squared, standardized, averaged) keeps head 1 (12.25 against 4) and drops head 0."""
    H = torch.diag(torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 3.5], dtype=torch.float64))
    W = torch.zeros(8, 2, dtype=torch.float64)
    W[:, 0] = 1.0
    H = H + 1e-3 * torch.eye(8, dtype=torch.float64)
    assert solve_layer(H, H @ W, 4, 1, "flap", dense_weight=W).pruned == [0]


def test_statistics_at_rounding_level_fall_back_to_the_magnitude_support():
    """An H that no damping factorises (every 2 x 2 block indefinite at the 1e-20 scale of an EfficientNet
    squeeze-excite conv fed ~zero inputs): osscar and MP+'s refit both need a factor, so the layer keeps the
    magnitude support with its dense weights, and says so; a job no longer ends in a traceback there."""
    H = torch.tensor([[1.0, 2.0, 2.0], [2.0, 1.0, 2.0], [2.0, 2.0, 1.0]], dtype=torch.float64) * 1e-20
    W_hat = torch.tensor([[3.0, 1.0], [0.1, 0.2], [-2.0, 0.5]], dtype=torch.float64)
    sol = solve_layer(H, H @ W_hat, 1, 1, dense_weight=W_hat)
    magnitude = solve_layer(H, H @ W_hat, 1, 1, "mp", dense_weight=W_hat)
    assert sol.pruned == magnitude.pruned == [1]  # the smallest row
    assert sol.stats["fallback"].startswith("mp (H on the kept rows is not positive semi-definite")
    torch.testing.assert_close(sol.weight[[0, 2]], W_hat[[0, 2]])
    thinet = solve_layer(H, H @ W_hat, 1, 1, "thinet", dense_weight=W_hat)  # a refit too: the same fallback
    assert thinet.pruned == [1] and thinet.stats["fallback"].startswith("mp ")


def test_flaps_allocation_keeps_the_best_standardized_units_up_to_the_kept_weight():
    """FLAP's AL-AM search: scores standardized per layer and module, one threshold across all, heads weighing
    `head_weight` neurons; keep=1 keeps everything."""
    torch.manual_seed(0)
    attention = [torch.rand(8), torch.rand(8)]  # 4 heads of head_dim 2 per layer
    ffn = [torch.rand(10), torch.rand(10)]
    assert flap_allocation(attention, ffn, 2, 3.0, 1.0) == ([4, 4], [10, 10])
    heads, neurons = flap_allocation(attention, ffn, 2, 3.0, 0.6)
    total = 3.0 * 8 + 20
    kept = 3.0 * sum(heads) + sum(neurons)
    assert abs(kept - 0.6 * total) <= 3.0, (heads, neurons)  # the closest a unit's weight allows
    # standardization: scaling one layer's scores changes nothing; the order within a layer is the scores'
    scaled = flap_allocation([attention[0] * 1000, attention[1]], [ffn[0], ffn[1] * 1e-3], 2, 3.0, 0.6)
    assert scaled == (heads, neurons)
    # a layer whose scores are flat but for one outlier loses more units than one spread evenly
    flat = 1.0 + 1e-3 * torch.rand(10)
    flat[0] = 100.0
    _, spread_vs_flat = flap_allocation(attention, [torch.linspace(0, 1, 10), flat], 2, 3.0, 0.6)
    assert spread_vs_flat[1] < spread_vs_flat[0]


def _dependent_feature_problem(seed: int, combo: bool):
    """512 calibration rows of 64 features, one an exact copy (or combination) of others: H is singular although
    the rank bound from the rows (511) cannot say so."""
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(512, 64, generator=gen, dtype=torch.float64)
    X *= torch.exp(3 * torch.rand(64, generator=gen, dtype=torch.float64))
    X[:, 5] = X[:, 3] + 0.5 * X[:, 7] if combo else X[:, 3]
    W = torch.randn(64, 16, generator=gen, dtype=torch.float64)
    H = X.T @ X
    H = 0.5 * (H + H.T)
    return X, H, H @ W, W


def test_an_exactly_singular_h_the_rank_bound_cannot_see_is_damped_not_trusted():
    """Its undamped Cholesky passes on rounding-level pivots: the search's weight and f were noise (a loss of
    -15,784 reported for a weight whose loss is 190,699, 39 % above the optimum on its own support)."""
    X, H, G, W = _dependent_feature_problem(6, combo=True)
    sol = solve_layer(H, G, 1, 16, dense_weight=W, rank=511)
    kept = [j for j in range(64) if j not in set(sol.pruned)]
    target = X @ W
    best = torch.linalg.lstsq(X[:, kept], target, driver="gelsd").solution
    loss = lambda w: 0.5 * float((target - X @ w).square().sum())  # noqa: E731
    optimum = loss(torch.zeros_like(W).index_copy_(0, torch.tensor(kept), best))
    assert loss(sol.weight) == pytest.approx(optimum, rel=1e-6)
    assert sol.objective + 0.5 * float((W * (H @ W)).sum()) == pytest.approx(optimum, rel=1e-6)


def test_a_pivot_lost_in_the_greedy_is_recovered_not_raised():
    _, H, G, W = _dependent_feature_problem(5, combo=False)
    sol = solve_layer(H, G, 4, 4, dense_weight=W, rank=511)
    assert len(sol.pruned) == 4
    assert sol.objective == pytest.approx(float(0.5 * (sol.weight * (H @ sol.weight)).sum() - (G * sol.weight).sum()),
                                          rel=1e-6)


def test_a_single_row_block_that_is_not_positive_scores_nan():
    from compressor.solver.sweep import block_scores

    scores = block_scores(torch.tensor([[[2.0]], [[-4.0]], [[0.0]]]), torch.tensor([[[1.0]], [[1.0]], [[1.0]]]))
    assert scores[0] == 0.25 and scores[1:].isnan().all()


def test_mp_ranks_the_weight_as_the_model_holds_it_when_the_problem_scales_its_columns():
    """A dense weight given with its columns scaled (a norm's gamma weighting the objective): MP's order, and so
    mp+ and osscar's MP+ guard, takes the scale off; without `magnitude_scale` it ranks what it is given."""
    pb = correlated_problem(4, 2, seed=3)
    raw = torch.tensor([[3.0, 0.04], [1.0, 0.03], [2.0, 0.01], [0.5, 0.02]], dtype=torch.float64)
    scale = torch.tensor([1.0, 100.0], dtype=torch.float64)  # column 2's small entries dominate once scaled
    unscaled = solve_layer(pb.H, pb.G, 1, 2, "mp+", dense_weight=raw * scale, magnitude_scale=scale)
    plain = solve_layer(pb.H, pb.G, 1, 2, "mp+", dense_weight=raw * scale)
    assert unscaled.pruned == [1, 3]  # the raw rows' norms: 1.0 and 0.5 are the smallest
    assert plain.pruned == [2, 3]  # the scaled ones: 2.24 and 2.06
