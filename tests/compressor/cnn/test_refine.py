"""Reconstruction of a pruned conv graph: what it fits, that it lowers the error to the dense outputs on
held-out images (or is dropped), and its place in the pipeline."""

import dataclasses
import math

import numpy as np
import pytest
import torch

from compressor.cnn import refine
from compressor.cnn.pipeline import fit_conv_graph, prune_conv_graph
from compressor.cnn.refine import (
    AUGMENT_FROM,
    AVERAGE_STEPS,
    LONG_LR,
    VIEW_USES,
    draw_views,
    fitted_parameters,
    graph_config,
    reconstruct_graph,
    view_images,
)
from compressor.errors import InputError
from compressor.progress import RECONSTRUCTION, Progress
from compressor.refine import RefineConfig, held_out_draw
from compressor.reports import RefineReport

from .conv_models import exported

CPU = torch.device("cpu")


def images(n: int = 96, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


def relative_error(pruned, dense, x) -> float:
    with torch.no_grad():
        out, target = pruned(x), dense(x)
    return float((out - target).square().sum() / target.square().sum())


def test_conv_and_linear_weights_are_fitted_and_batch_norm_only_on_request():
    gm = exported("bottleneck")
    names = {n for n, p in gm.named_parameters() for q in fitted_parameters(gm) if p is q}
    assert names and all(n.endswith((".weight", ".bias")) for n in names)
    assert any(n.startswith("fc.") for n in names)  # the classifier is fitted too
    assert not any("bn" in n for n in names)
    with_norms = {n for n, p in gm.named_parameters() for q in fitted_parameters(gm, norms=True) if p is q}
    assert names < with_norms and any("bn" in n for n in with_norms - names)


@pytest.mark.parametrize("method", ["osscar", "mp+"])
def test_the_fit_lowers_the_error_to_the_dense_outputs_on_unseen_images(method):
    """Option-A ResNet at 0.75: mp+'s error (~0.2) is what a fit must undo; osscar's is already ~1e-3
    on this random-weight toy, and still comes down."""
    gm = exported("option_a")
    x, unseen = images(96, seed=0), images(64, seed=1)
    pruned, _ = prune_conv_graph(gm, x, 0.75, method=method, batch_size=48)
    before = relative_error(pruned, gm, unseen)
    fit = reconstruct_graph(pruned, gm, x, dataclasses.replace(graph_config(60), sequences=16), CPU, batch_size=48)
    assert fit.kept and fit.after < fit.before and fit.steps == 60
    assert relative_error(pruned, gm, unseen) < before  # images neither fitted nor judged on


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_graph_fitted_on_the_gpu_comes_back_where_it_came_from():
    """The fit runs on the device; the graphs leave on the host they came from, as the job's export (host images)
    and save need (a CUDA job's first round failed on a device mismatch there)."""
    gm = exported("option_a")
    x = images(64, seed=0)
    pruned, _ = prune_conv_graph(gm, x, 0.5, batch_size=32, device="cpu")
    fit = reconstruct_graph(pruned, gm, x, dataclasses.replace(graph_config(5), sequences=16), torch.device("cuda"),
                            batch_size=32)
    assert fit.steps == 5
    assert {t.device.type for t in [*pruned.parameters(), *pruned.buffers(), *gm.parameters()]} == {"cpu"}
    with torch.no_grad():
        pruned(x[:2])  # host images, as the export feeds them


def test_views_are_seeded_flips_and_shifts_of_at_most_an_eighth():
    x = torch.arange(2 * 16 * 16, dtype=torch.float32).view(2, 1, 16, 16).repeat(20, 3, 1, 1) + 1  # no zeros
    def flip_and_shift(seed: int) -> torch.Tensor:  # a view of each image
        return view_images(x, draw_views(torch.arange(len(x)), (16, 16), torch.Generator().manual_seed(seed)))

    a = flip_and_shift(0)
    assert a.shape == x.shape and torch.equal(a, flip_and_shift(0))
    flipped = shifted = 0
    for view, image in zip(a, x, strict=True):
        # find the view's offset: some (dy, dx) in [-2, 2]^2 and a flip reproduce its non-padded part
        matches = [(f, dy, dx) for f in (False, True) for dy in range(-2, 3) for dx in range(-2, 3)
                   if torch.equal(view[:, max(0, dy):16 + min(0, dy), max(0, dx):16 + min(0, dx)],
                                  (image.flip(-1) if f else image)[:, max(0, -dy):16 - max(0, dy),
                                                                   max(0, -dx):16 - max(0, dx)])]
        assert matches, "a view is no flip and shift of its image"
        f, dy, dx = matches[0]
        flipped, shifted = flipped + f, shifted + ((dy, dx) != (0, 0))
        assert int((view == 0).sum()) == 3 * (16 * abs(dy) + 16 * abs(dx) - abs(dy * dx))  # the zero border
    assert 0 < flipped < len(x) and shifted > len(x) // 2


def test_a_fit_on_views_lowers_the_error_on_unseen_images_and_keeps_the_held_out_judge():
    gm = exported("option_a")
    x, unseen = images(96, seed=0), images(64, seed=1)
    pruned, _ = prune_conv_graph(gm, x, 0.75, method="mp+", batch_size=48)
    before = relative_error(pruned, gm, unseen)
    config = dataclasses.replace(graph_config(60), sequences=16, augment=True)
    fit = reconstruct_graph(pruned, gm, x, config, CPU, batch_size=48)
    assert fit.kept and fit.after < fit.before and fit.steps == 60
    assert relative_error(pruned, gm, unseen) < before


def test_only_long_fits_run_on_views_with_an_annealed_step_fit_the_norms_and_return_an_average():
    """Views pay off once a fit has fitted the images themselves (ResNet-20 at 1,000+ steps, ResNet-56 without 6
    blocks at 3,000); at a few hundred steps they only cost the dense outputs on them. A long fit's step
    size starts at LONG_LR and is annealed; a short one keeps its constant 0.005 (ResNet-20's measured default)."""
    short, long = graph_config(AUGMENT_FROM - 1), graph_config(AUGMENT_FROM)
    assert not graph_config(300).augment and not short.augment and not short.anneal and short.lr == 0.005
    assert long.augment and graph_config(3000).augment and long.anneal and long.lr == LONG_LR > short.lr
    assert long.norms and not short.norms  # the norms' affine parameters: fitted in long fits only
    assert long.average == 1 - 1 / AVERAGE_STEPS and short.average is None  # the weights' average: long fits only
    assert graph_config(3000).check_every > 10  # the held-out checks must not dominate a long fit's time


def test_a_long_fit_moves_the_norms_affine_parameters_and_leaves_their_statistics():
    gm = exported("option_a")
    x = images(96, seed=0)
    pruned, _ = prune_conv_graph(gm, x, 0.75, method="mp+", batch_size=48)
    norms = {n: p.detach().clone() for n, p in pruned.named_parameters() if "bn" in n}
    running = {n: b.clone() for n, b in pruned.named_buffers() if "running" in n}
    assert norms and running
    config = dataclasses.replace(graph_config(AUGMENT_FROM), steps=60, sequences=16, check_every=10)
    fit = reconstruct_graph(pruned, gm, x, config, CPU, batch_size=48)
    assert fit.kept and fit.after < fit.before
    after = dict(pruned.named_parameters())
    assert all(not torch.equal(after[n], before) for n, before in norms.items())
    assert all(torch.equal(b, running[n]) for n, b in pruned.named_buffers() if n in running)


def _inputs_seen(gm: torch.fx.GraphModule) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    gm.register_forward_pre_hook(lambda _module, args: seen.append(args[0]))
    return seen


def test_a_fit_runs_channels_last_and_hands_the_graphs_back_in_standard_strides():
    """oneDNN's and cuDNN's convolutions run channels-last natively (faster); the graphs leave as they came in."""
    gm = exported("option_a")
    x = images(96, seed=0)
    pruned, _ = prune_conv_graph(gm, x, 0.75, method="mp+", batch_size=48)
    dense_inputs, pruned_inputs = _inputs_seen(gm), _inputs_seen(pruned)
    config = dataclasses.replace(graph_config(AUGMENT_FROM), steps=30, sequences=16, check_every=10)
    fit = reconstruct_graph(pruned, gm, x, config, CPU, batch_size=48)
    assert fit.kept and fit.after < fit.before
    assert dense_inputs and len(pruned_inputs) > 30  # the dense outputs (a pass before the steps); steps and checks
    assert all(t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()
               for t in dense_inputs + pruned_inputs)
    four_d = [p for g in (gm, pruned) for p in g.parameters() if p.dim() == 4]
    assert four_d and all(p.is_contiguous() for p in four_d)


@pytest.mark.parametrize("uses", [1, VIEW_USES])
def test_a_fit_on_views_runs_the_dense_graph_once_before_its_steps(uses):
    """The views and their dense outputs are drawn before the fit, enough for each view to be drawn about `uses`
    times: the dense graph then runs on the held-out images and on the views, in batches, and never in a step."""
    gm = exported("option_a")
    x = images(96, seed=0)
    pruned, _ = prune_conv_graph(gm, x, 0.75, method="mp+", batch_size=48)
    config = dataclasses.replace(graph_config(AUGMENT_FROM), steps=30, sequences=16, check_every=10)
    judge, fit = held_out_draw(len(x), config.held_out, config.seed)
    dense_inputs = _inputs_seen(gm)
    report = reconstruct_graph(pruned, gm, x, config, CPU, batch_size=48, view_uses=uses)
    assert report.kept and report.steps == 30
    views = math.ceil(30 * 16 / (len(fit) * uses)) * len(fit)  # whole rounds of views of the fitting images
    # the layout's 2-image probe, the held-out images, the views: in batches of at most 48, none during the steps
    assert sum(len(t) for t in dense_inputs) == 2 + len(judge) + views
    assert max(len(t) for t in dense_inputs) == 48


def test_each_fitting_batch_is_views_and_the_dense_outputs_on_them(monkeypatch):
    """The views are shuffled after they are drawn: each fitting batch's targets must still be the dense outputs
    on that batch's views (the dense graph itself scores zero error on every batch), and they are views, not the
    images."""
    gm = exported("option_a")
    x = images(96, seed=0)
    pruned, _ = prune_conv_graph(gm, x, 0.75, method="mp+", batch_size=48)
    seen: dict[str, object] = {}

    class Capture:
        def __init__(self, module, parameters, config):
            pass

        def fit(self, train, held_out, loss):
            seen.update(train=train, held_out=held_out, loss=loss)
            return RefineReport(1.0, 1.0, False, 0, 0.0)

    monkeypatch.setattr(refine, "Reconstruction", Capture)
    config = dataclasses.replace(graph_config(AUGMENT_FROM), steps=30, sequences=16)
    reconstruct_graph(pruned, gm, x, config, CPU, batch_size=48)
    train, held_out, loss = seen["train"], seen["held_out"], seen["loss"]
    assert len(train) > 6 and held_out
    images_seen = fresh = 0
    for batch in [*train, *held_out]:
        error, energy = loss(gm, batch)
        assert float(error) <= 1e-10 * float(energy)
    for batch in train:
        views = view_images(x, batch[0])
        images_seen += sum(any(torch.equal(view, image) for image in x) for view in views)
        fresh += len(views)
    assert images_seen < fresh / 4  # about 1 in 50 views is the image unflipped and unshifted


def test_the_views_dense_outputs_are_held_within_their_cap(monkeypatch):
    """A graph whose output is a feature map would hold its dense outputs on every view: past VIEW_VALUES, fewer
    views are drawn (here one a fitting image, the least), each drawn more often."""
    gm = exported("option_a")
    x = images(96, seed=0)
    pruned, _ = prune_conv_graph(gm, x, 0.75, method="mp+", batch_size=48)
    config = dataclasses.replace(graph_config(AUGMENT_FROM), steps=30, sequences=16, check_every=10)
    judge, fit = held_out_draw(len(x), config.held_out, config.seed)
    outputs = int(gm(x[:1]).numel())
    monkeypatch.setattr(refine, "VIEW_VALUES", 2 * len(fit) * outputs - 1)  # room for less than 2 views an image
    dense_inputs = _inputs_seen(gm)
    assert reconstruct_graph(pruned, gm, x, config, CPU, batch_size=48, view_uses=1).steps == 30
    assert sum(len(t) for t in dense_inputs) == 2 + len(judge) + len(fit)


@pytest.mark.parametrize("case", ["one image", "no time"])
def test_a_fit_with_nothing_to_fit_computes_no_targets_for_it(case):
    """One calibration image leaves none to judge by, and a paced fit with no seconds left runs no step: neither
    draws views or runs the dense graph on the fitting images; both end as fits that did nothing."""
    gm = exported("option_a")
    x = images(96, seed=0)
    pruned, _ = prune_conv_graph(gm, x, 0.75, method="mp+", batch_size=48)
    config = dataclasses.replace(graph_config(AUGMENT_FROM), steps=30, sequences=16)
    if case == "no time":
        config = dataclasses.replace(config, seconds=0.0)
    fed = x[:1] if case == "one image" else x
    judged = len(held_out_draw(len(fed), config.held_out, config.seed)[0])
    dense_inputs = _inputs_seen(gm)
    report = reconstruct_graph(pruned, gm, fed, config, CPU, batch_size=48)
    assert report.steps == 0 and not report.kept
    assert sum(len(t) for t in dense_inputs) == min(2, len(fed)) + judged  # the layout's probe, the judge's images


def test_a_paced_fit_spends_part_of_its_seconds_on_the_views_dense_outputs(monkeypatch):
    gm = exported("option_a")
    x = images(96, seed=0)
    pruned, _ = prune_conv_graph(gm, x, 0.75, method="mp+", batch_size=48)
    allowed: list[float] = []

    class Fit:
        def __init__(self, module, parameters, config):
            allowed.append(config.seconds)

        def fit(self, train, held_out, loss):
            return RefineReport(1.0, 1.0, False, 0, 0.0)

    monkeypatch.setattr(refine, "Reconstruction", Fit)
    config = dataclasses.replace(graph_config(AUGMENT_FROM), steps=30, sequences=16, seconds=60.0)
    report = reconstruct_graph(pruned, gm, x, config, CPU, batch_size=48)
    assert len(allowed) == 1 and 0 < allowed[0] < 60.0
    assert report.seconds == pytest.approx(60.0 - allowed[0], abs=0.05)  # the pass, reported as the fit's time


def test_a_graph_that_refuses_channels_last_is_fitted_in_standard_strides():
    """A flat `view` of a feature map needs standard strides: the fit runs the graphs as they are."""
    torch.manual_seed(0)

    class Flat(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.fc = torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.Linear(4 * 16 * 16, 5)

        def forward(self, x):
            y = torch.relu(self.conv(x))
            return self.fc(y.view(y.shape[0], -1))

    x = images(64)
    gm, pruned = (torch.export.export(Flat().eval(), (x[:2],), dynamic_shapes=({0: torch.export.Dim("batch")},))
                  .module() for _ in range(2))  # two draws of weights: the second is fitted to the first
    with pytest.raises(RuntimeError):  # the premise: channels-last strides break this graph
        pruned.to(memory_format=torch.channels_last)(x[:2].contiguous(memory_format=torch.channels_last))
    pruned.to(memory_format=torch.contiguous_format)
    seen = _inputs_seen(pruned)
    fit = reconstruct_graph(pruned, gm, x, dataclasses.replace(graph_config(100), sequences=16), CPU)
    assert fit.kept and fit.after < fit.before
    assert seen and all(t.is_contiguous() for t in seen)
    assert all(p.is_contiguous() for p in pruned.parameters())


def test_views_are_asked_of_image_batches_alone():
    """A graph fed other than (N, C, H, W) images (here a Linear stack on vectors) fits its inputs as they are."""
    torch.manual_seed(0)
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))

    def program() -> torch.fx.GraphModule:
        stack = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        return torch.export.export(stack, (x[:2],), dynamic_shapes=({0: torch.export.Dim("batch")},)).module()

    gm, pruned = program(), program()  # two draws of weights: the second is fitted to the first
    fit = reconstruct_graph(pruned, gm, x, dataclasses.replace(graph_config(AUGMENT_FROM), steps=AUGMENT_FROM,
                                                               sequences=16), CPU)
    assert fit.kept and fit.after < 0.5 * fit.before


