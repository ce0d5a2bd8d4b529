"""Channel units, surgery, save/reload and ONNX parity on small conv graphs and ResNet-20."""

import copy

import pytest
import torch

from compressor.cnn.graph import BATCH_NORM_OPS, analyse, conv_spec
from compressor.cnn.models import save_program
from compressor.cnn.surgery import get_tensor, live_bias, prune_unit
from compressor.errors import SurgeryError
from compressor.modules import check_keep, count_parameters
from exporters.onnx import check_parity, export_onnx

from .conv_models import EXPECTED_UNITS, exported, prefix_module

X = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(1))


def zero_consumer_inputs(gm, unit, keep):
    """The dense model with the consumer's dropped input channels zeroed (the reference)."""
    ref = copy.deepcopy(gm)
    w = get_tensor(ref, unit.consumer.weight)
    dropped = torch.ones(w.shape[1], dtype=torch.bool)
    dropped[keep] = False
    w.data[:, dropped] = 0
    return ref


def removed_parameters(gm, unit, n_removed):
    """Parameters one removed channel of `unit` carries, from the shapes."""
    per_channel = get_tensor(gm, unit.producer.weight)[0].numel()
    per_channel += 1 if live_bias(unit.producer) else 0
    for node in unit.chain:
        if node.target in BATCH_NORM_OPS:
            per_channel += sum(1 for a in node.args[1:3] if a is not None)
        elif (spec := conv_spec(node)) is not None:
            per_channel += get_tensor(gm, spec.weight)[0].numel() + (1 if live_bias(spec) else 0)
    w = get_tensor(gm, unit.consumer.weight)
    per_channel += w.shape[0] * w.shape[2] * w.shape[3]
    return per_channel * n_removed


@pytest.mark.parametrize("name", sorted(EXPECTED_UNITS))
def test_analysis_finds_the_expected_units(name):
    analysis = analyse(exported(name))
    assert [u.name for u in analysis.units] == EXPECTED_UNITS[name]
    assert all(reason for reason in analysis.refused.values())


