"""Low-rank updates (Proposition 1 cases 1-3, Lemma A.1) against direct recomputation in float64."""


import pytest
import torch

from compressor.solver import sweep
from compressor.solver.bookkeeping import ColumnCache, MoveStack
from compressor.solver.osscar import OsscarConfig, OsscarSolver, _batched_swap_delta, _joint_sweep_trace
from compressor.solver.problem import LayerProblem, group_rows, host_index
from compressor.solver.sweep import NestedState, SwapState, sweep_dense
from compressor.solver.synthetic import correlated_problem

RTOL = 1e-8


def direct_state(H, G, g, kept):
    """The swept matrix, Z and f of support `kept`, straight from the definitions."""
    rows_kept = kept.repeat_interleave(g)
    K, S = torch.nonzero(rows_kept).squeeze(1), torch.nonzero(~rows_kept).squeeze(1)
    H_KK_inv = torch.linalg.inv(H[K][:, K])
    W_K = H_KK_inv @ G[K]
    A = torch.zeros_like(H)
    A[K.unsqueeze(1), K] = -H_KK_inv
    A_KS = H_KK_inv @ H[K][:, S]
    A[K.unsqueeze(1), S] = A_KS
    A[S.unsqueeze(1), K] = A_KS.T
    A[S.unsqueeze(1), S] = H[S][:, S] - H[S][:, K] @ A_KS
    Z = torch.empty_like(G)
    Z[K], Z[S] = W_K, G[S] - H[S][:, K] @ W_K
    return A, Z, float(-0.5 * (G[K] * W_K).sum())


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


@pytest.fixture(params=[1, 3])
def problem(request):
    g = request.param
    pb = correlated_problem(48, 5, g, samples=200, seed=3)
    return pb.H, pb.G, g


def assert_state_matches(state, H, G, g):
    A, Z, f = direct_state(H, G, g, state.kept)
    cols = state.columns(torch.arange(H.shape[0]))
    assert rel(cols, A) < RTOL
    assert rel(state.Z, Z) < RTOL
    assert abs(state.f - f) <= RTOL * abs(f)
    p = H.shape[0] // g
    blocks = A.view(p, g, p, g).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
    assert rel(state.blocks, blocks) < RTOL
    rows = torch.randperm(H.shape[0], generator=torch.Generator().manual_seed(0))[:17]  # kept and pruned, unsorted
    assert rel(state.block(rows), A[rows.unsqueeze(1), rows]) < RTOL


def test_case1_prune_from_dense_matches_direct(problem):
    H, G, g = problem
    state = NestedState(H, G, g, capacity=16)
    for groups in ([1, 4, 7], [2], [11, 0]):
        state.prune(torch.tensor(groups))
        A, Z, f = direct_state(H, G, g, state.kept)
        K = torch.nonzero(state.kept.repeat_interleave(g)).squeeze(1)
        assert rel(state.W[K], Z[K]) < RTOL
        assert abs(state.f - f) <= RTOL * abs(f)
        inv_now = state.Hinv - state.U[:, : state.n] @ state.U[:, : state.n].T
        assert rel(inv_now[K][:, K], -A[K][:, K]) < RTOL
    assert float(state.W[~state.kept.repeat_interleave(g)].abs().max()) == 0.0


def test_cases_1_2_3_in_swap_state_match_direct(problem):
    H, G, g = problem
    assert_state_matches(NestedState(H, G, g, capacity=16).to_swap(), H, G, g)  # nothing pruned yet
    nested = NestedState(H, G, g, capacity=16)
    nested.prune(torch.tensor([1, 4, 7]))
    nested.prune(torch.tensor([2, 11]))
    state = nested.to_swap()
    assert_state_matches(state, H, G, g)
    state.restore(torch.tensor([4]))  # case 2
    assert_state_matches(state, H, G, g)
    state.prune(torch.tensor([3, 5]))  # case 1 after a restore
    assert_state_matches(state, H, G, g)
    state.swap(torch.tensor([1, 3]), torch.tensor([9]))  # case 3
    assert_state_matches(state, H, G, g)
    state.restore(torch.tensor([9]))  # a group pruned by a move comes back
    assert_state_matches(state, H, G, g)


