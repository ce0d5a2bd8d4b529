"""The shared reconstruction loop (`compressor.refine`): the annealed step size, with the back-off and when a
fit's seconds run out before its steps."""

import itertools
import types
from collections.abc import Callable

import pytest
import torch
from torch import nn

from compressor import refine
from compressor.refine import Reconstruction, RefineConfig, annealed

LR = 0.01


def test_the_annealed_factor_is_a_half_cosine():
    steps = 3000
    factors = [annealed((s - 1) / steps) for s in range(1, steps + 1)]
    assert factors[0] == 1.0 and annealed(0.5) == pytest.approx(0.5) and annealed(1.0) == 0.0
    assert all(a > b for a, b in itertools.pairwise(factors))  # strictly decreasing
    assert 0 < factors[-1] < 1e-5  # the last step still moves
    with pytest.raises(AssertionError):
        annealed(1.5)
    with pytest.raises(AssertionError, match="min_steps"):
        RefineConfig(steps=10, min_steps=5, anneal=True)


class Weight(nn.Module):
    """One weight of RMS 1 and a linear error: a constant gradient makes Adam move the weight by exactly its
    step size (lr x the weight's RMS x the annealed factor), so the moves read off the step sizes used."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))
        self.seen: list[float] = []  # the weight before each fitting step

    def value(self) -> float:
        return float(self.w.detach())


def fit(module: Weight, config: RefineConfig, held_out: list[float] | None = None,
        tick: Callable[[], None] = lambda: None):
    """Fit `module`; the held-out judge reads `held_out` in turn (the error before, then at each check), else
    the fitting error itself. `tick` runs at each fitting step, after the step size is set."""
    judged = iter(held_out or [])

    def loss(m: Weight, _batch: object) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.is_grad_enabled():
            tick()
            m.seen.append(m.value())
            return m.w + 10.0, torch.ones(())  # d(error)/dw = 1 everywhere
        return (torch.tensor(next(judged)) if held_out else m.w.detach() + 10.0), torch.ones(())

    return Reconstruction(module, [module.w], config).fit([None], [None], loss)


def moves(module: Weight) -> list[float]:
    return [a - b for a, b in itertools.pairwise([*module.seen, module.value()])]


@pytest.mark.parametrize("anneal", [False, True])
def test_an_annealed_fit_moves_each_weight_by_the_annealed_step(anneal):
    steps = 8
    module = Weight()
    report = fit(module, RefineConfig(steps=steps, lr=LR, check_every=steps, anneal=anneal))
    assert report.kept and report.steps == steps
    expected = [LR * (annealed((s - 1) / steps) if anneal else 1.0) for s in range(1, steps + 1)]
    assert moves(module) == pytest.approx(expected, rel=1e-3)
    assert module.value() == pytest.approx(1.0 - sum(expected), rel=1e-4)


def test_a_back_off_goes_back_to_the_best_weights_and_anneals_the_smaller_step():
    """Checks at steps 4, 8 and 12: the second is worse, so steps 9-12 start from step 4's weights with half the
    step, still on the fit's cosine."""
    steps = 12
    module = Weight()
    report = fit(module, RefineConfig(steps=steps, lr=LR, check_every=4, backoff=0.5, anneal=True),
                 held_out=[1.0, 0.5, 0.9, 0.3])
    assert report.kept and report.after == pytest.approx(0.3)
    factor = [annealed((s - 1) / steps) for s in range(1, steps + 1)]
    after_4 = 1.0 - LR * sum(factor[:4])
    assert module.seen[8] == pytest.approx(after_4, rel=1e-5)  # step 9 starts from the best (step 4) weights
    assert moves(module)[8:] == pytest.approx([0.5 * LR * f for f in factor[8:]], rel=1e-3)
    assert module.value() == pytest.approx(after_4 - 0.5 * LR * sum(factor[8:]), rel=1e-5)


