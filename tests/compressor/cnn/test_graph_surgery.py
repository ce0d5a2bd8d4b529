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
    """The model with every consumer's dropped input channels zeroed (the reference of a group that no
    channel pad reads: then nothing else sees those channels)."""
    ref = copy.deepcopy(gm)
    for consumer in unit.consumers:
        w = get_tensor(ref, consumer.weight)
        dropped = torch.ones(w.shape[1], dtype=torch.bool)
        dropped[keep] = False
        w.data[:, dropped] = 0
    return ref


def removed_parameters(gm, unit, n_removed):
    """Parameters one removed channel of `unit` carries, from the shapes."""
    per_channel = 0
    for producer in unit.producers:
        per_channel += get_tensor(gm, producer.weight)[0].numel() + (1 if live_bias(producer) else 0)
    for node in unit.chain:
        if node.target in BATCH_NORM_OPS:
            per_channel += sum(1 for a in node.args[1:3] if a is not None)
        elif (spec := conv_spec(node)) is not None:
            per_channel += get_tensor(gm, spec.weight)[0].numel() + (1 if live_bias(spec) else 0)
    params = dict(gm.named_parameters())
    per_channel += sum(1 for target, _ in unit.params if target in params)
    both = 0  # a conv that reads and writes the group (a residual block without expansion) loses n x n twice
    for consumer in unit.consumers:
        w = get_tensor(gm, consumer.weight)
        per_channel += w.shape[0] * (w.shape[2] * w.shape[3] if w.dim() == 4 else 1)
        if consumer in unit.producers:
            both += w.shape[2] * w.shape[3]
    return per_channel * n_removed - both * n_removed**2


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
        assert all(get_tensor(gm, c.weight).shape[1] == keep.numel() for c in unit.consumers)
        assert count_parameters(gm) == expected_params
        if not unit.pads_in:  # a pad's zero channels for the removed ones: test_option_a_shortcut_...
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


def test_resnet20_groups_are_the_inner_block_channels_and_the_three_residual_streams(shared_data):
    gm = torch.export.load(str(shared_data / "resnet-cifar10" / "resnet20.pt2")).module()
    analysis = analyse(gm)
    inner = [u for u in analysis.units if not u.coupled]
    assert [u.name for u in inner] == [f"layer{s}.{b}.conv2" for s in (1, 2, 3) for b in range(3)]
    assert [u.channels for u in inner] == [16] * 3 + [32] * 3 + [64] * 3
    streams = {u.name: u for u in analysis.units if u.coupled}
    assert list(streams) == ["coupled:conv1", "coupled:layer2.0.conv2", "coupled:layer3.0.conv2"]
    first, second, third = streams.values()
    assert [p.name for p in first.producers] == ["conv1"] + [f"layer1.{b}.conv2" for b in range(3)]
    assert [c.name for c in first.consumers] == [f"layer1.{b}.conv1" for b in range(3)] + ["layer2.0.conv1"]
    assert [c.name for c in third.consumers] == ["layer3.1.conv1", "layer3.2.conv1", "linear"]  # the classifier
    # the option-A shortcuts link the streams: stage 1 -> 2 -> 3
    assert first.pads_in == second.pads_out and second.pads_in == third.pads_out and len(first.pads_in) == 1
    assert (first.pads_in[0].before, first.pads_in[0].in_channels, first.pads_in[0].out_channels) == (8, 16, 32)
    assert analysis.refused == {"conv1": "its input channels are the model's input"}


def _network(gm, x):
    with torch.no_grad():
        return gm(x)