def test_moves_across_segment_gaps_and_wider_sweeps_match_direct(problem, monkeypatch):
    """Segments of two groups: a sweep that does not fit in what is left of one starts the next (a gap of zero
    slots), and a sweep wider than a segment widens them all; every column, Z and f stay those of the support,
    whatever the stack's unused memory holds."""
    H, G, g = problem
    monkeypatch.setattr(MoveStack, "SEGMENT_ROWS", 2 * g)
    new_empty = torch.Tensor.new_empty  # memory never written must not be read: NaN in every new buffer
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **k: new_empty(self, *a, **k).fill_(torch.nan))
    nested = NestedState(H, G, g, capacity=16)
    nested.prune(torch.tensor([1, 4, 7, 2, 11]))
    state = nested.to_swap()
    for restore, prune in (([4], [3]), ([1], [5, 6]), ([7, 2], [9])):  # the second prune skips to a new segment
        state.swap(torch.tensor(restore), torch.tensor(prune))
        assert_state_matches(state, H, G, g)
    state.restore(torch.tensor([3, 5, 6]))  # 3 groups: segments of 4
    assert_state_matches(state, H, G, g)
    state.prune(torch.tensor([0, 8, 10, 12, 13]))  # 5 groups: segments of 8
    assert_state_matches(state, H, G, g)
    assert state.moves.seg == 8 * g
    assert sorted(state.pruned().tolist()) == [0, 8, 9, 10, 11, 12, 13]


