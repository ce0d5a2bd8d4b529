"""The sequential channel-pruning pipeline."""

import numpy as np
import pytest
import torch

from compressor.calibration import load_images
from compressor.cnn.graph import analyse, residual_add
from compressor.cnn.pipeline import prune_conv_graph, resize_conv_graph
from compressor.layerstats import num_to_prune
from compressor.modules import count_parameters

from .conv_models import EXPECTED_UNITS, exported, prefix_module


def test_num_to_prune_rounds_and_keeps_one():
    assert [num_to_prune(16, r) for r in (0.0, 0.3, 0.5, 0.7, 0.99)] == [0, 5, 8, 11, 15]
    assert num_to_prune(1, 0.9) == 0


def test_prefix_module_computes_the_consumer_input():
    gm = exported("bottleneck")
    x = torch.randn(2, 3, 16, 16)
    for unit in analyse(gm).units:
        spec = unit.consumer
        inputs = prefix_module(gm, spec.node.args[0])(x)
        outputs = prefix_module(gm, spec.node)(x)
        assert inputs.shape[1] == unit.channels
        w = gm.get_parameter(spec.weight)
        expected = torch.nn.functional.conv2d(inputs, w, None, spec.stride, spec.padding, spec.dilation)
        torch.testing.assert_close(outputs, expected)