def test_a_paced_fit_anneals_over_its_seconds_when_they_end_before_its_steps(monkeypatch):
    """A clock that ticks once a fitting step: 4 seconds for 100 steps, so the step size reaches 0 at the 4th
    second; the fit stops at its first check past them (step 6)."""
    clock = [0.0]
    monkeypatch.setattr(refine, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    module = Weight()

    def tick() -> None:
        clock[0] += 1.0

    report = fit(module, RefineConfig(steps=100, lr=LR, check_every=2, anneal=True, seconds=4.0), tick=tick)
    assert report.steps == 6
    expected = [LR * annealed(min(1.0, s / 4)) for s in range(6)]  # step s + 1 starts s seconds in
    assert moves(module) == pytest.approx(expected, rel=1e-3, abs=1e-9)
    assert expected[4] == expected[5] == 0.0


def test_a_fit_paced_by_a_time_budget_stops_at_the_first_step_past_its_share(monkeypatch):
    """`budgeted`: the same fit, its seconds a time budget's share, stops at step 5 (judged there) instead of running
    on to its next check: a decoder's interval of 20 steps of ~12 s ran minutes past a second's share."""
    clock = [0.0]
    monkeypatch.setattr(refine, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    module = Weight()

    def tick() -> None:
        clock[0] += 1.0

    config = RefineConfig(steps=100, lr=LR, check_every=2, anneal=True, seconds=4.0, budgeted=True)
    report = fit(module, config, tick=tick)
    assert report.steps == 5
    assert moves(module) == pytest.approx([LR * annealed(min(1.0, s / 4)) for s in range(5)], rel=1e-3, abs=1e-9)


def test_a_fit_ends_at_the_time_budgets_end_whatever_its_allowance_and_floor(monkeypatch):
    """`deadline`: a round's solves took the time left, so its fits' share (set when the round started) would run
    past the budget; the fit ends at the first step past the deadline (judged there), its floor of 50 steps and its
    next check (every 10) notwithstanding, and one that starts past it does not fit."""
    clock = [0.0]
    monkeypatch.setattr(refine, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def tick() -> None:
        clock[0] += 1.0

    module = Weight()
    report = fit(module, RefineConfig(steps=100, lr=LR, check_every=10, seconds=1.0, min_steps=50, deadline=4.0),
                 tick=tick)
    assert report.steps == 5 and moves(module) == pytest.approx([LR] * 5, rel=1e-3)
    late = Weight()
    clock[0] = 10.0
    report = fit(late, RefineConfig(steps=100, lr=LR, check_every=10, deadline=4.0), tick=tick)
    assert report.steps == 0 and not report.kept and late.value() == 1.0
    # an annealed fit anneals over the time to the deadline when that ends first (it stopped mid-anneal, at a step
    # size its own seconds had left high)
    clock[0] = 0.0
    annealing = Weight()
    report = fit(annealing, RefineConfig(steps=100, lr=LR, check_every=10, seconds=100.0, anneal=True, deadline=4.0),
                 tick=tick)
    assert report.steps == 5
    assert moves(annealing) == pytest.approx([LR * annealed(min(1.0, s / 4)) for s in range(5)], rel=1e-3, abs=1e-9)


def test_an_averaged_fit_judges_and_returns_the_moving_average_of_its_weights():
    """With `average`, every step moves the average by (1 - decay) of the way to the fitted weight; the check
    judges the average (the judge reads the weight it sees), the fit goes on from its own weights, and the
    average is what comes back."""
    steps, decay = 8, 0.75
    module = Weight()
    report = fit(module, RefineConfig(steps=steps, lr=LR, check_every=steps, average=decay))
    assert module.seen == pytest.approx([1.0 - LR * s for s in range(steps)], rel=1e-4)  # the fit's own path
    mean = 1.0
    for s in range(1, steps + 1):
        mean = decay * mean + (1 - decay) * (1.0 - LR * s)
    assert module.value() == pytest.approx(mean, rel=1e-5)
    assert mean > 1.0 - LR * steps  # the average lags the fit: not the last weight
    assert report.kept and report.after == pytest.approx(mean + 10.0, rel=1e-6)
    with pytest.raises(AssertionError, match="average"):
        RefineConfig(steps=10, average=1.0)


def test_the_judge_is_drawn_from_samples_the_solves_never_saw_where_there_are_enough():
    judge, fit = refine.held_out_draw(100, 0.1, 3, unseen_from=60)
    assert len(judge) == 10 and bool((judge >= 60).all())
    assert sorted(torch.cat([judge, fit]).tolist()) == list(range(100))
    # without solves to avoid, or too few unseen samples, the draw is the plain one
    plain = refine.held_out_draw(100, 0.1, 3)
    for unseen_from in (0, 95):
        assert all(torch.equal(a, b) for a, b in zip(refine.held_out_draw(100, 0.1, 3, unseen_from), plain,
                                                     strict=True))


def test_a_conv_fit_judges_on_images_the_solves_did_not_use(monkeypatch):
    from compressor.cnn import pipeline
    from compressor.cnn import refine as cnn_refine
    from tests.compressor.cnn.conv_models import exported

    seen = []
    real = cnn_refine.held_out_draw

    def spy(total, fraction, seed, unseen_from=0):
        seen.append((total, unseen_from))
        return real(total, fraction, seed, unseen_from)

    monkeypatch.setattr(cnn_refine, "held_out_draw", spy)
    gm = exported("folded_pad")
    images = torch.randn(40, 3, 16, 16)
    pipeline.prune_conv_graph(gm, images, 0.5, refine=RefineConfig(steps=2), solve_images=24)
    assert seen == [(40, 24)]
