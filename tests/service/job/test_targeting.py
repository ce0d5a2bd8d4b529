"""Target mode, unit by unit: the closed loop corrects its latency model, latency probes, the choice of the
returned round under the accuracy budget, depth planning and the curves cache key. No model is compressed
here: the end-to-end `osscar compress` runs are in test_targeting_e2e.py, the budget rules themselves in
test_budgets.py."""

import math
from dataclasses import replace

import pytest

from compressor.allocation import LayerCurve, total_cost
from compressor.progress import WARNING, Progress
from exporters.runtime import Latency
from service.job import CompressRequest
from service.job.budgets import Metric
from service.job.targeting import (
    Round,
    at_minimum_widths,
    choose,
    kept_curves,
    merged_units,
    next_saving,
    plan_depth,
    target_loop,
)


def curves():
    out = []
    for i in range(6):  # convex losses, different per layer
        widths = list(range(64, 0, -8))
        out.append(LayerCurve(f"layer{i}", "ffn_neurons", widths, [(i + 1) * (1 - w / 64) ** 2 for w in widths],
                              cost=1.0 + i % 3))
    return out


def fake_rounds(share: float):
    """run_round of a model whose true prunable share of the latency is `share`."""
    layer_curves = curves()
    full = total_cost(layer_curves)

    def run_round(plan, index, predicted=None):
        saved = 1 - total_cost(layer_curves, plan) / full
        compressed = 100.0 * (1 - share * saved)
        latency = Latency(100.0, compressed, 101.0, compressed + 1, 100.0 / compressed, "cpu", 2, "test", 5)
        quality = 1.0 - sum(c.loss[c.widths.index(plan[c.name])] for c in layer_curves) / 100
        return Round(plan, None, [], None, None, latency, quality, predicted)

    return layer_curves, run_round


@pytest.mark.parametrize("share,target", [(0.6, 1.5), (0.95, 1.25), (0.4, 1.3)])
def test_the_loop_corrects_its_latency_model_and_meets_the_target(share, target):
    layer_curves, run_round = fake_rounds(share)
    # about the latency model: the fake metric's values mean nothing to a budget
    request = CompressRequest(model="m", calibration="c", out_dir="o", target_speedup=target, no_accuracy_budget=True)
    rounds = target_loop(request, layer_curves, run_round, Metric("cosine", True), 1.0, lambda m: None)
    assert len(rounds) <= request.max_rounds
    chosen, status = choose(request, rounds, Metric("cosine", True), 1.0)
    assert status == "ok"
    assert 0.98 * target <= chosen.latency.speedup <= 1.10 * target


@pytest.mark.parametrize("target", [1.25, 1.5, 2.0])
def test_a_curved_latency_is_met_within_three_rounds(target):
    # latency removed = 0.9 sqrt(saved cost): narrow layers save less per FLOP than the first cuts. A line
    # through the origin (the share model alone) approaches it one halving at a time (4+ rounds, the
    # last still outside the window); a power law through two measured rounds is exact for it
    layer_curves = curves()
    full = total_cost(layer_curves)

    def run_round(plan, index, predicted=None):
        saved = 1 - total_cost(layer_curves, plan) / full
        compressed = 100.0 * (1 - 0.9 * math.sqrt(saved))
        latency = Latency(100.0, compressed, 101.0, compressed + 1, 100.0 / compressed, "cpu", 2, "test", 5)
        return Round(plan, None, [], None, None, latency, 1.0, predicted)

    request = CompressRequest(model="m", calibration="c", out_dir="o", target_speedup=target, no_accuracy_budget=True)
    rounds = target_loop(request, layer_curves, run_round, Metric("cosine", True), 1.0, lambda m: None)
    assert len(rounds) <= 3 and 0.98 * target <= rounds[-1].latency.speedup <= 1.10 * target


def stepped_latency(steps):
    """(run_round, probe) of a model whose speedup moves in coarse steps with the saving (as ResNet-20's
    16-channel stages, which can only keep 16 or 8: ~1.14, 1.35, 1.63, 2.0x): `steps` is [(saving from
    which, speedup)], sorted."""
    layer_curves = curves()
    return (layer_curves, *timed(layer_curves, lambda saved: max([1.0] + [s for start, s in steps if saved >= start])))


def timed(layer_curves, speedup_of):
    """(run_round, probe, probed plans) of a model whose speedup is `speedup_of(saving)`."""
    full = total_cost(layer_curves)

    def latency(plan) -> Latency:
        speedup = speedup_of(1 - total_cost(layer_curves, plan) / full)
        return Latency(100.0, 100.0 / speedup, 101.0, 100.0 / speedup + 1, speedup, "cpu", 2, "test", 5)

    probes: list = []

    def probe(plan, index):
        probes.append(plan)
        return latency(plan)

    def run_round(plan, index, predicted=None):
        return Round(plan, None, [], None, None, latency(plan), 1.0, predicted)

    return run_round, probe, probes


RESNET_STEPS = [(0.05, 1.141), (0.3, 1.35), (0.55, 1.63), (0.8, 2.006)]


@pytest.mark.parametrize("target", [1.25, 1.5, 2.0])
def test_latency_probes_find_coarse_widths_before_the_solve(target):
    """Without probes a coarse latency staircase costs rounds (each a solve and an evaluation); the probes
    (structure only) find widths inside the window first, so one round meets the target."""
    layer_curves, run_round, probe, probes = stepped_latency(RESNET_STEPS)
    request = CompressRequest(model="m", calibration="c", out_dir="o", target_speedup=target, no_accuracy_budget=True)
    messages: list[str] = []
    rounds = target_loop(request, layer_curves, run_round, Metric("cosine", True), 1.0, messages.append,
                         probe=probe)
    assert len(rounds) == 1 and 0.98 * target <= rounds[0].latency.speedup <= 1.10 * target
    assert 1 <= len(probes) <= request.latency_probes and len(rounds[0].probes) == len(probes)
    assert rounds[0].plan in probes  # the solve ran at widths a probe measured
    assert sum("latency probe" in m for m in messages) == len(probes)
    # probes off: the same loop, more rounds on this staircase
    off = CompressRequest(model="m", calibration="c", out_dir="o", target_speedup=target, no_accuracy_budget=True,
                          latency_probes=0)
    probes.clear()
    assert len(target_loop(off, layer_curves, run_round, Metric("cosine", True), 1.0, lambda m: None,
                           probe=probe)) == 2 and not probes


def test_probes_without_a_width_in_the_window_run_the_least_pruning_that_met_the_target():
    """No allocation lands in [0.98, 1.10] x 1.25 (the staircase jumps from 1.141 to 1.63): the round
    runs at the probed widths that measured 1.63, the least pruning known to meet the target, and the
    loop stops instead of repeating widths already measured."""
    layer_curves, run_round, probe, probes = stepped_latency([(0.05, 1.141), (0.4, 1.63)])
    request = CompressRequest(model="m", calibration="c", out_dir="o", target_speedup=1.25, no_accuracy_budget=True)
    messages: list[str] = []
    rounds = target_loop(request, layer_curves, run_round, Metric("cosine", True), 1.0, messages.append,
                         probe=probe)
    assert rounds[0].latency.speedup == pytest.approx(1.63) and rounds[0].plan in probes
    assert len(rounds) <= 2 and len(probes) <= 2 * request.latency_probes
    assert choose(request, rounds, Metric("cosine", True), 1.0)[1] == "ok"


def test_a_probe_just_below_the_target_does_not_end_the_search():
    """The first probe measures 1.97x at 2x: inside [0.98, 1.10] x target, but a round at its widths reads
    below 1.96 as often as above (ResNet-56: a probe's 1.981x, its round's 1.943x). The search goes on while
    probes remain, and the round runs at the probe at or above the target, although 1.97x is closer to the aim
    (2.06x) than 2.18x."""
    layer_curves, run_round, probe, probes = stepped_latency([(0.05, 1.141), (0.55, 1.97), (0.62, 2.18)])
    request = CompressRequest(model="m", calibration="c", out_dir="o", target_speedup=2.0, no_accuracy_budget=True)
    rounds = target_loop(request, layer_curves, run_round, Metric("cosine", True), 1.0, lambda m: None,
                         probe=probe)
    assert len(probes) >= 2 and run_round(probes[0], 0).latency.speedup == pytest.approx(1.97)
    assert len(rounds) == 1 and rounds[0].latency.speedup == pytest.approx(2.18)