def test_option_a_shortcut_maps_kept_channels_and_reads_zeros_for_removed_ones():
    """Pruning the stage-1 stream (read by the stride-2 zero-padding shortcut) and then the stage-2 stream
    (written by it): the shortcut becomes an index into its kept input channels plus a zero channel, and
    the network equals the dense one with those shortcut channels zeroed and the consumers' inputs zeroed."""
    from compressor.cnn.surgery import prune_group

    gm = exported("option_a")
    groups = {u.name: u for u in analyse(gm).units}
    identity = copy.deepcopy(gm)
    same = {u.name: u for u in analyse(identity).units}
    prune_group(identity, same["coupled:conv1"], list(range(8)))  # every channel kept: the same network
    torch.testing.assert_close(_network(identity, X), _network(gm, X), rtol=1e-6, atol=1e-6)
    assert any(n.target is torch.ops.aten.index_select.default for n in identity.graph.nodes)

    # reference: the dense network whose shortcut drops stage-1 channels {1, 4, 6} (they read zeros)
    # and whose stage-2 consumers ignore the stage-2 channels pruned below
    stage1_keep, stage2_keep = [0, 2, 3, 5, 7], [0, 1, 4, 5, 6, 9, 11, 12, 15]
    reference = copy.deepcopy(gm)
    mask = torch.ones(1, 8, 1, 1)
    mask[:, [1, 4, 6]] = 0
    pad = next(n for n in reference.graph.nodes if n.target is torch.ops.aten.pad.default)
    reference.register_buffer("shortcut_mask", mask)
    with reference.graph.inserting_before(pad):
        mask_node = reference.graph.get_attr("shortcut_mask")
        masked = reference.graph.call_function(torch.ops.aten.mul.Tensor, (pad.args[0], mask_node))
    pad.update_arg(0, masked)
    reference.recompile()
    first = groups["coupled:conv1"]
    reference = zero_consumer_inputs(reference, first, stage1_keep)
    reference = zero_consumer_inputs(reference, groups["coupled:layer2.0.conv2"], stage2_keep)
    prune_group(gm, first, stage1_keep)
    prune_group(gm, groups["coupled:layer2.0.conv2"], stage2_keep)
    torch.testing.assert_close(_network(gm, X), _network(reference, X), rtol=1e-5, atol=1e-5)
    assert get_tensor(gm, "linear.weight").shape == (5, len(stage2_keep))


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


def test_pointwise_ops_are_recognised_by_rule_and_unknown_ops_are_refused_by_name():
    from compressor.cnn.models import export_module

    class Ops(torch.nn.Module):
        def __init__(self, tail):
            super().__init__()
            self.a = torch.nn.Conv2d(3, 8, 3, padding=1)
            self.b = torch.nn.Conv2d(8, 4, 1)
            self.scale = torch.nn.Parameter(torch.rand(8, 1, 1) + 0.5)
            self.tail = tail

        def forward(self, x):
            y = self.a(x)
            y = torch.nn.functional.hardtanh(y, -2, 2) * 0.5 + 1.0  # unary and scalar binary ops
            y = torch.sigmoid(y) * self.scale - torch.nn.functional.hardsigmoid(y)  # per-channel parameter
            y = torch.nn.functional.elu(torch.clamp(y, 0, 6)).pow(2)
            return self.b(self.tail(y)).mean((2, 3))

    x = torch.randn(2, 3, 8, 8)
    ok = analyse(export_module(Ops(lambda y: torch.nn.functional.dropout(y, 0.1, training=False)), x))
    assert [u.name for u in ok.units] == ["b"] and ok.units[0].params == (("scale", 0),)
    gm = export_module(Ops(lambda y: y), x)
    unit = analyse(gm).units[0]
    reference = zero_consumer_inputs(gm, unit, [0, 2, 5])
    prune_unit(gm, unit, [0, 2, 5])
    torch.testing.assert_close(gm(x), reference(x), rtol=1e-5, atol=1e-5)

    refused = analyse(export_module(Ops(lambda y: torch.cumsum(y, 1)), x)).refused["b"]
    assert "cumsum" in refused and "is not channel-wise" in refused and "pointwise" in refused
    refused = analyse(export_module(Ops(lambda y: torch.cat([y[:, :4], y[:, 4:]], 1)), x)).refused["b"]
    assert "aten.cat.default" in refused or "slices channels" in refused
    other = torch.rand(1, 1, 8, 8)
    refused = analyse(export_module(Ops(lambda y: y * torch.cat([other] * 8, 1).flip(3)), x)).refused["b"]
    assert "neither a scalar nor per-channel" in refused or "computed constant" in refused


