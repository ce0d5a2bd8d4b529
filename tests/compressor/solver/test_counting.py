"""The op / synchronisation counter, and the swap rounds' promise: at most 2 host synchronisations
per round, whatever the number of exchanges in it."""

import pytest
import torch

from compressor.solver.counting import OpCounter, _is_sync
from compressor.solver.osscar import OsscarConfig, OsscarSolver
from compressor.solver.problem import LayerProblem
from compressor.solver.synthetic import correlated_problem


def test_counter_sees_every_kind_of_synchronisation():
    x = torch.arange(6.0)
    with OpCounter() as c:
        y = x * 2 + 1
    assert c.syncs == 0 and c.ops == 2
    for sync in (lambda: x[0].item(), lambda: x.tolist(), lambda: bool(x[1] > 0), lambda: float(x.sum()),
                 lambda: torch.nonzero(x), lambda: x[x > 2], lambda: x.numpy()):
        with OpCounter() as c:
            sync()
        assert c.syncs == 1, sync
    assert y.tolist() == [1.0, 3.0, 5.0, 7.0, 9.0, 11.0]  # the wrappers are gone afterwards
    assert torch.Tensor.tolist.__name__ == "tolist"


def test_a_copy_to_the_host_waits_unless_it_is_asynchronous():
    """Told apart on tensors of a device that is not the CPU ("meta" stands in for a GPU here): a blocking copy to
    the host is a synchronisation, a non-blocking `.to("cpu")` is not (it lands in pinned memory), and a non-blocking
    `copy_` is one only when its target is pageable; nothing that stays on one side is."""
    aten = torch.ops.aten
    gpu, host = torch.empty(3, device="meta"), torch.empty(3)
    assert _is_sync(aten._to_copy.default, (gpu,), {"device": torch.device("cpu")})
    assert not _is_sync(aten._to_copy.default, (gpu,), {"device": torch.device("cpu"), "non_blocking": True})
    assert not _is_sync(aten._to_copy.default, (host,), {"device": torch.device("meta")})
    assert not _is_sync(aten._to_copy.default, (gpu,), {"dtype": torch.float64})  # a cast where it is
    assert _is_sync(aten.copy_.default, (host, gpu), {})
    assert _is_sync(aten.copy_.default, (host, gpu, True), {})  # pageable target: the host waits
    assert not _is_sync(aten.copy_.default, (gpu, host, True), {})
    if torch.cuda.is_available():  # pinning needs a GPU runtime
        assert not _is_sync(aten.copy_.default, (host.pin_memory(), gpu, True), {})


@pytest.mark.parametrize("g", [1, 4])
@pytest.mark.parametrize("eager_out_rows", [OsscarSolver.EAGER_OUT_ROWS, 0])  # both ways of forming the block
def test_swap_rounds_synchronise_at_most_twice(g, eager_out_rows, monkeypatch):
    monkeypatch.setattr(OsscarSolver, "EAGER_OUT_ROWS", eager_out_rows)
    pb = correlated_problem(96 * g, 24, g, samples=300 * g, seed=5, shift=0.3)
    problem = LayerProblem.validate(pb.H, pb.G, g, 48, pb.dense_weight)
    solver = OsscarSolver(problem, OsscarConfig(step_fraction=1.0))  # one greedy step: much to swap
    state = solver.greedy(solver.start()).to_swap()
    exchanged, rounds, f = 0, 0, state.f
    while rounds < 40:
        if rounds == 1:
            state.materialise()  # both ways of forming columns
        with OpCounter() as c:
            state, n, _ = solver.swap_round(state, 8)
        assert c.syncs <= 2, (rounds, c.sync_ops)
        if n == 0:
            break
        assert state.f < f
        f = state.f
        exchanged += n
        rounds += 1
    assert rounds >= 3 and exchanged > rounds  # several exchanges per round, each round checked


def test_a_double_exchange_round_synchronises_at_most_twice():
    exchanged = 0
    for seed in range(3):
        pb = correlated_problem(40, 8, 2, samples=120, seed=seed, shift=0.3)
        problem = LayerProblem.validate(pb.H, pb.G, 2, 10, pb.dense_weight)
        solver = OsscarSolver(problem, OsscarConfig(step_fraction=1.0))
        state = solver.greedy(solver.start()).to_swap()
        f = state.f
        with OpCounter() as c:
            state, n = solver.double_swap_round(state)
        assert c.syncs <= 2, c.sync_ops
        assert (n == 2 and state.f < f) or (n == 0 and state.f == f)
        exchanged += n
    assert exchanged  # the exchanging path is among those counted