def test_a_probe_fills_the_saving_when_the_greedy_path_jumps_past_the_window():
    """One coarse step (a 64-channel stream halved at once: 40 % -> 50 % of the prunable cost) carries every
    greedy allocation past [0.98, 1.10] x 1.8 (1.67x, then 2.0x). When the curve asks again for widths already
    measured, the probe takes the filled allocation (the stream kept, finer layers narrowed): 1.90x, inside
    the window, where the round used to run at the 2.0x widths (ResNet-56 at 2x: 1.948x and 2.223x probed,
    the round at 2.208x)."""
    fine = [LayerCurve(f"f{i}", "conv_channels", list(range(64, 0, -8)),
                       [(i + 1) * (1 - w / 64) ** 2 for w in range(64, 0, -8)], 1.0) for i in range(4)]
    layer_curves = [LayerCurve("stream", "conv_channels", [64, 32], [0.0, 1.0], 1.0), *fine]
    run_round, probe, probes = timed(layer_curves, lambda saved: 1 / (1 - saved))  # all the latency is prunable
    request = CompressRequest(model="m", calibration="c", out_dir="o", target_speedup=1.8, no_accuracy_budget=True)
    rounds = target_loop(request, layer_curves, run_round, Metric("cosine", True), 1.0, lambda m: None,
                         probe=probe)
    assert len(rounds) == 1 and rounds[0].plan in probes
    speedups = [run_round(p, 0).latency.speedup for p in probes]
    assert all(s > 1.98 for s in speedups[:-1])  # the greedy's widths: past the window
    assert rounds[0].plan["stream"] == 64 and 0.98 * 1.8 <= rounds[0].latency.speedup <= 1.10 * 1.8


def test_a_round_measured_slower_than_its_probe_prunes_further():
    """A probe measures widths at 2.07x (inside the window at 2x), the round at the same widths 1.90x (timing
    noise): one latency measured twice. The loop takes their mean as the point there and asks for more
    pruning, instead of reading a probe above the aim and a round below it at one saving as a bracket
    pointing back at the same widths (and stopping, not met)."""
    staircase = [(0.05, 1.141), (0.3, 1.35), (0.55, 1.63), (0.7, 1.90), (0.76, 2.0)]
    layer_curves, run_round, probe, probes = stepped_latency(staircase)

    def optimistic_probe(plan, index):  # every probe reads 9 % faster than the round at its widths
        latency = probe(plan, index)
        return replace(latency, compressed_ms=latency.compressed_ms / 1.09, speedup=latency.speedup * 1.09)

    request = CompressRequest(model="m", calibration="c", out_dir="o", target_speedup=2.0, no_accuracy_budget=True)
    messages: list[str] = []
    retimed = []

    def retime(done, index):  # the round's own export again: it agrees with the round, not with the probe
        retimed.append(done.plan)
        return run_round(done.plan, index).latency

    rounds = target_loop(request, layer_curves, run_round, Metric("cosine", True), 1.0, messages.append,
                         probe=optimistic_probe, retime=retime)
    assert rounds[0].plan in probes and rounds[0].latency.speedup == pytest.approx(1.90)  # the probed 2.071x
    # the second look: a probe that reads every graph fast is outvoted by two timings of the round's export
    assert retimed[0] == rounds[0].plan and rounds[0].timings == pytest.approx([2.071, 1.90, 1.90])
    assert len(rounds) == 2 and rounds[1].latency.speedup == pytest.approx(2.0)
    assert not any("already measured" in m for m in messages)
    assert choose(request, rounds, Metric("cosine", True), 1.0)[1] == "ok"


def noisy_rounds(round_speedups):
    """(curves, run_round, probe, retime, timed plans) of a model whose probes measure what the latency model
    says (speedup 1 / (1 - saving)) and whose rounds' timings are `round_speedups`, in order (each retiming takes
    the next)."""
    layer_curves = curves()
    run_round, probe, _ = timed(layer_curves, lambda saved: 1 / (1 - 0.9 * saved))
    speedups = iter(round_speedups)

    def latency(speedup):
        return Latency(100.0, 100.0 / speedup, 101.0, 100.0 / speedup + 1, speedup, "cpu", 2, "test", 5)

    def noisy_round(plan, index, predicted=None):
        return replace(run_round(plan, index, predicted), latency=latency(next(speedups)))

    retimed = []

    def retime(done, index):
        retimed.append(done.plan)
        return latency(next(speedups))

    return layer_curves, noisy_round, probe, retime, retimed


@pytest.mark.parametrize("timings,met,rounds_run", [
    ((2.45, 2.08), True, 1),  # a fast spell of the host while the round was timed: the median (the probe's) is met
    ((2.45, 2.40, 2.06), False, 2),  # the round's export is faster than its probe: timed twice, a round more
])
def test_a_round_that_disagrees_with_its_probe_on_the_window_is_timed_again(timings, met, rounds_run):
    """A probe measures the round's widths inside [0.98, 1.10] x 2, the round's own timing 2.45x (session 38's
    MiniLM round 0: a round more, ~300 s). Its export is timed once more and the round's latency is the median of
    the three: met when the extra timing agrees with the probe, another round when it agrees with the round."""
    layer_curves, run_round, probe, retime, retimed = noisy_rounds(timings)
    request = CompressRequest(model="m", calibration="c", out_dir="o", target_speedup=2.0, no_accuracy_budget=True)
    messages: list[str] = []
    rounds = target_loop(request, layer_curves, run_round, Metric("cosine", True), 1.0, messages.append,
                         probe=probe, retime=retime)
    probed = [p.latency.speedup for p in rounds[0].probes]
    assert any(2.0 <= s <= 2.14 for s in probed)  # the search stopped at a probe inside [SURE] x target
    assert retimed[0] == rounds[0].plan and len(rounds[0].timings) == 3
    assert rounds[0].timings[1:] == pytest.approx(list(timings[:2]))
    assert rounds[0].latency.speedup == sorted(rounds[0].timings)[1] and len(rounds) == rounds_run
    assert (1.96 <= rounds[0].latency.speedup <= 2.2) == met
    assert sum("timed again" in m for m in messages) == len(retimed)