@pytest.mark.parametrize("name", sorted(EXPECTED_UNITS))
@pytest.mark.parametrize("method", ["osscar", "mp+"])
def test_every_unit_is_pruned_and_the_model_still_runs(name, method):
    gm = exported(name)
    images = torch.randn(64, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    pruned, reports = prune_conv_graph(gm, images, 0.5, method=method, batch_size=32)
    units = analyse(gm).units
    assert [r.name for r in reports] == [u.name for u in units]
    assert [r.width_after for r in reports] == [u.channels - num_to_prune(u.channels, 0.5) for u in units]
    assert count_parameters(pruned) < count_parameters(gm)
    assert all(0 <= r.relative_error < 1.5 for r in reports)
    assert pruned(images[:4]).shape == gm(images[:4]).shape
    # the input graph is left as it was
    assert count_parameters(exported(name)) == count_parameters(gm)


def test_bad_ratio_and_unprunable_graph_are_refused():
    with pytest.raises(ValueError, match="uniform ratio"):
        prune_conv_graph(exported("folded_pad"), torch.randn(4, 3, 16, 16), 1.0)

    class Single(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3)

        def forward(self, x):
            return self.conv(x)

    from compressor.cnn.models import export_module
    with pytest.raises(ValueError, match="no prunable conv channels"):
        prune_conv_graph(export_module(Single(), torch.randn(2, 3, 8, 8)), torch.randn(4, 3, 8, 8), 0.5)


def test_resnet20_osscar_beats_mp_plus_with_coupled_streams_and_keeps_accuracy(shared_data):
    """Inner block channels at half, the three residual streams (coupled groups, option-A shortcuts and
    the classifier among their consumers) at three quarters."""
    gm = torch.export.load(str(shared_data / "resnet-cifar10" / "resnet20.pt2")).module()
    cal = load_images(shared_data / "cifar10" / "train_prefix_5085.npz", samples=200)
    test = np.load(shared_data / "cifar10" / "test_first1017.npz")
    x = load_images(shared_data / "cifar10" / "test_first1017.npz", samples=300, seed=1)
    order = np.sort(np.random.default_rng(1).permutation(len(test["y"]))[:300])
    y = torch.from_numpy(test["y"][order])
    groups = analyse(gm).units
    plan = {u.name: u.channels * 3 // 4 if u.coupled else u.channels // 2 for u in groups}
    results = {}
    for method in ("osscar", "mp+"):
        pruned, reports = prune_conv_graph(gm, cal, plan, method=method)
        with torch.no_grad():
            results[method] = (float((pruned(x).argmax(1) == y).float().mean()), reports)
    osscar, mp_plus = results["osscar"][1], results["mp+"][1]
    assert [r.width_after for r in osscar] == [plan[u.name] for u in groups]
    assert sum(r.kind == "coupled_channels" for r in osscar) == 3
    # no worse than mp+ (the stem's coupled group keeps the same channels by both: equal up to the last bits, 1.7e-16
    # apart on the VM of 2026-12-07, either way round on another CPU's kernels)
    assert all(a.relative_error <= b.relative_error * (1 + 1e-9)
               for a, b in zip(osscar[:2], mp_plus[:2], strict=True))
    # dense 91.6%; measured 66.7% (osscar) and 57.3% (mp+) on these 300 images
    assert results["osscar"][0] > max(0.60, results["mp+"][0])


@pytest.mark.parametrize("name", ["option_a", "mobilenet_v2"])
@pytest.mark.parametrize("method", ["osscar", "mp+"])
def test_coupled_groups_prune_export_and_match_onnx(name, method, tmp_path):
    """Option-A shortcuts and a MobileNetV2 (ReLU6 as clamp, hardswish, a sigmoid gate, scalar and
    per-channel pointwise ops): every group pruned, the model saves, exports and matches ONNX Runtime."""
    from compressor.cnn.models import save_program
    from exporters.onnx import check_parity, export_onnx

    gm = exported(name)
    # enough images for the squeeze-excitation's first conv, which sees one pooled row per image
    images = torch.randn(160, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    pruned, reports = prune_conv_graph(gm, images, 0.5, method=method, batch_size=40)
    assert [r.name for r in reports] == EXPECTED_UNITS[name]
    assert all(r.width_after < r.width_before for r in reports)
    assert count_parameters(pruned) < 0.5 * count_parameters(gm)
    save_program(pruned, tmp_path / "model.pt2", images[:2])
    reloaded = torch.export.load(str(tmp_path / "model.pt2")).module()
    torch.testing.assert_close(reloaded(images[:5]), pruned(images[:5]), rtol=1e-5, atol=1e-5)
    export_onnx(pruned, images[:2], tmp_path / "model.onnx")
    assert check_parity(pruned, tmp_path / "model.onnx", images[:7]).max_abs_error < 1e-4


def test_mobilenet_v2_every_expansion_and_projection_conv_is_prunable():
    gm = exported("mobilenet_v2")
    analysis = analyse(gm)
    producers = {p.name for u in analysis.units for p in u.producers}
    consumers = {c.name for u in analysis.units for c in u.consumers}
    convs = [f"blocks.{b}.{role}" for b in range(5) for role in ("expand", "project") if (b, role) != (0, "expand")]
    assert set(convs) <= producers and set(convs) <= consumers
    assert analysis.refused == {"stem": "its input channels are the model's input"}


def test_a_coupled_group_is_one_support_for_the_summed_objective():
    """combine(): for any support, the combined problem's objective at its least-squares weight is the
    sum of the consumers' own; the weight splits into each consumer's own refit; MP+ ranks channels by
    the summed squared norms of the consumers' weights."""
    from compressor.cnn.pipeline import combine
    from compressor.layerstats import FinishedStatistics
    from compressor.solver import solve_layer

    gen = torch.Generator().manual_seed(3)
    channels, parts, own = 6, [], []
    for g, d2 in ((9, 4), (1, 3), (4, 5)):
        X = torch.randn(200, channels * g, generator=gen, dtype=torch.float64)
        W = torch.randn(channels * g, d2, generator=gen, dtype=torch.float64)
        H, G = X.T @ X, X.T @ X @ W
        parts.append((FinishedStatistics(H, G, 0.5 * float((X @ W).square().sum()), X.mean(0), (X @ W).mean(0)),
                      W, None))
        own.append((H, G, W, g))
    problem = combine(parts, channels)
    assert problem.group_size == 14 and problem.stats.H.shape == (84, 84)
    for method in ("exact", "mp+"):
        sol = solve_layer(problem.stats.H, problem.stats.G, 14, 2, method, dense_weight=problem.W_hat)
        keep = [c for c in range(channels) if c not in sol.pruned]
        total = 0.0
        for i, (H, G, _, g) in enumerate(own):
            rows = torch.tensor([c * g + k for c in keep for k in range(g)])
            W_i = torch.linalg.solve(H[rows][:, rows], G[rows])
            total += float(-0.5 * (G[rows] * W_i).sum())  # f at the optimum: -1/2 Tr(G_S^T W_S)
            got = sol.weight[problem.rows(i, channels)][:, problem.columns[i]][rows]
            torch.testing.assert_close(got, W_i, rtol=1e-6, atol=1e-6)
        assert sol.objective == pytest.approx(total, rel=1e-8)
        if method == "mp+":
            norms = sum(W.reshape(channels, g, -1).square().sum((1, 2)) for _, _, W, g in own)
            assert sorted(sol.pruned) == sorted(torch.topk(norms, 2, largest=False).indices.tolist())


def test_an_in_block_group_is_observed_with_the_residual_stream_it_joins():
    gm = exported("option_a")
    images = torch.randn(32, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    seen = []
    prune_conv_graph(gm, images, 0.0, batch_size=16, observe=seen.append)
    by_name = {o.name: o for o in seen}
    # layerN.M.conv2 -> BN -> add: its error is felt against the stream there; a stream group has none
    inner = [o for o in seen if o.kind == "conv_channels"]
    assert inner and all(o.stream_energy is not None and o.stream_energy > 0 for o in inner)
    assert all(o.stream_energy is None for o in seen if o.kind == "coupled_channels")
    # the stream at the add carries the branch plus the shortcut: more energy than the branch alone here
    assert by_name["layer1.1.conv2"].stream_energy > by_name["layer1.1.conv2"].energy
    gm_add = next(u for u in analyse(gm).units if u.name == "layer1.1.conv2")
    assert residual_add(gm_add.consumer.node).target == torch.ops.aten.add.Tensor


@pytest.mark.parametrize("name", sorted(EXPECTED_UNITS))
def test_a_resized_graph_has_the_pruned_graphs_structure(name):
    """Latency probes measure resize_conv_graph: every weight and buffer shape must be what pruning to the
    same widths returns (the latency depends on the shapes alone), and it must run."""
    gm = exported(name)
    images = torch.randn(32, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    pruned, reports = prune_conv_graph(gm, images, 0.5, method="mp+", batch_size=32)
    plan = {r.name: r.width_after for r in reports}
    resized = resize_conv_graph(gm, plan)

    def shapes(module) -> dict:
        return {k: tuple(v.shape) for k, v in module.state_dict().items() if "output_shift" not in k}

    assert {k: v for k, v in shapes(pruned).items() if k in shapes(resized)} == shapes(resized)
    assert count_parameters(resized) <= count_parameters(pruned)  # the solve may add intercepts only
    assert resized(images[:2]).shape == gm(images[:2]).shape
    assert count_parameters(exported(name)) == count_parameters(gm)  # the input graph is left as it was


def test_convnext_blocks_prune_their_inner_neurons_channels_last_and_export(tmp_path):
    """ConvNeXt's Linear -> GELU -> Linear at every position of a channels-last map: each block's hidden
    neurons are a unit (the stream, normalised over its channels by a LayerNorm, is not); pruned by osscar with
    less error than mp+, saved, exported and matched by ONNX Runtime."""
    from compressor.cnn.graph import LinearSpec
    from compressor.cnn.models import save_program
    from exporters.onnx import check_parity, export_onnx

    gm = exported("convnext")
    units = analyse(gm).units
    assert [(u.kind, u.channel_dim, u.channels) for u in units] == [("ffn_neurons", -1, 32)] * 2
    assert all(isinstance(p, LinearSpec) and p.spatial for u in units for p in u.producers)
    images = torch.randn(48, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    errors = {}
    for method in ("osscar", "mp+"):
        pruned, reports = prune_conv_graph(gm, images, 0.5, method=method, batch_size=16)
        assert [r.width_after for r in reports] == [16, 16] and [r.kind for r in reports] == ["ffn_neurons"] * 2
        errors[method] = [r.relative_error for r in reports]
    assert errors["osscar"][0] < errors["mp+"][0]  # the first block sees the same inputs under both methods
    save_program(pruned, tmp_path / "model.pt2", images[:2])
    reloaded = torch.export.load(str(tmp_path / "model.pt2")).module()
    torch.testing.assert_close(reloaded(images[:5]), pruned(images[:5]), rtol=1e-5, atol=1e-5)
    export_onnx(pruned, images[:2], tmp_path / "model.onnx")
    assert check_parity(pruned, tmp_path / "model.onnx", images[:7]).max_abs_error < 1e-4


def test_a_batch_norm_gamma_of_zero_leaves_a_finite_pruned_graph():
    """The channel solve weighs each output column by the next BatchNorm's gamma / sigma and unscales after: a gamma
    of exactly 0 (network slimming, zero-init residual BNs) gave 0 / 0, NaN in every activation after it."""
    gm = exported("option_a")
    zeroed = 0
    with torch.no_grad():
        for name, parameter in gm.named_parameters():
            if parameter.dim() == 1 and name.endswith(".weight") and "bn" in name:
                parameter[0] = 0.0
                zeroed += 1
    assert zeroed
    images = torch.randn(32, 3, 16, 16)
    pruned, _ = prune_conv_graph(gm, images, 0.5)
    assert all(torch.isfinite(t).all() for t in pruned.state_dict().values() if t.is_floating_point())
    assert torch.isfinite(pruned(images[:4])).all()
