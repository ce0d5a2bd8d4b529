"""The sequential channel-pruning pipeline."""

import numpy as np
import pytest
import torch

from compressor.calibration import load_images
from compressor.cnn.graph import analyse
from compressor.cnn.pipeline import prune_conv_graph
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


def test_resnet20_osscar_beats_mp_plus_on_the_first_layer_and_keeps_accuracy(shared_data):
    gm = torch.export.load(str(shared_data / "resnet-cifar10" / "resnet20.pt2")).module()
    cal = load_images(shared_data / "cifar10" / "train_prefix_5085.npz", samples=200)
    test = np.load(shared_data / "cifar10" / "test_first1017.npz")
    x = load_images(shared_data / "cifar10" / "test_first1017.npz", samples=300, seed=1)
    order = np.sort(np.random.default_rng(1).permutation(len(test["y"]))[:300])
    y = torch.from_numpy(test["y"][order])
    results = {}
    for method in ("osscar", "mp+"):
        pruned, reports = prune_conv_graph(gm, cal, 0.5, method=method)
        with torch.no_grad():
            results[method] = (float((pruned(x).argmax(1) == y).float().mean()), reports)
    assert results["osscar"][1][0].relative_error <= results["mp+"][1][0].relative_error
    assert [r.width_after for r in results["osscar"][1]] == [8] * 3 + [16] * 3 + [32] * 3
    assert results["osscar"][0] > 0.70  # dense 91.6%; 80.7% with 500 calibration images on all 1,017