def test_scores_are_the_exact_single_group_changes(problem):
    """Lemma A.1: B_j = f(S + j) - f(S) for kept j, f(S) - f(S - j) for pruned j."""
    H, G, g = problem
    nested = NestedState(H, G, g, capacity=16)
    nested.prune(torch.tensor([0, 5]))
    _, _, f = direct_state(H, G, g, nested.kept)
    costs = nested.scores()
    for j in range(H.shape[0] // g):
        kept = nested.kept.clone()
        if not kept[j]:
            assert costs[j] == float("inf")
            continue
        kept[j] = False
        assert float(costs[j]) == pytest.approx(direct_state(H, G, g, kept)[2] - f, rel=1e-8)
    state = nested.to_swap()
    scores = state.scores()
    for j in (0, 5):
        kept = state.kept.clone()
        kept[j] = True
        assert float(scores[j]) == pytest.approx(f - direct_state(H, G, g, kept)[2], rel=1e-8)


def test_swap_delta_equals_the_applied_change(problem):
    H, G, g = problem
    nested = NestedState(H, G, g, capacity=16)
    nested.prune(torch.tensor([1, 2, 6, 9]))
    state = nested.to_swap()
    restore, prune = torch.tensor([2, 9]), torch.tensor([0, 14])
    predicted = state.swap_delta(restore, prune)
    before = state.f
    state.swap(restore, prune)
    assert predicted == pytest.approx(state.f - before, rel=1e-8, abs=1e-12)


def test_batched_and_pairwise_deltas_match_the_dense_sweep(problem):
    H, G, g = problem
    pb = LayerProblem.validate(H, G, g, 4)
    solver = OsscarSolver(pb, OsscarConfig())
    nested = solver.greedy(solver.start())
    state = nested.to_swap()
    pruned = torch.nonzero(~state.kept).squeeze(1)
    kept = torch.nonzero(state.kept).squeeze(1)
    scores = state.scores()
    pair = solver._pair_deltas(state, pruned, scores[pruned])
    assert bool(torch.isinf(pair[:, pruned]).all())  # only kept groups can be pruned
    for a, i in enumerate(pruned.tolist()):
        for j in kept.tolist()[:5]:
            expected = state.swap_delta(torch.tensor([i]), torch.tensor([j]))
            assert float(pair[a, j]) == pytest.approx(expected, rel=1e-8, abs=1e-10)
    # 2-for-2 exchanges: batched Gram-based evaluation against the explicit dense sweep
    I, J = pruned[:2], kept[:2]
    rows = torch.cat([group_rows(I, g), group_rows(J, g)])
    sub_A = state.columns(rows)[rows]
    sub_Z = state.Z[rows]
    batched = _batched_swap_delta(sub_A.unsqueeze(0), (sub_Z @ sub_Z.T).unsqueeze(0), 2 * g)
    A_copy, Z_copy = sub_A.clone(), sub_Z.clone()
    local = torch.arange(rows.numel())
    dense = sweep_dense(A_copy, Z_copy, local[: 2 * g], True) + sweep_dense(A_copy, Z_copy, local[2 * g:], False)
    assert float(batched[0]) == pytest.approx(dense, rel=1e-8, abs=1e-10)
    # the same exchange as one joint sweep of all its rows
    trace, info = _joint_sweep_trace(sub_A, sub_Z @ sub_Z.T)
    assert int(info) == 0
    assert -0.5 * float(trace) == pytest.approx(dense, rel=1e-8, abs=1e-10)


def test_group_rows_expands_groups_in_their_order():
    assert group_rows(torch.tensor([2, 0]), 3).tolist() == [6, 7, 8, 0, 1, 2]
    assert group_rows([1], 1).tolist() == [1]
    assert group_rows(torch.empty(0, dtype=torch.long), 4).numel() == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_host_index_gives_the_values_on_the_device(device):
    index = host_index([[3, 1], [0, 2]], device)
    assert index.dtype == torch.long and index.device.type == device
    assert index.tolist() == [[3, 1], [0, 2]]


def test_materialised_state_and_exchanges_match_direct(problem):
    """A0 formed explicitly gives the same columns as the greedy's factors, before and after moves."""
    H, G, g = problem
    nested = NestedState(H, G, g, capacity=16)
    nested.prune(torch.tensor([1, 4, 7, 2, 11]))
    factored = nested.to_swap()
    factored.restore(torch.tensor([4]))
    rows = torch.arange(H.shape[0])
    before = factored.columns(rows)
    factored.materialise()
    assert rel(factored.columns(rows), before) < RTOL
    assert_state_matches(factored, H, G, g)
    info = factored.exchange(torch.tensor([1, 7]), torch.tensor([0, 9]))  # no host synchronisation
    assert int(info) == 0
    assert_state_matches(factored, H, G, g)


def test_materialised_by_slabs_of_rows_matches_direct(problem, monkeypatch):
    """A0_KK formed a few rows at a time (slabs that do not divide the kept rows) is the same matrix."""
    H, G, g = problem
    monkeypatch.setattr(sweep, "SLAB_ROWS", 7)
    nested = NestedState(H, G, g, capacity=16)
    nested.prune(torch.tensor([1, 4, 7, 2, 11]))
    state = nested.to_swap()
    state.materialise()
    assert_state_matches(state, H, G, g)


def test_a_released_state_keeps_its_support_weight_and_f_but_no_columns(problem):
    """`release` drops A0 and H^-1 (the MP guard's searched state while another search runs): what is
    compared and returned stays, and asking it for columns fails loudly instead of reading stale memory."""
    H, G, g = problem
    nested = NestedState(H, G, g, capacity=16)
    nested.prune(torch.tensor([1, 4, 7]))
    state = nested.to_swap()
    state.swap(torch.tensor([4]), torch.tensor([9]))
    state.materialise()
    pruned, weight, f = state.pruned(), state.weight(), state.f
    state.release()
    assert state._A0 is None and state._Hinv is None
    assert torch.equal(state.pruned(), pruned) and torch.equal(state.weight(), weight) and state.f == f
    with pytest.raises(AssertionError, match="released"):
        state.columns(torch.arange(3))
    with pytest.raises(AssertionError, match="released"):
        state.block(torch.arange(3))


def test_columns_of_rows_known_on_the_host_match_the_direct_state(problem, monkeypatch):
    """Rows known on the host: A0's columns reused across calls (a small cache here, so that rows are dropped
    and formed again) and formed by kind; the same columns as the definitions, before and after moves."""
    H, G, g = problem
    monkeypatch.setattr(ColumnCache, "MAX_ROWS", 4 * g)
    monkeypatch.setattr(SwapState, "MATERIALISE_COST_PER_D1", 100.0)  # stay on the greedy's factors
    nested = NestedState(H, G, g, capacity=16)
    nested.prune(torch.tensor([1, 4, 7]))
    nested.prune(torch.tensor([2, 11]))
    state = nested.to_swap()

    def check(groups):
        A = direct_state(H, G, g, state.kept)[0]
        rows = group_rows(torch.tensor(groups), g)
        assert rel(state.columns(rows, known=rows.tolist()), A[:, rows]) < RTOL, groups

    # pruned, then kept and mixed (unsorted, repeated), more than the cache holds, and a row dropped and back
    for groups in ([1, 4], [4, 0, 1], [3, 11, 3, 5], [0, 1, 2, 3, 4, 5], [2, 1, 4]):
        check(groups)
    formed = state._factored_rows
    check([4, 1])  # both kept from the call before: nothing formed
    assert state._factored_rows == formed
    assert state.cache.capacity <= 4 * g
    state.swap(torch.tensor([4]), torch.tensor([9]))
    for groups in ([4, 9], [1, 9, 0]):
        check(groups)
    state.materialise()
    check([4, 9, 2])


def test_pair_deltas_need_no_columns_beyond_the_kept_groups(problem):
    """The batched pair deltas of wide groups restricted to the kept groups give every kept j's delta."""
    H, G, g = problem
    pb = LayerProblem.validate(H, G, g, 6)
    solver = OsscarSolver(pb, OsscarConfig())
    state = solver.greedy(solver.start()).to_swap()
    state.swap(torch.nonzero(~state.kept).squeeze(1)[:1], torch.nonzero(state.kept).squeeze(1)[:1])
    pruned = torch.nonzero(~state.kept).squeeze(1)
    pair = solver._pair_deltas(state, pruned, state.scores()[pruned])
    for a, i in enumerate(pruned.tolist()):
        for j in torch.nonzero(state.kept).squeeze(1).tolist():
            expected = state.swap_delta(torch.tensor([i]), torch.tensor([j]))
            assert float(pair[a, j]) == pytest.approx(expected, rel=1e-8, abs=1e-10)