def test_the_fit_lifts_resnet20s_top1(shared_data):
    """The real thing: ResNet-20 (CIFAR-10) at half its in-block channels, 500 calibration images, top-1
    on the first 1,017 test images (dense 91.6 %)."""
    from compressor.calibration import load_images
    from compressor.cnn.models import load_model

    gm = load_model(shared_data / "resnet-cifar10" / "resnet20.pt2").module
    kwargs = {"mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}
    x = load_images(shared_data / "cifar10" / "train_prefix_5085.npz", samples=500, seed=0, **kwargs)
    test = shared_data / "cifar10" / "test_first1017.npz"
    ex, labels = load_images(test, samples=10**9, **kwargs), np.load(test)["y"]

    def top1(module) -> float:
        with torch.no_grad():
            return float((module(ex).argmax(1).numpy() == labels).mean())

    pruned, _ = prune_conv_graph(gm, x, 0.5, batch_size=100)
    before = top1(pruned)
    fit = reconstruct_graph(pruned, gm, x, graph_config(100), CPU)
    assert fit.kept and fit.after < 0.8 * fit.before
    assert top1(pruned) > before + 0.02


def test_a_fit_that_cannot_improve_is_dropped():
    """A huge step size makes every check worse: the solve's weights come back unchanged."""
    gm = exported("bottleneck")
    x = images(64)
    pruned, _ = prune_conv_graph(gm, x, 0.5, method="osscar", batch_size=64)
    weights = {k: v.clone() for k, v in pruned.state_dict().items()}
    fit = reconstruct_graph(pruned, gm, x, RefineConfig(steps=20, sequences=16, lr=50.0, backoff=0.99), CPU)
    assert not fit.kept and fit.after == fit.before
    assert all(torch.equal(v, pruned.state_dict()[k]) for k, v in weights.items())
    assert not any(p.requires_grad for p in pruned.parameters())


def test_the_pipeline_reports_the_fit_and_refuses_it_for_magnitude_pruning():
    gm = exported("bottleneck")
    x = images(64)
    records: list[Progress] = []
    _, reports = prune_conv_graph(gm, x, 0.5, batch_size=64, refine=RefineConfig(steps=30, sequences=16),
                                  progress=records.append)
    assert reports[-1].refine is not None and reports[-1].refine.steps == 30
    assert all(r.refine is None for r in reports[:-1])
    fits = [r for r in records if r.stage == RECONSTRUCTION]
    assert [(r.unit, r.numbers["steps"]) for r in fits] == [("graph", 30)]
    with pytest.raises(InputError, match="does not apply to method 'mp'"):
        prune_conv_graph(gm, x, 0.5, method="mp", refine=RefineConfig(steps=5))


def test_a_solve_fitted_later_equals_the_pipelines_solve_and_fit():
    """A depth trial's solves (no fit) fitted afterwards by `fit_conv_graph` give the weights and reports that
    `prune_conv_graph` gives with the fit: the round after a trial skips the solves and loses nothing."""
    gm = exported("bottleneck")
    x = images(64)
    refine = RefineConfig(steps=30, sequences=16)
    torch.manual_seed(0)
    whole, whole_reports = prune_conv_graph(gm, x, 0.5, batch_size=64, refine=refine)
    solved, solved_reports = prune_conv_graph(gm, x, 0.5, batch_size=64)
    assert solved_reports[-1].refine is None
    torch.manual_seed(0)
    later, later_reports = fit_conv_graph(solved, solved_reports, gm, x, refine, batch_size=64)
    assert later is solved and later_reports[-1].refine is not None and later_reports[-1].refine.steps == 30
    assert later_reports[-1].refine.after == whole_reports[-1].refine.after
    assert all(torch.equal(v, later.state_dict()[k]) for k, v in whole.state_dict().items())
    assert [r.width_after for r in later_reports] == [r.width_after for r in whole_reports]
    # nothing narrowed and no block removed: nothing to fit
    dense, dense_reports = prune_conv_graph(gm, x, 0.0, batch_size=64)
    assert fit_conv_graph(dense, dense_reports, gm, x, refine, batch_size=64)[1][-1].refine is None
