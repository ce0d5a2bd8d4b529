"""Depth pruning (compressor/cnn/depth.py): which residual blocks are removable, removal as a zeroed branch,
the greedy choice, and a removed block's graph through channel pruning, reconstruction and ONNX."""

import copy

import pytest
import torch

from compressor.cnn.depth import choose_blocks, greedy_blocks, removal_losses, remove_blocks, residual_blocks
from compressor.cnn.graph import analyse
from compressor.cnn.models import export_module
from compressor.cnn.pipeline import prune_conv_graph
from compressor.errors import UnsupportedArchitecture
from compressor.modules import count_parameters
from compressor.progress import DEPTH
from compressor.refine import RefineConfig
from exporters.onnx import check_parity, export_onnx

from .conv_models import MODELS, exported, randomize_batch_norms

CPU = torch.device("cpu")


@pytest.mark.parametrize("name,blocks", [
    ("bottleneck", ["block1", "block2"]),
    ("option_a", ["layer1.0", "layer1.1", "layer2.1"]),  # layer2.0 subsamples and pads: never removable
    ("mobilenet", ["ir1", "ir2"]),
    ("folded_pad", []),
])
def test_removable_blocks_are_the_identity_shortcut_ones(name, blocks):
    assert [b.name for b in residual_blocks(exported(name))] == blocks


@pytest.mark.parametrize("name,block,module", [("option_a", "layer1.1", ("layer1", 1)),
                                               ("bottleneck", "block1", ("block1", None))])
def test_a_removed_block_is_its_shortcut_and_its_parameters_are_gone(name, block, module):
    """Removing a block = its branch contributing zero: relu(0 + x) for these blocks."""
    torch.manual_seed(0)
    model = randomize_batch_norms(MODELS[name]()).eval()
    gm = export_module(model, torch.randn(2, 3, 16, 16))
    removed = remove_blocks(gm, [block])
    reference = copy.deepcopy(model)
    parent, index = module
    stand_in = torch.nn.ReLU()
    if index is None:
        setattr(reference, parent, stand_in)
    else:
        getattr(reference, parent)[index] = stand_in
    x = torch.randn(5, 3, 16, 16)
    torch.testing.assert_close(removed(x), reference(x), rtol=1e-5, atol=1e-5)
    assert count_parameters(removed) == count_parameters(reference) < count_parameters(gm)
    assert not [k for k in removed.state_dict() if k.startswith(block + ".")]
    assert count_parameters(gm) == count_parameters(model)  # the original is untouched


@pytest.mark.parametrize("order", [["ir1", "ir2"], ["ir2", "ir1"]])
def test_chained_blocks_are_removed_together_in_either_order(order):
    """ir2's shortcut is ir1's add itself (no op between them, as in HF MobileNetV2): removing both leaves the
    stem's output where both adds were."""
    torch.manual_seed(0)
    model = randomize_batch_norms(MODELS["mobilenet"]()).eval()
    gm = export_module(model, torch.randn(2, 3, 16, 16))
    removed = remove_blocks(gm, order)
    reference = copy.deepcopy(model)
    reference.ir1, reference.ir2 = torch.nn.Identity(), torch.nn.Identity()
    x = torch.randn(5, 3, 16, 16)
    torch.testing.assert_close(removed(x), reference(x), rtol=1e-5, atol=1e-5)
    assert count_parameters(removed) == count_parameters(reference) < count_parameters(gm)
    assert residual_blocks(removed) == []


def test_unknown_blocks_and_too_many_are_refused_naming_the_known_ones():
    gm = exported("option_a")
    with pytest.raises(UnsupportedArchitecture, match=r"\['layer2.0'\].*layer1.0"):
        remove_blocks(gm, ["layer2.0"])
    with pytest.raises(UnsupportedArchitecture, match="4 residual blocks to remove, but this graph has 3"):
        choose_blocks(gm, torch.randn(8, 3, 16, 16), 4, device=CPU)


def test_the_block_that_changes_the_outputs_least_goes_first():
    torch.manual_seed(0)
    model = randomize_batch_norms(MODELS["option_a"]()).eval()
    with torch.no_grad():  # layer1.0's branch nearly silent: removing it changes almost nothing
        model.layer1[0].bn2.weight.mul_(1e-4)
        model.layer1[0].bn2.bias.zero_()
    gm = export_module(model, torch.randn(2, 3, 16, 16))
    records = []
    chosen = choose_blocks(gm, torch.randn(32, 3, 16, 16), 2, device=CPU, progress=records.append)
    assert chosen[0] == "layer1.0" and len(set(chosen)) == 2
    assert [(r.stage, r.unit, r.numbers["step"], r.numbers["steps"]) for r in records] == \
        [(DEPTH, chosen[0], 1, 2), (DEPTH, chosen[1], 2, 2)]


def test_removal_losses_are_branch_energy_relative_to_the_stream_it_writes():
    torch.manual_seed(0)
    model = randomize_batch_norms(MODELS["option_a"]()).eval()
    with torch.no_grad():  # layer1.0's branch silent: removing it costs nothing
        model.layer1[0].bn2.weight.zero_()
        model.layer1[0].bn2.bias.zero_()
    gm = export_module(model, torch.randn(2, 3, 16, 16))
    images = torch.randn(16, 3, 16, 16)
    losses = removal_losses(gm, images, device=CPU, batch_size=5)
    assert sorted(losses) == ["layer1.0", "layer1.1", "layer2.1"]
    assert losses["layer1.0"] == pytest.approx(0.0, abs=1e-12)
    with torch.no_grad():  # layer1.1 by hand: ||bn2(conv2(relu(bn1(conv1(x)))))||^2 / ||that + x||^2
        block = model.layer1[1]
        x = model.layer1[0](torch.relu(model.bn1(model.conv1(images))))
        branch = block.bn2(block.conv2(torch.relu(block.bn1(block.conv1(x)))))
        expected = float(branch.double().square().sum() / (branch + x).double().square().sum())
    assert losses["layer1.1"] == pytest.approx(expected, rel=1e-4)