def test_channels_no_conv_reads_say_why_under_the_convs_that_write_them():
    """Output channels read by a grouped conv, a transposed conv or a flatten of a 2 x 3 map stay: their writer was
    missing from not_pruned (nothing was keyed but consumer convs), and a grouped conv was named by its FX node."""
    from compressor.cnn.models import export_module

    class Readers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Conv2d(3, 8, 3, padding=1)
            self.grouped = torch.nn.Conv2d(8, 8, 3, padding=1, groups=4)
            self.b = torch.nn.Conv2d(8, 8, 1)
            self.up = torch.nn.ConvTranspose2d(8, 4, 2, stride=2)
            self.c = torch.nn.Conv2d(4, 6, 3, padding=1)
            self.fc = torch.nn.Linear(6 * 2 * 3, 5)

        def forward(self, x):
            y = self.up(self.b(self.grouped(self.a(x))))
            y = torch.nn.functional.adaptive_avg_pool2d(self.c(y), (2, 3))
            return self.fc(y.flatten(1))

    refused = analyse(export_module(Readers(), torch.randn(2, 3, 8, 12))).refused
    assert refused["a"] == "its input channels are the model's input; its output channels: grouped is a grouped " \
                           "conv (groups=4)"
    assert refused["b"].startswith("its input channels: grouped is a grouped conv (groups=4); its output channels: ")
    assert "conv_transpose2d" in refused["b"]
    assert "; its output channels: flatten" in refused["c"]


class _RootConvs(torch.nn.Module):
    """Bias-free convs whose weights the root module holds (F.conv2d), no BatchNorm after them."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = torch.nn.Parameter(torch.randn(8, 3, 3, 3, generator=g) * 0.3)
        self.w2 = torch.nn.Parameter(torch.randn(8, 8, 3, 3, generator=g) * 0.2)
        self.w3 = torch.nn.Parameter(torch.randn(8, 8, 3, 3, generator=g) * 0.2)
        self.w4 = torch.nn.Parameter(torch.randn(8, 8, 3, 3, generator=g) * 0.2)
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        for w in (self.w1, self.w2, self.w3, self.w4):
            x = torch.nn.functional.relu(torch.nn.functional.conv2d(x, w, padding=1))
        return self.fc(x.mean((2, 3)))


def test_each_conv_given_an_intercept_gets_its_own_parameter():
    """The intercepts of convs one module holds the weights of were all named `output_shift`: the last one
    registered replaced the others', which two convs then read."""
    from compressor.cnn.models import export_module
    from compressor.cnn.pipeline import prune_conv_graph

    gm = export_module(_RootConvs().eval(), torch.randn(2, 3, 8, 8))
    pruned, _ = prune_conv_graph(gm, torch.randn(64, 3, 8, 8), 0.5, method="osscar")
    biases = [n.args[2].target for n in pruned.graph.nodes if n.target == torch.ops.aten.conv2d.default
              and len(n.args) > 2 and n.args[2] is not None]
    assert len(biases) >= 3 and len(set(biases)) == len(biases), biases