@pytest.mark.parametrize("name", sorted(EXPECTED_UNITS))
def test_pruning_equals_zeroed_channels_and_counts_parameters(name):
    gm = exported(name)
    gen = torch.Generator().manual_seed(2)
    for unit in analyse(gm).units:  # one unit after the other, on the same graph
        keep = torch.sort(torch.randperm(unit.channels, generator=gen)[: max(1, unit.channels // 2)]).values
        reference = zero_consumer_inputs(gm, unit, keep)
        expected_params = count_parameters(gm) - removed_parameters(gm, unit, unit.channels - keep.numel())
        prune_unit(gm, unit, keep)
        assert get_tensor(gm, unit.consumer.weight).shape[1] == keep.numel()
        assert count_parameters(gm) == expected_params
        torch.testing.assert_close(gm(X), reference(X), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def pruned_mobilenet(tmp_path_factory):
    gm = exported("mobilenet")
    for unit in analyse(gm).units:
        prune_unit(gm, unit, list(range(0, unit.channels, 3)))
    out = tmp_path_factory.mktemp("mobilenet")
    save_program(gm, out / "model.pt2", X[:2])
    export_onnx(gm, X[:2], out / "model.onnx")
    return gm, out


def test_pruned_model_saves_and_reloads_with_the_same_outputs(pruned_mobilenet):
    gm, out = pruned_mobilenet
    reloaded = torch.export.load(str(out / "model.pt2")).module()
    for batch in (1, 5):
        x = torch.randn(batch, 3, 16, 16)
        torch.testing.assert_close(reloaded(x), gm(x), rtol=1e-6, atol=1e-6)


def test_onnx_export_matches_pytorch_with_dynamic_batch(pruned_mobilenet):
    gm, out = pruned_mobilenet
    for batch in (1, 7):
        assert check_parity(gm, out / "model.onnx", torch.randn(batch, 3, 16, 16)).max_abs_error < 1e-4


def test_onnx_parity_gate_lists_mismatches(pruned_mobilenet):
    _, out = pruned_mobilenet
    other = exported("mobilenet")  # the unpruned model: same input, different outputs
    with pytest.raises(Exception, match="does not match PyTorch"):
        check_parity(other, out / "model.onnx", torch.randn(2, 3, 16, 16))


def test_check_keep_lists_every_bad_index():
    with pytest.raises(SurgeryError) as err:
        check_keep([0, 3, 3, 9, -1, 12], 8, "unit x")
    message = str(err.value)
    assert "[-1, 9, 12]" in message and "repeated indices: [3]" in message
    with pytest.raises(SurgeryError, match="no channel kept"):
        check_keep([], 8, "unit x")
    assert check_keep([5, 1], 8, "unit x").tolist() == [1, 5]


def test_resnet20_units_are_the_inner_block_channels(shared_data):
    gm = torch.export.load(str(shared_data / "resnet-cifar10" / "resnet20.pt2")).module()
    analysis = analyse(gm)
    assert [u.name for u in analysis.units] == [f"layer{s}.{b}.conv2" for s in (1, 2, 3) for b in range(3)]
    assert [u.channels for u in analysis.units] == [16] * 3 + [32] * 3 + [64] * 3
    assert "residual" in analysis.refused["layer1.1.conv1"]


@pytest.mark.parametrize("name,consumer", [
    ("bottleneck", "block1.conv2"),  # no bias, BatchNorm next: goes into its running mean
    ("folded_pad", "conv2"),  # conv with a bias
    ("mobilenet", "pw2"),  # no bias, no BatchNorm: a new bias parameter
])
def test_output_shift_adds_a_constant_to_the_conv_output(name, consumer):
    from compressor.cnn.surgery import add_output_shift

    gm = exported(name)
    unit = next(u for u in analyse(gm).units if u.name == consumer)
    out_channels = get_tensor(gm, unit.consumer.weight).shape[0]
    shift = torch.linspace(-1, 1, out_channels)
    conv_out = prefix_module(gm, unit.consumer.node)(X)
    after = next(iter(unit.consumer.node.users))
    reference = copy.deepcopy(gm)
    add_output_shift(gm, unit.consumer, shift)
    if after.target in BATCH_NORM_OPS:  # compare what the BatchNorm produces
        bn = torch.nn.functional.batch_norm(
            conv_out + shift.view(1, -1, 1, 1), *(get_tensor(reference, a.target) for a in after.args[3:5]),
            *(get_tensor(reference, a.target) for a in after.args[1:3]), eps=float(after.args[7]))
        torch.testing.assert_close(prefix_module(gm, after)(X), bn, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(prefix_module(gm, unit.consumer.node)(X), conv_out + shift.view(1, -1, 1, 1))
    assert gm(X).shape == reference(X).shape


def test_a_bias_added_by_surgery_is_pruned_with_its_conv():
    """A shift on a conv without bias or BatchNorm creates a bias; pruning that conv's outputs
    later (as a producer) must slice the new bias too."""
    from compressor.cnn.surgery import add_output_shift

    class Chain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Conv2d(3, 6, 3, padding=1, bias=False)
            self.b = torch.nn.Conv2d(6, 8, 3, padding=1, bias=False)
            self.c = torch.nn.Conv2d(8, 4, 1)

        def forward(self, x):
            return self.c(torch.relu(self.b(torch.relu(self.a(x))))).mean((2, 3))

    from compressor.cnn.models import export_module
    gm = export_module(Chain(), torch.randn(2, 3, 8, 8))
    first, second = analyse(gm).units  # a -> b, then b -> c
    prune_unit(gm, first, [0, 2, 4])
    add_output_shift(gm, first.consumer, torch.ones(8))  # b gets a new bias
    prune_unit(gm, second, [1, 3, 5, 7])  # b is the producer now
    assert gm(torch.randn(2, 3, 8, 8)).shape == (2, 4)