def test_the_greedy_order_is_the_choice_one_block_at_a_time():
    gm = exported("option_a")
    images = torch.randn(16, 3, 16, 16)
    order = list(greedy_blocks(gm, images, device=CPU))
    assert [name for name, _ in order][:2] == choose_blocks(gm, images, 2, device=CPU)
    assert sorted(name for name, _ in order) == ["layer1.0", "layer1.1", "layer2.1"]
    assert all(error >= 0 for _, error in order)


def test_a_shallower_graph_is_channel_pruned_fitted_to_the_dense_one_and_exports(tmp_path):
    gm = exported("option_a")
    shallow = remove_blocks(gm, ["layer1.1"])
    assert "layer1.1.conv2" not in [u.name for u in analyse(shallow).units]
    images = torch.randn(48, 3, 16, 16)

    def error_to_dense(module) -> float:
        with torch.no_grad():
            dense_out = gm(images)
            return float((module(images) - dense_out).square().sum() / dense_out.square().sum())

    solved, _ = prune_conv_graph(shallow, images, 0.5, device=CPU, refine=RefineConfig(steps=0))
    fitted, reports = prune_conv_graph(shallow, images, 0.5, device=CPU, refine=RefineConfig(steps=30, sequences=8),
                                       teacher=gm)
    fit = reports[-1].refine
    assert fit is not None and fit.kept and fit.after < fit.before
    assert error_to_dense(fitted) < error_to_dense(solved)  # the fit's target was the dense graph
    path = tmp_path / "model.onnx"
    export_onnx(fitted, images[:2], path)
    assert check_parity(fitted, path, images[:4]).max_abs_error < 1e-4


class _Block(torch.nn.Module):
    def __init__(self, channels: int, in_place: bool, dropout: float = 0.0):
        super().__init__()
        self.in_place = in_place
        self.c1, self.c2 = (torch.nn.Conv2d(channels, channels, 3, padding=1) for _ in range(2))
        self.b1, self.b2 = torch.nn.BatchNorm2d(channels), torch.nn.BatchNorm2d(channels)
        # HF EfficientNet's stochastic depth: a Dropout ends each branch (the identity in eval)
        self.drop = torch.nn.Dropout(dropout) if dropout else torch.nn.Identity()

    def forward(self, x):
        out = self.drop(self.b2(self.c2(torch.relu(self.b1(self.c1(x))))))
        if self.in_place:
            out += x  # HF ResNet's `hidden_state += residual`
        else:
            out = out + x
        return torch.relu(out)


class _Net(torch.nn.Module):
    def __init__(self, in_place: bool, dropout: float = 0.0):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = torch.nn.Sequential(_Block(8, in_place, dropout), _Block(8, in_place, dropout))
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(self.blocks(torch.relu(self.stem(x))).mean((2, 3)))


def test_an_in_place_residual_add_is_priced_by_its_branch():
    """`out += x` writes the sum into the branch's tensor: read after the add, every block's removal loss
    was 1.0 (branch = stream), and depth was never chosen for such graphs."""
    torch.manual_seed(0)
    plain = _Net(in_place=False).eval()
    in_place = _Net(in_place=True).eval()
    in_place.load_state_dict(plain.state_dict())
    with torch.no_grad():
        for model in (plain, in_place):
            for block in model.blocks:
                block.b2.weight.mul_(0.1)
    images = torch.randn(16, 3, 8, 8)
    expected = removal_losses(export_module(plain, images[:2]), images, device=CPU)
    got = removal_losses(export_module(in_place, images[:2]), images, device=CPU)
    assert all(v < 0.5 for v in got.values()) and got == pytest.approx(expected, rel=1e-6)


def test_a_branch_ending_in_dropout_is_removed_with_its_weights():
    """An eval-mode Dropout at the end of a branch (HF EfficientNet's stochastic depth) is the identity, but FX
    counts a random op as impure: dead code elimination kept it and the whole branch above it, so the removed
    block's convs stayed in the graph, its parameters in the model and its units in the analysis."""
    torch.manual_seed(0)
    model = randomize_batch_norms(_Net(in_place=False, dropout=0.2)).eval()
    gm = export_module(model, torch.randn(2, 3, 8, 8))
    removed = remove_blocks(gm, ["blocks.0"])
    reference = copy.deepcopy(model)
    reference.blocks[0] = torch.nn.ReLU()  # relu(0 + x)
    x = torch.randn(4, 3, 8, 8)
    torch.testing.assert_close(removed(x), reference(x), rtol=1e-5, atol=1e-5)
    assert count_parameters(removed) == count_parameters(reference) < count_parameters(gm)
    assert not [k for k in removed.state_dict() if k.startswith("blocks.0.")]
    assert not [u.name for u in analyse(removed).units if u.name.removeprefix("coupled:").startswith("blocks.0.")]


def test_a_block_of_one_conv_and_linears_is_named_after_all_its_weights():
    """A ConvNeXt block's only conv is its depthwise one: named after it alone, the block was `blocks.0.dwconv`
    and its MLP unit (`blocks.0.pwconv2`) did not count as inside it, so planning kept the removed blocks' widths."""
    gm = exported("convnext")
    names = [b.name for b in residual_blocks(gm)]
    assert names == ["blocks.0", "blocks.1"]
    units = [u.name for u in analyse(gm).units]
    assert [u for u in units if u.startswith("blocks.0.")] == ["blocks.0.pwconv2"]  # inside its block