class _PaddedFeatures(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2 = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Conv2d(8, 8, 3, padding=1)
        self.fc = torch.nn.Linear(10, 4)

    def forward(self, x):
        features = torch.relu(self.c2(torch.relu(self.c1(x)))).mean((2, 3))  # (N, 8)
        return self.fc(torch.nn.functional.pad(features, (1, 1)))  # (N, 10): the pad is of the channels


def test_a_two_number_pad_of_a_feature_vector_pads_its_channels():
    """Pads pair with the last dims first: (1, 1) on (N, C) pads C, not space (the group took fc to read 8
    channels where it reads 10, shifted by one, and surgery broke the model)."""
    from compressor.cnn.models import export_module
    from compressor.cnn.pipeline import prune_conv_graph

    torch.manual_seed(0)
    gm = export_module(_PaddedFeatures().eval(), torch.randn(2, 3, 8, 8))
    # what fc reads is written by the pad alone, no conv: not a group (c2's channels reach fc only through it)
    assert not [u for u in analyse(gm).units if any(c.name == "fc" for c in u.consumers)]
    pruned, reports = prune_conv_graph(gm, torch.randn(32, 3, 8, 8), 0.5, method="osscar")
    assert any(r.width_after < r.width_before for r in reports)  # c1's channels, which c2 reads
    assert pruned(torch.randn(2, 3, 8, 8)).shape == (2, 4) and pruned.fc.weight.shape == (4, 10)


def test_in_place_dropout_batch_norms_of_batch_statistics_shared_and_odd_convs_are_named_and_the_rest_pruned():
    """An in-place dropout (HF MobileNets' classifier) kept the conv before it whole, blamed on "not channel-wise";
    a BatchNorm without running statistics was made unrunnable by the training-flag fix and crashed the surgery; a
    conv applied twice was sliced twice (an index error after a solve); an even kernel's padding="same" was refused
    under an FX node's name."""
    from compressor.cnn.models import export_module, to_inference_mode

    def cbr(i: int, o: int) -> torch.nn.Sequential:
        return torch.nn.Sequential(torch.nn.Conv2d(i, o, 3, padding=1, bias=False), torch.nn.BatchNorm2d(o),
                                   torch.nn.ReLU())

    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = cbr(3, 8)
            self.shared = torch.nn.Conv2d(8, 8, 3, padding=1)
            self.a = torch.nn.Conv2d(8, 8, 3, padding=1, bias=False)
            self.stats = torch.nn.BatchNorm2d(8, track_running_stats=False)
            self.even = torch.nn.Conv2d(8, 8, 4, padding="same")
            self.b = cbr(8, 16)
            self.last = torch.nn.Conv2d(16, 32, 1)
            self.drop = torch.nn.Dropout(0.2, inplace=True)
            self.fc = torch.nn.Linear(32, 5)

        def forward(self, x):
            x = self.stem(x)
            x = torch.relu(self.shared(torch.relu(self.shared(x))))
            x = torch.relu(self.stats(self.a(x)))
            x = self.b(torch.relu(self.even(x)))
            return self.fc(self.drop(self.last(x).mean((2, 3))))

    x = torch.randn(2, 3, 8, 8)
    model = Odd().eval()
    gm = export_module(model, x)
    assert to_inference_mode(gm) == 0  # eval mode's batch statistics are not a training export's flag
    torch.testing.assert_close(gm(x), model(x))
    analysis = analyse(gm)
    # units are named by the conv reading the channels: b.0's output (read by last), and last's, read by fc through
    # the in-place dropout
    assert [(u.name, u.channels) for u in analysis.units] == [("last", 16), ("fc", 32)]
    refused = analysis.refused
    assert "its output channels: shared is applied 2 times (a shared weight)" in refused["stem.0"]
    assert "its output channels: stats is a BatchNorm without running statistics (track_running_stats=False)" in \
        refused["a"]
    assert refused["b.0"] == "even is a conv this tool does not edit (padding='same' with an even kernel pads one " \
                             "side more than the other)"
    for unit in analysis.units:
        reference = zero_consumer_inputs(gm, unit, [0, 2, 5])
        prune_unit(gm, unit, [0, 2, 5])
        torch.testing.assert_close(gm(x), reference(x), rtol=1e-5, atol=1e-5)
