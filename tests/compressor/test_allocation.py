"""Loss-versus-width curves from the nested greedy path, and width allocation under a cost budget."""

import itertools

import pytest

from compressor import solve_layer
from compressor.allocation import LayerCurve, allocate, allowed_widths, loss_path, total_cost
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