def test_a_round_at_a_depth_trials_widths_is_timed_again_against_the_trials_timing():
    """The first round after a depth trial runs at the trial's widths without probes: the trial's timing of those
    widths is the one its own timing is checked against."""
    layer_curves, run_round, probe, retime, retimed = noisy_rounds([2.45, 2.06])
    first = {c.name: c.widths[len(c.widths) // 2] for c in layer_curves}
    trial = Latency(100.0, 48.5, 101.0, 49.5, 2.062, "cpu", 2, "test", 5)
    request = CompressRequest(model="m", calibration="c", out_dir="o", target_speedup=2.0, no_accuracy_budget=True)
    rounds = target_loop(request, layer_curves, run_round, Metric("cosine", True), 1.0, lambda m: None,
                         probe=probe, retime=retime, first=first, first_latency=trial)
    assert retimed == [first] and rounds[0].timings == pytest.approx([2.062, 2.45, 2.06])
    assert len(rounds) == 1 and rounds[0].latency.speedup == pytest.approx(2.062)  # the median: the trial's


def test_a_round_inside_the_window_is_timed_once():
    layer_curves, run_round, probe, retime, retimed = noisy_rounds([2.05])
    request = CompressRequest(model="m", calibration="c", out_dir="o", target_speedup=2.0, no_accuracy_budget=True)
    rounds = target_loop(request, layer_curves, run_round, Metric("cosine", True), 1.0, lambda m: None,
                         probe=probe, retime=retime)
    assert len(rounds) == 1 and not retimed and rounds[0].timings == []


@pytest.mark.parametrize("measured,aim,share,expected", [
    ([], 0.3, 0.6, 0.5),  # nothing measured: the share model
    ([(0.4, 0.2)], 0.3, 0.5, 0.6),  # one side only: the corrected share
    ([(0.4, 0.2), (0.8, 0.4)], 0.3, 0.5, 0.6),  # both sides of a line: on it
    ([(0.25, 0.25), (1.0, 0.5)], 0.4, 0.5, 0.64),  # y = 0.5 sqrt(s): a power law through them is exact
    ([(0.16, 0.2), (0.36, 0.3)], 0.4, 0.5, 0.64),  # the same curve, extrapolated from one side
    ([(0.8, 0.2), (0.4, 0.4)], 0.3, 0.5, 0.6),  # an inconsistent bracket (noise): half way
])
def test_next_saving(measured, aim, share, expected):
    assert next_saving(measured, aim, share) == pytest.approx(expected)


def test_an_unreachable_target_returns_the_fastest_round_as_not_met():
    layer_curves, run_round = fake_rounds(0.3)  # even the minimum widths give < 1.4x
    # the fake metric means nothing to a budget (nor to the sanity floor)
    request = CompressRequest(model="m", calibration="c", out_dir="o", target_speedup=3.0, no_accuracy_budget=True)
    messages: list[str] = []
    rounds = target_loop(request, layer_curves, run_round, Metric("cosine", True), 1.0, messages.append)
    chosen, status = choose(request, rounds, Metric("cosine", True), 1.0)
    assert status == "target_not_met"
    assert chosen.latency.speedup == max(r.latency.speedup for r in rounds)
    # the allocation ended with every layer at its narrowest width: said so
    assert any(isinstance(m, Progress) and m.stage == WARNING and "every layer is at its minimum width" in m.message
               for m in messages)


def test_the_minimum_width_warning_is_only_for_all_layers_at_the_floor():
    curves = [LayerCurve("a", "conv_channels", [16, 8], [0.0, 1.0], 1.0),
              LayerCurve("b", "conv_channels", [32, 24, 16, 8, 4], [0.0, 0.1, 0.2, 0.5, 1.0], 1.0),
              LayerCurve("c", "conv_channels", [3], [0.0], 1.0)]  # cannot narrow: does not count
    assert at_minimum_widths(curves, {"a": 8, "b": 4, "c": 3})
    assert not at_minimum_widths(curves, {"a": 8, "b": 8, "c": 3})
    assert not at_minimum_widths(curves, 0.5)


def test_a_round_below_the_sanity_floor_is_never_returned_while_another_is_above_it():
    """Target mode: the fast round whose top-1 collapsed (below the default rule, 10 points under dense)
    is not the artifact; the best round above the floor is, as target_not_met."""
    top1 = Metric("top1", True)
    request = CompressRequest(model="m", calibration="c", out_dir="o", target_speedup=1.5)
    broken, fine = _measured(0.45, speedup=1.49), _measured(0.86, speedup=1.30)
    assert choose(request, [broken, fine], top1, 0.92) == (fine, "target_not_met")
    assert choose(request, [broken, fine, _measured(0.84, speedup=1.48)], top1, 0.92)[1] == "ok"
    # every round below the floor: the best-quality one, accuracy_budget_exceeded
    low = _measured(0.5, speedup=1.2)
    assert choose(request, [broken, low], top1, 0.92) == (low, "accuracy_budget_exceeded")
    # --accuracy-budget none: no floor
    unbounded = CompressRequest(model="m", calibration="c", out_dir="o", target_speedup=1.5, no_accuracy_budget=True)
    assert choose(unbounded, [broken, fine], top1, 0.92) == (broken, "ok")


@pytest.mark.parametrize("speedup, status", [(0.72, "slower_than_dense"), (0.979, "slower_than_dense"),
                                             (0.98, "ok"), (1.3, "ok")])
def test_a_model_measured_slower_than_dense_is_never_ok(speedup, status):
    assert choose(_request(), [_measured(0.99, speedup)], Metric("cosine", True), 1.0)[1] == status
    # a budget failure stays what it is
    assert choose(_request(), [_measured(0.5, 0.7)], Metric("cosine", True), 1.0)[1] == "accuracy_budget_exceeded"


def test_accuracy_budget_and_back_off():
    layer_curves, run_round = fake_rounds(0.8)
    strict = CompressRequest(model="m", calibration="c", out_dir="o", target_speedup=2.0, accuracy_budget=0.001)
    rounds = target_loop(strict, layer_curves, run_round, Metric("cosine", True), 1.0, lambda m: None)
    assert choose(strict, rounds, Metric("cosine", True), 1.0)[1] == "accuracy_budget_exceeded"
    backing = CompressRequest(model="m", calibration="c", out_dir="o", target_speedup=2.0, accuracy_budget=0.01,
                              back_off=True, max_rounds=6)
    rounds = target_loop(backing, layer_curves, run_round, Metric("cosine", True), 1.0, lambda m: None)
    chosen, status = choose(backing, rounds, Metric("cosine", True), 1.0)
    assert 1.0 - chosen.metric <= 0.01  # within the budget
    assert chosen.latency.speedup == max(r.latency.speedup for r in rounds if 1.0 - r.metric <= 0.01)
    assert status in ("ok", "target_not_met")


def _request(**fields) -> CompressRequest:
    return CompressRequest(model="m", calibration="c", out_dir="o", uniform_ratio=0.5, **fields)


def _measured(metric: float, speedup: float = 1.5) -> Round:
    latency = Latency(100.0, 100.0 / speedup, 101.0, 100.0 / speedup, speedup, "cpu", 2, "test", 5)
    return Round(0.5, None, [], None, None, latency, metric)


def test_a_broken_model_is_not_ok_by_default():
    perplexity = Metric("perplexity", False)
    broken = [_measured(1800.37)]
    assert choose(_request(), broken, perplexity, 51.68)[1] == "accuracy_budget_exceeded"
    assert choose(_request(no_accuracy_budget=True), broken, perplexity, 51.68)[1] == "ok"
    assert choose(_request(), [_measured(90.0)], perplexity, 51.68)[1] == "ok"


def test_a_round_within_the_budget_after_a_back_off_ends_the_loop():
    """Backed off from 3x to 2.3x, a round within the budget that measures at least what the lowered target asks
    (2.57x: 5 % over the model of its widths, timing noise) is the last: the loop does not plan another, slower
    round at the lowered target (it did, solving a third round only to return the second)."""
    layer_curves, run_round = fake_rounds(0.8)
    noise = iter([1.0, 1.05, 0.97, 1.02])

    def noisy(plan, index, predicted=None):
        done = run_round(plan, index, predicted)
        done.latency = replace(done.latency, speedup=done.latency.speedup * next(noise))
        return done

    request = CompressRequest(model="m", calibration="c", out_dir="o", target_speedup=3.0, back_off=True,
                              max_rounds=4)
    messages: list[str] = []
    rounds = target_loop(request, layer_curves, noisy, Metric("cosine", True), 1.0, messages.append)
    assert [r.metric >= 0.9 for r in rounds] == [False, True] and rounds[1].latency.speedup > 2.3
    assert "backing off to 2.300x" in messages[1]
    assert choose(request, rounds, Metric("cosine", True), 1.0)[0] is rounds[1]


def test_no_back_off_below_what_the_removed_blocks_alone_measure():
    """Removed blocks alone measure 2.0x; every round misses the budget; once the lowered target asks for less
    than the blocks give, no widths can back off further and the loop stops (it planned near-dense widths)."""
    layer_curves, _ = fake_rounds(0.8)

    def blown(plan, index, predicted=None):
        latency = Latency(100.0, 100 / 2.4, 101.0, 101 / 2.4, 2.4, "cpu", 2, "test", 5)
        return Round(plan, None, [], None, None, latency, 0.5, predicted)

    request = CompressRequest(model="m", calibration="c", out_dir="o", target_speedup=2.5, back_off=True,
                              max_rounds=6, latency_probes=0)
    messages: list[str] = []
    rounds = target_loop(request, layer_curves, blown, Metric("cosine", True), 1.0, messages.append,
                         base_speedup=2.0)
    assert len(rounds) == 2 and "cannot back off further" in messages[-1]


def test_blocks_that_alone_reach_the_aim_leave_every_width_dense():
    """The aim was floored at 1e-6: depth alone at the aim still narrowed one layer one step in round 0."""
    layer_curves, _ = fake_rounds(0.8)
    plans = []

    def depth_only(plan, index, predicted=None):
        plans.append(plan)
        latency = Latency(100.0, 100 / 2.05, 101.0, 101 / 2.05, 2.05, "cpu", 2, "test", 5)
        return Round(plan, None, [], None, None, latency, 0.95, predicted)

    request = CompressRequest(model="m", calibration="c", out_dir="o", target_speedup=2.0, max_rounds=2,
                              latency_probes=0)
    target_loop(request, layer_curves, depth_only, Metric("cosine", True), 1.0, lambda _: None, base_speedup=2.1)
    assert plans and plans[0] == {c.name: c.widths[0] for c in layer_curves}


def test_back_off_works_against_the_default_budget():
    """The loop backs off while a round is below the default cosine floor (0.9) and returns the fastest
    round above it."""
    layer_curves, run_round = fake_rounds(0.8)
    request = CompressRequest(model="m", calibration="c", out_dir="o", target_speedup=3.0, back_off=True,
                              max_rounds=6)
    messages: list[str] = []
    rounds = target_loop(request, layer_curves, run_round, Metric("cosine", True), 1.0, messages.append)
    assert rounds[0].metric < 0.9 and any("accuracy budget exceeded; backing off" in m for m in messages)
    chosen, status = choose(request, rounds, Metric("cosine", True), 1.0)
    assert chosen.metric >= 0.9 and status == "target_not_met"
    assert chosen.latency.speedup == max(r.latency.speedup for r in rounds if r.metric >= 0.9)


def test_every_field_that_changes_the_statistics_changes_the_curves_key(tmp_path):
    """The curves cache is keyed by the fields declared `statistics=True` in request.py: curves taken from
    float16 activations are not reused for float32 (the stale-cache bug of a hand-written key), nor curves
    calibrated on what an --eval file leaves in; a field that does not change the statistics shares them."""
    import dataclasses
    from types import SimpleNamespace

    from service.job.request import statistics_fields
    from service.job.targeting import curves_cache_key

    (tmp_path / "eval.npz").write_bytes(b"e")
    job = SimpleNamespace(causal=False, shape={"batch": 8})
    base = _request()
    key = curves_cache_key(job, base, "1")
    changed = {"activation_dtype": "float16", "eval": tmp_path / "eval.npz", "samples": 100, "seed": 1,
               "mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5), "sequences": 64, "sequence_length": 64,
               "min_sequence_length": 32, "shape": {"batch": 2}, "round_to": 16, "min_width": 0.2,
               "gqa": "kv-groups", "remove_blocks": 2, "normalise": "layer", "model": "m2", "calibration": "c2",
               "method": "mp", "add_bias": "yes"}  # the last two: mp's curves were reused for osscar, and back
    assert set(statistics_fields()) == set(changed)
    for name, value in changed.items():
        assert curves_cache_key(job, dataclasses.replace(base, **{name: value}), "1") != key, name
    assert curves_cache_key(job, _request(repeats=5, threads=1, max_rounds=2), "1") == key


def test_the_curves_key_tells_apart_large_files_delivered_with_one_mtime_and_the_code_that_computed_them(
        tmp_path, monkeypatch):
    """Two deliveries of a model (every mtime 0 after the client unpacks it), the same sizes, other bytes: one key
    each (an inode and change time tell them apart without reading them). And curves computed by other code
    (an edit or a pull, the installed version unmoved) are not served as this code's."""
    import os
    from types import SimpleNamespace

    from service.job import targeting

    monkeypatch.setattr(targeting, "DIGESTED_BYTES", 4)  # files this size and up are not read
    for name, content in (("a", b"weights one"), ("b", b"weights two")):
        (tmp_path / name / "sub").mkdir(parents=True)
        (tmp_path / name / "sub" / "model.safetensors").write_bytes(content)
        os.utime(tmp_path / name / "sub" / "model.safetensors", (0, 0))
    first, second = (targeting._fingerprint(tmp_path / n) for n in ("a", "b"))
    assert first[1:] != second[1:] and first[1][0] == "sub/model.safetensors"
    job = SimpleNamespace(causal=False, shape={"batch": 8})
    key = targeting.curves_cache_key(job, _request(), "1")
    monkeypatch.setattr(targeting, "code_digest", lambda: "other code")
    assert targeting.curves_cache_key(job, _request(), "1") != key


def test_a_cached_curves_file_that_does_not_read_is_computed_again(tmp_path):
    """A curves file cut short (a power loss before its rename reached the disk) or of another format failed every
    job of its key with a traceback until someone deleted it."""
    from service.job import targeting

    request = _request(home=tmp_path)
    observed = []

    class Job:
        causal, shape = False, {"batch": 8}

        def currency(self):
            return None

        def prune(self, ratio, observe):
            observed.append(ratio)

    said = []
    path = tmp_path / "curves" / f"{targeting.curves_cache_key(Job(), request, '1')}.json"
    path.parent.mkdir()
    for broken in ('[{"name": "l', '[{"unknown_field": 1}]'):
        path.write_text(broken)
        assert targeting.dense_curves(Job(), request, said.append, "1") == []
        assert any("do not read" in str(getattr(s, "message", s)) for s in said)
        assert path.read_text() == "[]"  # written again
    assert observed == [0.0, 0.0]


class FakeDepthJob:
    """Blocks b0..b5 removed in that order; each removal saves 5 % of the latency and costs `loss` each;
    layer<i> belongs to block b<i> (its curve leaves with it)."""

    def __init__(self, loss: float) -> None:
        self.loss, self.asked = loss, []

    def depth_order(self):
        for i in range(6):
            self.asked.append(f"b{i}")
            yield f"b{i}", 0.0

    def removal_losses(self):
        return {f"b{i}": self.loss for i in range(6)}

    def without(self, blocks):
        return list(blocks)

    def currency(self):
        return None  # a conv graph's: relative to the stream

    def removed_cost(self, blocks):
        return None  # a conv graph's: every option's speedup measured


def fake_depth_curves():
    return [LayerCurve(f"b{i}.conv", "conv_channels", [8, 4, 2], [0.0, 0.2 * (i + 1), 2.0], cost=1.0)
            for i in range(6)]


def depth_probe(blocks):
    speedup = 1 / (1 - 0.05 * len(blocks))
    return Latency(100.0, 100 / speedup, 101.0, 101 / speedup, speedup, "cpu", 2, "test", 5)


@pytest.mark.parametrize("loss,removed", [(10.0, 0), (0.01, 3)])
def test_depth_is_chosen_by_the_least_planned_loss_of_depth_and_width(loss, removed):
    request = CompressRequest(model="m", calibration="c", out_dir="o", target_speedup=1.3)
    job = FakeDepthJob(loss)
    lines = []
    plan = plan_depth(job, fake_depth_curves(), request, depth_probe, lines.append)
    assert len(plan.chosen.blocks) == removed
    assert plan.chosen.loss == min(o.loss for o in plan.options)
    assert len(job.asked) <= 3  # at most half the blocks weighed
    if removed == 0:  # two options in a row no better than none: the search stops
        assert len(plan.options) == 3
    report = plan.to_dict()
    assert report["planned"] == list(plan.chosen.blocks)
    assert [o["chosen"] for o in report["options"]].count(True) == 1
    assert lines[-1].startswith(f"depth: removing {removed} blocks")
    assert "relative to the residual stream" in report["rule"]  # a job without an output currency says so


def test_a_stream_left_as_a_plain_unit_keeps_its_curve_at_its_new_cost():
    """Without both inverted residuals the stem's stream has one producer and one consumer: a plain unit named
    after its consumer (pw1), where the curve is `coupled:stem`. It kept the dense cost of a group through three
    convs, and the unit it became had no cost."""
    from service.job.kinds import ConvJob
    from tests.compressor.cnn.conv_models import exported

    job = ConvJob.__new__(ConvJob)
    job.dense = exported("mobilenet")
    dense, shallow = job.unit_costs([]), job.unit_costs(["ir1", "ir2"])
    assert set(shallow) == {"coupled:stem", "pw2", "fc"} and shallow["coupled:stem"] < dense["coupled:stem"]
    curves = [LayerCurve(name, "conv_channels", [8, 4], [0.0, 1.0], cost) for name, cost in dense.items()]
    kept = kept_curves(job, ["ir1", "ir2"], curves)
    assert {c.name: c.cost for c in kept} == shallow


def test_the_curves_left_without_blocks_are_priced_in_the_shallower_graph():
    """A conv graph's residual stream (a coupled group) runs through every block: without one, each of its channels
    costs less, and the widths of the options and of the rounds after them are priced so."""
    from service.job.kinds import ConvJob
    from tests.compressor.cnn.conv_models import exported

    job = ConvJob.__new__(ConvJob)
    job.dense = exported("bottleneck")
    dense, shallow = job.unit_costs([]), job.unit_costs(["block1"])
    coupled = [name for name in dense if name.startswith("coupled:")]
    assert coupled and all(shallow[name] < dense[name] for name in coupled)
    curves = [LayerCurve(name, "conv_channels", [8, 4], [0.0, 1.0], cost) for name, cost in dense.items()]
    kept = kept_curves(job, ["block1"], curves)
    assert [c.name for c in kept] == [c.name for c in curves if not c.name.startswith("block1.")] != \
        [c.name for c in curves]
    assert all(c.cost == shallow[c.name] for c in kept)
    assert kept_curves(job, [], curves) == curves

    class Priced(FakeDepthJob):
        def unit_costs(self, blocks, graph=None):
            self.priced.append(list(blocks))
            return {"b1.conv": 0.1}  # the cheapest curve to narrow saves ten times less once b0 is gone

    priced = Priced(0.01)
    priced.priced = []
    request = CompressRequest(model="m", calibration="c", out_dir="o", target_speedup=1.3)
    plan = plan_depth(priced, fake_depth_curves(), request, depth_probe, lambda line: None)
    unpriced = plan_depth(FakeDepthJob(0.01), fake_depth_curves(), request, depth_probe, lambda line: None)
    assert priced.priced == [["b0"], ["b0", "b1"], ["b0", "b1", "b2"]][: len(priced.priced)] and priced.priced
    assert plan.options[1].width_loss > unpriced.options[1].width_loss  # the saving comes from dearer curves


def test_long_depth_orders_are_weighed_at_prefix_lengths_about_1_5x_apart():
    """A transformer's depth order holds 3 units a layer: the prefixes weighed (each a probe) are those of
    DEPTH_SIZES, not every one."""

    class ManyUnits(FakeDepthJob):
        def depth_order(self):
            for i in range(40):
                yield f"b{i}", 0.0

        def removal_losses(self):
            return {f"b{i}": 1e-6 * i for i in range(40)}

    probed = []

    def probe(blocks):
        probed.append(len(blocks))
        return depth_probe(blocks)  # 5 % saved a unit: 16 units reach the aim (3.09x) alone

    request = CompressRequest(model="m", calibration="c", out_dir="o", target_speedup=3.0)
    # fine curves: each unit removed spares some width loss, so every option is better than the one before
    curves = [LayerCurve(f"c{i}.conv", "conv_channels", list(range(64, 0, -1)), [0.01 * k for k in range(64)],
                         cost=1.0) for i in range(6)]
    plan = plan_depth(ManyUnits(0.0), curves, request, probe, lambda m: None)
    assert probed == [1, 2, 3, 4, 6, 8, 12, 16]
    assert [len(o.blocks) for o in plan.options] == [0, *probed]


class CostedUnits(FakeDepthJob):
    """A transformer's depth units: 40 of them, each 2 % of the prunable multiply-adds, removed in order; each
    removal after the first `cheap` costs 10.0 (else nothing)."""

    def __init__(self, cheap: int) -> None:
        super().__init__(0.0)
        self.cheap = cheap

    def depth_order(self):
        for i in range(40):
            yield f"b{i}", 0.0

    def removal_losses(self):
        return {f"b{i}": 0.0 if i < self.cheap else 10.0 for i in range(40)}

    def removed_cost(self, blocks):
        return 0.02 * len(blocks)


def _fine_curves():
    # each unit of width removed costs more than the one before: a little depth always spares some width loss
    return [LayerCurve(f"c{i}.conv", "conv_channels", list(range(64, 0, -1)), [0.01 * k * k for k in range(64)],
                       cost=1.0) for i in range(6)]


def test_a_transformers_small_depth_options_are_modelled_not_probed():
    """Units whose latency is their share of the multiply-adds (`removed_cost`): options removing less than
    DEPTH_PROBE_MIN of the latency are planned from the model alone (their probes would measure timing noise)."""
    from service.job.targeting import DEPTH_PROBE_MIN, INITIAL_SHARE

    probed = []
    request = CompressRequest(model="m", calibration="c", out_dir="o", target_speedup=1.3)
    plan = plan_depth(CostedUnits(cheap=2), _fine_curves(), request, lambda b: probed.append(b) or depth_probe(b),
                      lambda m: None)
    assert [len(b) for b in probed] == []
    assert len(plan.chosen.blocks) == 2 and not plan.chosen.measured
    assert 1 - 1 / plan.chosen.depth_speedup < DEPTH_PROBE_MIN
    assert plan.chosen.depth_speedup == pytest.approx(1 / (1 - INITIAL_SHARE * 0.04))
    assert plan.share == plan.depth_share == INITIAL_SHARE
    report = plan.to_dict()
    assert not any(o["measured"] for o in report["options"][1:])  # removing none is 1.0x, nothing to model
    assert "modelled from the multiply-adds" in report["rule"]


def test_a_transformers_large_depth_option_is_probed_and_corrects_the_share():
    """The best option removes more than DEPTH_PROBE_MIN of the modelled latency: it is probed, the probe's
    latency per removed cost becomes the depth model's share, and the options are planned again with it. The widths
    planned for the rest keep the latency model's own share: a whole unit's latency per multiply-add (its fixed
    costs too) says nothing of a narrower one's."""
    from service.job.targeting import INITIAL_SHARE, MAX_DEPTH_PROBES

    probed = []

    def probe(blocks):  # the latency falls by half the removed cost: the model's 0.85 is too high
        probed.append(len(blocks))
        speedup = 1 / (1 - 0.5 * 0.02 * len(blocks))
        return Latency(100.0, 100 / speedup, 101.0, 101 / speedup, speedup, "cpu", 2, "test", 5)

    request = CompressRequest(model="m", calibration="c", out_dir="o", target_speedup=1.3)
    lines = []
    plan = plan_depth(CostedUnits(cheap=40), _fine_curves(), request, probe, lines.append)
    assert 1 <= len(probed) <= MAX_DEPTH_PROBES
    assert len(probed) == len(set(probed))  # never the same option twice
    assert plan.chosen.measured and len(plan.chosen.blocks) == probed[-1]
    assert plan.chosen.depth_speedup == pytest.approx(1 / (1 - 0.01 * probed[-1]))
    assert plan.depth_share == pytest.approx(0.5) and plan.share == INITIAL_SHARE
    assert plan.to_dict()["depth_share"] == pytest.approx(0.5)
    for o in plan.options[1:]:  # the rest of the aim, over the latency model's share
        assert o.width_saving == pytest.approx(max(0.0, 1 - o.depth_speedup / plan.aim) / INITIAL_SHARE)
    unmeasured = [o for o in plan.options[1:] if not o.measured]
    assert all(o.depth_speedup == pytest.approx(1 / (1 - 0.5 * 0.02 * len(o.blocks))) for o in unmeasured)
    assert any(line.startswith(f"depth: {probed[0]} units removed measured") for line in lines)


def test_depth_search_stops_once_blocks_alone_reach_the_aim():
    request = CompressRequest(model="m", calibration="c", out_dir="o", target_speedup=1.05)
    plan = plan_depth(FakeDepthJob(0.0), fake_depth_curves(), request, depth_probe, lambda m: None)
    assert [o.width_saving for o in plan.options][-1] == 0.0
    assert len(plan.chosen.blocks) == 2  # 1/0.9 = 1.11x >= 1.03 x 1.05; one block (1.053x) falls short


@pytest.mark.parametrize("back_off", [False, True])
def test_a_depth_option_whose_rounds_all_miss_the_budget_is_replanned(back_off):
    """Every round with no block removed lands below the default top-1 budget: the next option by planned
    loss (one block removed) gets the rounds left, and its round is the one within the budget. With --back-off
    too: backing off narrows less, and where no round of an option gets within the budget the next one is tried."""

    from compressor.allocation import DepthOption
    from service.job.targeting import DepthPlan, Measure, Round, depth_and_width

    curves = [LayerCurve(f"b{i}.conv", "conv_channels", [8, 4, 2], [0.0, 0.1, 0.5], cost=1.0) for i in range(3)]

    job, rounds, lines = TrialJob(curves), [], []

    def run_round(plan, index, predicted=None):
        assert index == len(rounds)  # numbered across the options
        latency = Latency(100.0, 100 / 1.5, 101.0, 101 / 1.5, 1.5, "cpu", 2, "test", 5)  # inside the window
        top1 = 0.85 if job.removed[-1] else 0.5  # budget: at most 10 points below 0.92
        rounds.append(Round(plan, None, [], None, None, latency, top1, predicted))
        return rounds[-1]

    none = DepthOption((), 0.0, 1.0, 0.3, 0.2)
    one = DepthOption(("b0",), 0.1, 1.2, 0.2, 0.2)
    never = DepthOption(("b0", "b1"), 0.3, 1.3, 0.9, math.inf)
    plan = DepthPlan(none, [none, one, never], aim=1.5, share=0.85)
    request = CompressRequest(model="m", calibration="c", out_dir="o", target_speedup=1.5, latency_probes=0,
                              back_off=back_off)
    depth_and_width(request, job, plan, curves, rounds, 0.92, lines.append, lambda name, i: None,
                    Measure(run_round, lambda p, i: None, lambda m, i: None), "test")
    assert job.removed == [(), ("b0",)] and rounds[-1].metric == 0.85
    assert len(rounds) == 2 and rounds[0].metric == 0.5
    assert job.depth["tried"] == [0, 1] and job.depth["planned"] == []
    assert any("re-planning with 1 blocks removed" in line for line in lines)
    chosen, status = choose(request, rounds, TrialJob.metric, 0.92)
    assert chosen is rounds[1] and status == "ok"


def test_a_depth_option_whose_rounds_stay_short_of_the_target_is_replanned_to_one_removing_more():
    """Every round with no block removed is within the budget but the widths stop at 1.2x of a 1.5x target (their
    minimum): the next option by planned loss that removes more (modelled faster: two blocks, not the one-block
    option planned next) gets the rounds left, and its round meets the target."""

    from compressor.allocation import DepthOption
    from service.job.targeting import DepthPlan, Measure, Round, depth_and_width

    curves = [LayerCurve(f"b{i}.conv", "conv_channels", [8, 4, 2], [0.0, 0.01, 0.02], cost=1.0) for i in range(3)]

    job, rounds, lines = TrialJob(curves), [], []

    def run_round(plan, index, predicted=None):
        speedup = 1.55 if len(job.removed[-1]) == 2 else 1.2
        latency = Latency(100.0, 100 / speedup, 101.0, 101 / speedup, speedup, "cpu", 2, "test", 5)
        rounds.append(Round(plan, None, [], None, None, latency, 0.9, predicted))
        return rounds[-1]

    none = DepthOption((), 0.0, 1.0, 0.3, 0.2)
    same = DepthOption(("b1",), 0.05, 1.0, 0.3, 0.25)  # planned next, but no faster than the one that fell short
    two = DepthOption(("b0", "b1"), 0.1, 1.6, 0.0, 0.3, measured=True)
    plan = DepthPlan(none, [none, same, two], aim=1.5, share=0.85)
    request = CompressRequest(model="m", calibration="c", out_dir="o", target_speedup=1.5, latency_probes=0)
    depth_and_width(request, job, plan, curves, rounds, 0.92, lines.append, lambda name, i: None,
                    Measure(run_round, lambda p, i: None, lambda m, i: None), "test")
    assert job.removed[0] == () and job.removed[-1] == ("b0", "b1") and ("b1",) not in job.removed
    assert rounds[-1].latency.speedup == 1.55 and job.depth["tried"] == [0, 2]
    assert any("reached 1.200x, short of the 1.5x target; re-planning with 2 blocks removed" in str(line)
               for line in lines)
    chosen, status = choose(request, rounds, TrialJob.metric, 0.92)
    assert chosen is rounds[-1] and status == "ok"


def test_a_replanned_option_that_was_only_modelled_is_measured_before_its_rounds():
    """The re-planned option's speedup was modelled (1.6x: past the aim, so its rounds planned dense widths and the
    loop stopped short); its shallower graph is probed first (1.2x) and its rounds narrow widths for the rest. An
    option whose round never ran (the rounds ran out) is not reported tried."""
    from types import SimpleNamespace

    from compressor.allocation import DepthOption
    from service.job.targeting import DepthPlan, Measure, Round, depth_and_width

    curves = [LayerCurve(f"b{i}.conv", "ffn_neurons", list(range(64, 0, -8)),
                         [0.01 * (1 - w / 64) for w in range(64, 0, -8)], cost=1.0) for i in range(3)]

    class Job:
        metric = Metric("top1", True)
        depth = None

        def __init__(self):
            self.removed, self.analysis, self.without_calls = [], None, []

        def remove(self, blocks):
            self.removed.append(tuple(blocks))
            self.analysis = SimpleNamespace(units=[SimpleNamespace(name=c.name) for c in curves
                                                   if not any(c.name.startswith(f"{b}.") for b in blocks)])

        def without(self, blocks):
            self.without_calls.append(tuple(blocks))
            return "shallow"

    job, rounds, lines = Job(), [], []

    def run_round(plan, index, predicted=None):
        kept = [c for c in curves if c.name in plan]
        saved = 1 - total_cost(kept, plan) / total_cost(kept)
        depth = 1.2 if job.removed[-1] else 1.0
        speedup = depth / (1 - 0.8 * saved)
        latency = Latency(100.0, 100 / speedup, 101.0, 101 / speedup, speedup, "cpu", 2, "test", 5)
        top1 = 0.85 if job.removed[-1] else 0.5  # budget: at most 10 points below 0.92
        rounds.append(Round(plan, None, [], None, None, latency, top1, predicted))
        return rounds[-1]

    def probe_model(module, index):
        assert module == "shallow"
        return Latency(100.0, 100 / 1.2, 101.0, 101 / 1.2, 1.2, "cpu", 2, "test", 5)

    none = DepthOption((), 0.0, 1.0, 0.3, 0.2)
    one = DepthOption(("b0",), 0.1, 1.6, 0.0, 0.0, measured=False)  # modelled past the aim (1.03 x 1.5)
    plan = DepthPlan(none, [none, one], aim=1.5, share=0.85)
    request = CompressRequest(model="m", calibration="c", out_dir="o", target_speedup=1.5, latency_probes=0)
    depth_and_width(request, job, plan, curves, rounds, 0.92, lines.append, lambda name, i: None,
                    Measure(run_round, lambda p, i: None, probe_model), "test")
    assert job.without_calls == [("b0",)] and any("1 units removed measured 1.200x (modelled 1.600x)" in line
                                                  for line in lines)
    assert job.removed == [(), ("b0",)] and len(rounds) >= 2
    narrowed = rounds[1].plan
    assert any(w < 64 for w in narrowed.values())  # the widths remove what the blocks did not
    assert choose(request, rounds, Job.metric, 0.92)[1] == "ok" and job.depth["tried"] == [0, 1]

    job, rounds, lines = Job(), [], []

    def out_of_time(plan, index, predicted=None):  # as the time budget stops a round before it starts
        if job.removed[-1]:
            raise TimeoutError("round not started")
        return run_round(plan, index, predicted)

    with pytest.raises(TimeoutError):
        depth_and_width(request, job, plan, curves, rounds, 0.92, lines.append, lambda name, i: None,
                        Measure(out_of_time, lambda p, i: None, probe_model), "test")
    assert len(rounds) == 1 and job.depth["tried"] == [0]


class TrialJob:
    """A conv graph's job for depth_and_width: b0..b2 own the layers b<i>.conv; `remove` records each structure."""

    metric = Metric("top1", True)
    depth = None

    def __init__(self, curves):
        self.curves, self.removed, self.analysis = curves, [], None

    def remove(self, blocks):
        from types import SimpleNamespace

        self.removed.append(tuple(blocks))
        self.analysis = SimpleNamespace(units=[SimpleNamespace(name=c.name) for c in self.curves
                                               if not any(c.name.startswith(f"{b}.") for b in blocks)])


def trial_setup(losses):
    """(job, curves, plan, measure, rounds, calls) for depth_and_width: options none / b0 / b0+b1 planned at `losses`;
    every width measures 1.5x against the dense graph (inside the window of target 1.5); a trial (no fit) and a
    round (fitted) score 0.80 / 0.85 with b0 removed, 0.75 / 0.80 otherwise; `calls` lists ("probe" | "trial" |
    "round", blocks removed, widths, the solves a round was handed)."""
    from compressor.allocation import DepthOption
    from service.job.targeting import DepthPlan, Measure

    curves = [LayerCurve(f"b{i}.conv", "conv_channels", [8, 6, 4, 2], [0.0, 0.05, 0.1, 0.5], cost=1.0)
              for i in range(3)]
    job, rounds, calls = TrialJob(curves), [], []
    latency = Latency(100.0, 100 / 1.5, 101.0, 101 / 1.5, 1.5, "cpu", 2, "test", 5)

    def scored(kind, fitted):
        def run(plan, index, predicted=None, solved=None):
            calls.append((kind, job.removed[-1], plan, solved))
            top1 = (0.80 if job.removed[-1] == ("b0",) else 0.75) + (0.05 if fitted else 0.0)
            # a trial's model: what a kind that refits its solves hands to the round after it
            result = Round(plan, None if fitted else f"solved {job.removed[-1]}", [], None, None, latency, top1,
                           predicted)
            if fitted:  # the job's run_round fills its list of rounds
                rounds.append(result)
            return result
        return run

    def probe(plan, index):
        calls.append(("probe", job.removed[-1], plan, None))
        return latency

    options = [DepthOption(blocks, loss, speedup, 0.3, 0.2) for blocks, loss, speedup in
               zip([(), ("b0",), ("b0", "b1")], losses, [1.0, 1.1, 1.2], strict=True)]
    chosen = min(options, key=lambda o: o.loss)
    plan = DepthPlan(chosen, options, aim=1.545, share=0.85)
    measure = Measure(scored("round", True), probe, lambda m, i: None, scored("trial", False))
    return job, curves, plan, measure, rounds, calls


def test_options_planned_within_the_tie_are_tried_without_the_fit_and_the_best_runs_first():
    """None and one block are planned 0.500 and 0.505 (within TIE): each is probed and solved without the fit;
    one block's trial scores best, so its round runs first, at the trial's widths and from its solves, without
    probing them again; report.json `depth` lists both trials. (ResNet-56 at 2x: 3 and 6 blocks planned 0.7497
    and 0.7514.)"""
    from service.job.targeting import depth_and_width

    job, curves, plan, measure, rounds, calls = trial_setup([0.500, 0.505, 0.9])
    request = CompressRequest(model="m", calibration="c", out_dir="o", target_speedup=1.5)
    lines = []
    depth_and_width(request, job, plan, curves, rounds, 0.92, lines.append, lambda name, i: None, measure, "test")
    trials = [c for c in calls if c[0] == "trial"]
    assert [t[1] for t in trials] == [(), ("b0",)]
    assert [c[0] for c in calls] == ["probe", "trial", "probe", "trial", "round"]
    # the best trial's widths and solves, fitted
    assert len(rounds) == 1 and calls[-1] == ("round", ("b0",), trials[1][2], ("solved ('b0',)", []))
    assert rounds[0].metric == pytest.approx(0.85) and job.removed[-1] == ("b0",)
    assert [(t["blocks"], t["metric"], t["chosen"]) for t in job.depth["trials"]] == [(1, 0.80, True), (0, 0.75, False)]
    assert job.depth["planned"] == [] and job.depth["tried"] == [1]  # the plan's choice, and what ran
    assert any("within 3% of each other" in line for line in lines)
    assert lines[-1].startswith("round 0: removing")  # numbered as the job's rounds, after "depth trial" lines
    assert any(line.startswith("depth trial 2: 1 blocks removed, measured 1.500x") for line in lines)


def test_a_trial_timed_in_a_fast_spell_is_timed_again_by_a_probe_of_its_widths():
    """Each trial's own timing reads 1.70x where its probe read 1.50x (inside [0.98, 1.10] x 1.5; ResNet-56 at 2x,
    2026-12-05: a probe's 2.074x, its trial's 2.210x, so the round probed and solved its widths anew). A trial's
    export is gone once scored, so a probe of its widths is the second look; the median, 1.50x, is inside the
    window and the round runs at the trial's widths from its solves."""
    from service.job.targeting import depth_and_width

    job, curves, plan, measure, rounds, calls = trial_setup([0.500, 0.505, 0.9])
    fast = Latency(100.0, 100 / 1.7, 101.0, 101 / 1.7, 1.7, "cpu", 2, "test", 5)
    trial = measure.trial
    assert trial is not None
    measure = replace(measure, trial=lambda *args, **kwargs: replace(trial(*args, **kwargs), latency=fast))
    request = CompressRequest(model="m", calibration="c", out_dir="o", target_speedup=1.5)
    depth_and_width(request, job, plan, curves, rounds, 0.92, lambda line: None, lambda name, i: None, measure, "test")
    assert [c[0] for c in calls] == ["probe", "trial", "probe", "probe", "trial", "probe", "round"]
    trials = [c for c in calls if c[0] == "trial"]
    assert len(rounds) == 1 and calls[-1] == ("round", ("b0",), trials[1][2], ("solved ('b0',)", []))
    assert [t["measured_speedup"] for t in job.depth["trials"]] == pytest.approx([1.5, 1.5])


def test_a_trial_whose_outputs_went_to_nan_ranks_last():
    """A NaN score compares equal to every other: sorted by it, the first trial (removing none, here NaN) stayed first
    and its option ran; it ranks after every trial with a number now, those short of the target too."""
    from service.job.targeting import depth_and_width

    job, curves, plan, measure, rounds, calls = trial_setup([0.500, 0.505, 0.9])
    trial = measure.trial
    assert trial is not None

    short = Latency(100.0, 100 / 1.4, 101.0, 101 / 1.4, 1.4, "cpu", 2, "test", 5)  # below 0.98 x the target

    def broken_without_depth(*args, **kwargs):
        done = trial(*args, **kwargs)
        return replace(done, metric=math.nan) if job.removed[-1] == () else replace(done, latency=short)

    measure = replace(measure, trial=broken_without_depth)
    request = CompressRequest(model="m", calibration="c", out_dir="o", target_speedup=1.5)
    depth_and_width(request, job, plan, curves, rounds, 0.92, lambda line: None, lambda name, i: None, measure, "test")
    assert [c[0] for c in calls][:4] == ["probe", "trial", "probe", "trial"]
    assert calls[-1][:2] == ("round", ("b0",)) and {c[1] for c in calls[4:]} == {("b0",)}
    assert [(t["blocks"], t["chosen"]) for t in job.depth["trials"]] == [(1, True), (0, False)]


def test_options_planned_apart_run_without_trials():
    """0.500 and 0.530 are not a tie: no trial; the least planned runs first, and its round below the budget
    (0.80 < 0.92 - 10 points) costs a re-plan."""
    from service.job.targeting import depth_and_width

    job, curves, plan, measure, rounds, calls = trial_setup([0.500, 0.530, 0.9])
    request = CompressRequest(model="m", calibration="c", out_dir="o", target_speedup=1.5)
    depth_and_width(request, job, plan, curves, rounds, 0.92, lambda m: None, lambda name, i: None, measure, "test")
    assert [c[0] for c in calls] == ["probe", "round", "probe", "round"] and job.removed == [(), ("b0",)]
    assert job.depth["trials"] == [] and job.depth["tried"] == [0, 1] and len(rounds) == 2


def test_a_layer_whose_statistics_no_damping_factorises_is_kept_whole_by_the_allocation():
    """Its loss path cannot be computed (an H at rounding level, every 2 x 2 block indefinite): the layer's curve
    is its dense width alone, with a warning, where the dense statistics pass used to end the job in a traceback."""
    import torch

    from compressor.layerstats import LayerObservation
    from service.job.targeting import layer_curve

    H = torch.tensor([[1.0, 2.0, 2.0], [2.0, 1.0, 2.0], [2.0, 2.0, 1.0]], dtype=torch.float64) * 1e-20
    W_hat = torch.tensor([[3.0, 1.0], [0.1, 0.2], [-2.0, 0.5]], dtype=torch.float64)
    request = CompressRequest(model="m", calibration="c", out_dir="o", target_speedup=1.5, round_to=1)
    said: list[str] = []
    observed = LayerObservation("se.conv", "conv_channels", H, H @ W_hat, 1, 1e-20, 2.0)
    curve = layer_curve(observed, request, None, said.append)
    assert (curve.widths, curve.loss, curve.cost) == ([3], [0.0], 2.0)
    (warned,) = said
    assert warned.stage == WARNING and "se.conv: no loss curve" in warned.message and "keeps it whole" in warned.message
    healthy = LayerObservation("fc", "conv_channels", torch.eye(3, dtype=torch.float64),
                               W_hat.clone(), 1, 1.0, 2.0)
    assert layer_curve(healthy, request, None, said.append).widths == [3, 2, 1] and len(said) == 1



def test_the_depth_search_goes_on_while_deeper_options_come_closer_to_a_width_plan():
    """Widths alone cannot reach the aim (infinite loss): two such options in a row ended the search, so a deeper
    one that widths could complete was never weighed, and the job ended at minimum widths."""
    from compressor.allocation import DepthOption
    from service.job.targeting import _searched

    none = DepthOption((), 0.0, 1.0, 0.9, math.inf)
    best, worse = none, 0
    for blocks, saving in ((("b0",), 0.85), (("b0", "b1"), 0.8)):
        option = DepthOption(blocks, 0.1 * len(blocks), 1.0 + 0.1 * len(blocks), saving, math.inf)
        best, worse, stop = _searched(option, best, worse)
        assert not stop and best is option and worse == 0
    feasible = DepthOption(("b0", "b1", "b2"), 0.3, 1.4, 0.5, 0.2)
    best, worse, stop = _searched(feasible, best, worse)
    assert best is feasible and not stop
    farther = DepthOption(("b0", "b1", "b2", "b3"), 0.4, 1.5, 0.95, math.inf)  # a finite plan beats any infinite
    best, worse, _ = _searched(farther, best, worse)
    assert best is feasible and worse == 1


def test_a_report_whose_attention_widths_count_another_head_unit_is_refused(tmp_path):
    """A --gqa kv-groups report's "2 of 2" KV groups were read as 2 of 8 query heads: another model, no word."""
    import json

    from compressor.errors import InputError
    from service.job.targeting import check_gqa_of

    path = tmp_path / "report.json"
    path.write_text(json.dumps({"layers": [], "gqa": "kv-groups"}))
    with pytest.raises(InputError, match=r"count whole KV groups \(--gqa kv-groups\); give --gqa kv-groups"):
        check_gqa_of(path, "query-heads")
    check_gqa_of(path, "kv-groups")
    path.write_text(json.dumps({"layers": []}))  # no grouped-query attention, or a report of an earlier release
    check_gqa_of(path, "query-heads")


def test_a_report_without_widths_is_refused_before_the_model_loads(tmp_path):
    """A parity_failed report (layers: []) was taken, and the job failed after loading and the dense export with
    "the width plan has no entry for layer ..." naming no flag."""
    import json

    from compressor.errors import InputError
    from service.job.targeting import widths_of

    path = tmp_path / "report.json"
    path.write_text(json.dumps({"status": "parity_failed", "layers": []}))
    with pytest.raises(InputError, match=r"--widths-from .*report\.json: the report holds no widths \(status "
                                         r"'parity_failed'\)"):
        widths_of(path)
    path.write_text(json.dumps({"status": "ok", "layers": [{"name": "a", "width_after": 3}]}))
    assert widths_of(path) == {"a": 3}


def test_a_moe_layers_expert_curves_become_one_unit_of_summed_loss_and_cost():
    """Each expert of a MoE layer is observed on its own but keeps the layer's one width: the allocation plans the
    layer, whose loss at a width is its experts' summed loss and whose neuron costs every expert's."""
    experts = [LayerCurve("l0.mlp.experts", "ffn_neurons", [16, 8], [0.0, loss], 2.0) for loss in (0.1, 0.3, 0.2)]
    attention = LayerCurve("l0.o_proj", "attention_heads", [4, 3, 2], [0.0, 0.1, 0.5], 5.0)
    merged = merged_units([attention, *experts])
    assert [c.name for c in merged] == ["l0.o_proj", "l0.mlp.experts"]
    assert merged[0] is attention
    assert merged[1].widths == [16, 8] and merged[1].loss == pytest.approx([0.0, 0.6]) and merged[1].cost == 6.0
    # an expert without a loss curve (kept whole) keeps the unit whole
    whole = merged_units([*experts, LayerCurve("l0.mlp.experts", "ffn_neurons", [16], [0.0], 2.0)])
    assert whole == [LayerCurve("l0.mlp.experts", "ffn_neurons", [16], [0.0], 8.0)]


def test_a_moe_layers_curve_offers_only_widths_its_experts_can_keep():
    """--round-to 4 offered 92, 84, ... neurons of an expert, which the surgery rounds up to multiples of 8 (92 kept
    96: the layer was planned pruned and was not): the curve's widths are multiples of both."""
    import torch

    from compressor.layerstats import LayerObservation
    from service.job.targeting import layer_curve

    H = torch.eye(96, dtype=torch.float64) + 0.1
    obs = LayerObservation("l0.mlp.experts.0", "ffn_neurons", H, H @ torch.ones(96, 4, dtype=torch.float64), 1,
                           1.0, 2.0, None, "l0.mlp.experts", 8)
    curve = layer_curve(obs, CompressRequest(model="m", round_to=4, normalise="layer"), None, lambda _: None)
    assert curve.name == "l0.mlp.experts" and curve.widths[0] == 96
    assert all(w % 8 == 0 for w in curve.widths) and 88 in curve.widths
