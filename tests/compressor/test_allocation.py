"""Loss-versus-width curves from the nested greedy path, and width allocation under a cost budget."""

import itertools
import math

import pytest

from compressor import solve_layer
from compressor.allocation import (
    LayerCurve,
    allocate,
    allowed_widths,
    curve_loss,
    depth_option,
    loss_path,
    total_cost,
)
from compressor.solver.synthetic import correlated_problem


def test_allowed_widths_are_hardware_multiples_above_the_minimum():
    assert allowed_widths(172, 8, 18) == [172, 168, 160, 152, 144, 136, 128, 120, 112, 104, 96, 88, 80, 72, 64, 56,
                                          48, 40, 32, 24]
    assert allowed_widths(16, 8, 2) == [16, 8]
    assert allowed_widths(12, 1, 11) == [12, 11]
    assert allowed_widths(4, 8, 1) == [4, 1]  # narrower than the multiple: its floor
    with pytest.raises(ValueError):
        allowed_widths(0, 8, 1)


def test_loss_path_starts_at_zero_rises_and_bounds_the_optimum():
    problem = correlated_problem(24, 6, 2, seed=3)
    H, G = problem.H, problem.G
    widths = [12, 10, 8, 6, 4, 2]
    path = loss_path(H, G, 2, widths)
    assert path[0] == pytest.approx(0.0, abs=1e-9)
    assert all(b >= a - 1e-9 for a, b in itertools.pairwise(path))
    f0 = solve_layer(H, G, 2, 0, "exact").objective
    for width, loss in zip(widths[1:], path[1:], strict=True):
        best = solve_layer(H, G, 2, 12 - width, "exact").objective - f0
        assert best <= loss + 1e-9  # a path of greedy supports: never below the optimum
        assert loss <= 1.5 * best + 1e-9  # and close to it on these problems


def test_allocate_prunes_where_loss_per_saved_cost_is_smallest():
    cheap = LayerCurve("cheap", "ffn_neurons", [8, 6, 4, 2], [0.0, 0.01, 0.02, 0.5], cost=1.0)
    dear = LayerCurve("dear", "ffn_neurons", [8, 6, 4, 2], [0.0, 0.2, 0.4, 0.6], cost=1.0)
    costly = LayerCurve("costly", "attention_heads", [4, 3, 2, 1], [0.0, 0.05, 0.1, 0.9], cost=4.0)
    curves = [cheap, dear, costly]
    assert allocate(curves, 0.0) == {"cheap": 8, "dear": 8, "costly": 4}
    plan = allocate(curves, 8.0)
    assert plan == {"cheap": 4, "dear": 8, "costly": 3}  # 4 + 4 saved: the two cheapest steps by loss/cost
    assert total_cost(curves) - total_cost(curves, plan) >= 8.0
    everything = allocate(curves, 1e9)  # out of reach: every layer at its minimum
    assert everything == {"cheap": 2, "dear": 2, "costly": 1}


def test_a_filled_allocation_lands_between_the_greedy_paths_coarse_steps():
    """A residual stream halves in one step (16 -> 8 channels at a multiple of 8): the greedy takes that step
    first (least loss per saved cost) and saves 80 where 10 were asked; filled, it skips the step while the
    fine layer's steps of 1 can reach 10, and saves exactly 10."""
    stream = LayerCurve("stream", "conv_channels", [16, 8], [0.0, 0.01], cost=10.0)
    fine = LayerCurve("fine", "conv_channels", list(range(16, 0, -1)), [0.1 * k for k in range(16)], cost=1.0)
    curves = [stream, fine]
    assert allocate(curves, 10.0) == {"stream": 8, "fine": 16}
    filled = allocate(curves, 10.0, fill=True)
    assert filled == {"stream": 16, "fine": 6}
    assert total_cost(curves) - total_cost(curves, filled) == 10.0
    # no smaller step can reach the saving: the smallest overshooting step is taken, so it is still reached
    assert allocate([stream], 10.0, fill=True) == {"stream": 8}
    # the fine steps alone fall short of 20 (15): filling would save 95, the greedy's widths save 80
    assert allocate(curves, 20.0, fill=True) == {"stream": 8, "fine": 16}
    assert allocate(curves, 1e9, fill=True) == allocate(curves, 1e9)  # out of reach: every layer at its minimum


def _curves() -> list[LayerCurve]:
    return [LayerCurve("a", "conv_channels", [8, 4, 2], [0.0, 0.1, 0.4], cost=1.0),
            LayerCurve("b", "conv_channels", [8, 4, 2], [0.0, 0.2, 0.3], cost=1.0)]


def test_a_depth_option_adds_the_widths_loss_for_the_speedup_still_missing():
    curves = _curves()  # 16 cost units; the minimum widths remove 75 %
    none = depth_option((), 0.0, 1.0, curves, target=2.0, share=1.0)
    assert none.width_saving == pytest.approx(0.5)  # 1 - 1/2 of the latency, at share 1
    assert none.width_loss == pytest.approx(0.3) and none.loss == pytest.approx(0.3)  # both layers 8 -> 4
    some = depth_option(("blk",), 0.05, 1.6, curves, target=2.0, share=1.0)
    assert some.width_saving == pytest.approx(1 - 1.6 / 2.0)
    assert some.width_loss == pytest.approx(0.1)  # one step suffices: the cheaper layer
    assert some.loss == pytest.approx(0.15) and some.loss < none.loss
    enough = depth_option(("blk", "blk2"), 0.5, 2.1, curves, target=2.0, share=1.0)
    assert enough.width_saving == 0.0 and enough.width_loss == 0.0 and enough.loss == 0.5


def test_a_depth_option_the_minimum_widths_cannot_reach_is_infinitely_lossy():
    option = depth_option((), 0.0, 1.0, _curves(), target=5.0, share=1.0)  # needs 80 % > 75 %
    assert math.isinf(option.loss)
    with pytest.raises(ValueError):
        depth_option((), 0.0, 0.0, _curves(), target=2.0, share=1.0)


def test_curve_loss_sums_the_named_layers_at_their_widths():
    assert curve_loss(_curves(), {"a": 2, "b": 4}) == pytest.approx(0.6)
    assert curve_loss(_curves(), {"a": 4}) == pytest.approx(0.1)  # b stays dense
