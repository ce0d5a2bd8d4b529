"""Pieces of the swap rounds (compressor/solver/osscar.py) against plain references."""

import pytest
import torch

from compressor.solver.osscar import OsscarConfig, OsscarSolver, _accept_in_turn, _disjoint_pairs
from compressor.solver.problem import LayerProblem, group_rows
from compressor.solver.sweep import NestedState, SwapState, sweep_dense
from compressor.solver.synthetic import correlated_problem


def greedy_matching(delta: torch.Tensor, n: int) -> list[tuple[int, int, float]]:
    """The reference: n times the smallest entry of the whole matrix, its row and column then used."""
    D = delta.clone()
    picks = []
    for _ in range(n):
        k = int(torch.argmin(D))
        i, j = divmod(k, D.shape[1])
        picks.append((i, j, float(D[i, j])))
        D[i, :] = torch.inf
        D[:, j] = torch.inf
    return picks


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("c,p,n", [(16, 300, 16), (8, 40, 8), (5, 5, 5), (12, 30, 4)])
def test_disjoint_pairs_match_the_whole_matrix_greedy(seed, c, p, n):
    gen = torch.Generator().manual_seed(seed)
    delta = torch.randn(c, p, generator=gen, dtype=torch.float64)
    # kept columns only (inf elsewhere), and rows that all want the same few columns: the shortlist
    # must still find each row's best unused column
    delta[:, torch.randperm(p, generator=gen)[: p // 3]] = torch.inf
    delta[:, :3] -= 5.0
    rows, cols, values = _disjoint_pairs(delta, n)
    expected = greedy_matching(delta, n)
    finite = [(i, j, v) for i, j, v in expected if v != torch.inf]
    got = list(zip(rows.tolist(), cols.tolist(), values.tolist(), strict=True))
    assert got[: len(finite)] == finite
    assert all(v == torch.inf for _, _, v in got[len(finite):])
    assert len({i for i, _, _ in got[: len(finite)]}) == len(finite)  # disjoint rows
    assert len({j for _, j, _ in got[: len(finite)]}) == len(finite)  # disjoint columns


def joint_change(state: SwapState, restore: list[int], prune: list[int]) -> float:
    """The reference: f change of restoring then pruning the groups, swept one by one on an explicit block."""
    g = state.group_size
    rows = group_rows(torch.tensor(restore + prune, dtype=torch.long), g)
    A, Z = state.block(rows), state.Z[rows].clone()
    local = torch.arange(rows.numel())
    m = len(restore) * g
    return sweep_dense(A, Z, local[:m], True) + sweep_dense(A, Z, local[m:], False)


@pytest.mark.parametrize("g", [1, 3])
@pytest.mark.parametrize("seed", range(4))
def test_pairs_accepted_in_turn_match_the_exact_joint_changes(g, seed):
    """Pair t is accepted exactly when f(accepted + t) - f(accepted) is below the threshold, the changes
    computed by plain sweeps; an invalid pair never is."""
    pb = correlated_problem(40 * g, 6, g, samples=120 * g, seed=seed, shift=0.3)
    nested = NestedState(pb.H.clone(), pb.G.clone(), g, 20)
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(40, generator=gen)
    nested.prune(order[:20])  # a random support: many exchanges improve it, and they interact
    state = nested.to_swap()
    n = 8
    # good pairs (highest restore gain with lowest prune cost) alternating with bad ones (the reverse)
    scores = state.scores()
    by_gain = torch.argsort(torch.where(state.kept, -torch.inf, scores), descending=True)[:20].tolist()
    by_cost = torch.argsort(torch.where(state.kept, scores, torch.inf))[:20].tolist()
    restore = [by_gain[t // 2] if t % 2 == 0 else by_gain[-1 - t // 2] for t in range(n)]
    prune = [by_cost[t // 2] if t % 2 == 0 else by_cost[-1 - t // 2] for t in range(n)]
    rows = group_rows(torch.tensor(restore + prune), g)
    valid = torch.ones(n, dtype=torch.bool)
    valid[2] = False
    threshold = torch.tensor(-1e-9 * abs(state.f), dtype=torch.float64)
    got = _accept_in_turn(state, rows, state.block(rows), valid, threshold).tolist()
    accepted, expected = [], []
    for t in range(n):
        before = joint_change(state, [restore[i] for i in accepted], [prune[i] for i in accepted]) if accepted else 0.0
        trial = [*accepted, t]
        after = joint_change(state, [restore[i] for i in trial], [prune[i] for i in trial])
        ok = bool(valid[t]) and after - before < float(threshold)
        expected.append(ok)
        if ok:
            accepted.append(t)
    assert got == expected
    assert not got[2]
    assert any(got) and not all(ok for ok, v in zip(got, valid.tolist(), strict=True) if v)  # both outcomes


@pytest.mark.parametrize("g", [1, 4])
def test_forming_only_the_accepted_pairs_columns_changes_no_decision(g, monkeypatch):
    """Wide groups take the pruning side's block alone and the accepted pairs' columns after the decision;
    the same search, forced through that path, makes the same exchanges."""
    pb = correlated_problem(96 * g, 24, g, samples=300 * g, seed=5, shift=0.3)
    problem = LayerProblem.validate(pb.H, pb.G, g, 48, pb.dense_weight)
    eager_solver = OsscarSolver(problem, OsscarConfig(step_fraction=1.0))
    eager = eager_solver.search()
    monkeypatch.setattr(OsscarSolver, "EAGER_OUT_ROWS", 0)
    solver = OsscarSolver(problem, OsscarConfig(step_fraction=1.0))
    late = solver.search()
    assert solver.stats["swaps"] == eager_solver.stats["swaps"] >= 5
    assert torch.equal(late.pruned(), eager.pruned())
    assert late.f == pytest.approx(eager.f, rel=1e-12)
    assert late.f == pytest.approx(problem.objective(problem.refit(late.pruned())), rel=1e-9)


def flaky_exchange(monkeypatch, bad_call):
    """SwapState.exchange whose `bad_call`-th call reports a lost pivot (after making the exchange)."""
    exchange = SwapState.exchange
    calls = []

    def flaky(self, *args, **kwargs):
        info = exchange(self, *args, **kwargs)
        calls.append(1)
        return torch.ones_like(info) if len(calls) == bad_call else info

    monkeypatch.setattr(SwapState, "exchange", flaky)
    return calls


def test_an_exchange_that_lost_a_pivot_is_redone_from_the_support_before_it(monkeypatch):
    """A round's exchange is checked at the next round's first synchronisation: a lost pivot there means the
    support before it refactorised one damping rung up, the exchange made again, and the search goes on."""
    pb = correlated_problem(96, 24, 1, samples=300, seed=5, shift=0.3)
    problem = LayerProblem.validate(pb.H, pb.G, 1, 48, pb.dense_weight)
    calls = flaky_exchange(monkeypatch, bad_call=2)
    solver = OsscarSolver(problem, OsscarConfig(step_fraction=1.0))
    state = solver.search()
    assert len(calls) > 3 and solver.stats["swaps"] > 3  # the search went on after the redone exchange
    assert solver.stats["refactorisations"] == 1 and solver.damping > 0
    assert solver._pending is None
    pruned = state.pruned()
    assert pruned.numel() == 48
    assert solver.caller_objective(state) == pytest.approx(problem.objective(problem.refit(pruned)), rel=1e-8)


def test_the_last_exchange_is_settled_before_the_state_is_used(monkeypatch):
    pb = correlated_problem(96, 24, 1, samples=300, seed=5, shift=0.3)
    problem = LayerProblem.validate(pb.H, pb.G, 1, 48, pb.dense_weight)
    solver = OsscarSolver(problem, OsscarConfig(step_fraction=1.0, swap_rounds=1))
    state = solver.greedy(solver.start()).to_swap()
    flaky_exchange(monkeypatch, bad_call=1)
    state, n, _ = solver.swap_round(state, 8)
    assert n > 0 and solver._pending is not None
    before = state.kept.clone()
    state = solver.settle(state)
    assert solver._pending is None and solver.stats["refactorisations"] == 1
    assert torch.equal(state.kept, before)  # the same exchange, made again on the refactorised support
    # and swaps() settles on its own: its single round's exchange is redone the same way
    solver = OsscarSolver(problem, OsscarConfig(step_fraction=1.0, swap_rounds=1))
    flaky_exchange(monkeypatch, bad_call=1)
    state = solver.search()
    assert solver._pending is None and solver.stats["refactorisations"] == 1 and solver.stats["swaps"] > 0
    assert solver.caller_objective(state) == pytest.approx(problem.objective(problem.refit(state.pruned())),
                                                           rel=1e-8)
