"""The shared reconstruction loop (`compressor.refine`): the annealed step size."""

import itertools
import math

import pytest
import torch
from torch import nn

from compressor.refine import Reconstruction, RefineConfig, annealed


def test_the_annealed_factor_is_a_half_cosine_that_never_stops_the_last_step():
    steps = 3000
    factors = [annealed(s, steps) for s in range(1, steps + 1)]
    assert factors[0] == 1.0
    assert factors[steps // 2] == pytest.approx(0.5, abs=1e-3)
    assert all(a > b for a, b in itertools.pairwise(factors))  # strictly decreasing
    assert 0 < factors[-1] < 1e-5
    with pytest.raises(AssertionError):
        annealed(0, steps)


@pytest.mark.parametrize("anneal", [False, True])
def test_an_annealed_fit_moves_each_weight_by_the_annealed_step(anneal):
    """A constant gradient makes Adam move a weight by exactly its step size: the moves read off the
    step sizes the fit used (lr x the weight's RMS, 1 here, x the annealed factor)."""
    module = nn.Module()
    module.w = nn.Parameter(torch.ones(()))
    seen: list[float] = []

    def loss(m: nn.Module, _batch: object) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.is_grad_enabled():
            seen.append(float(m.w.detach()))
        return m.w + 10.0, torch.ones(())  # d(error)/dw = 1 everywhere, and the error always falls

    steps, lr = 8, 0.01
    config = RefineConfig(steps=steps, lr=lr, check_every=steps, anneal=anneal)
    report = Reconstruction(module, [module.w], config).fit([None], [None], loss)
    assert report.kept and report.steps == steps
    final = float(module.w.detach())
    moves = [a - b for a, b in zip(seen, [*seen[1:], final], strict=True)]
    expected = [lr * (annealed(s, steps) if anneal else 1.0) for s in range(1, steps + 1)]
    assert moves == pytest.approx(expected, rel=1e-3)
    assert math.isclose(sum(moves), 1.0 - final, rel_tol=1e-6)
