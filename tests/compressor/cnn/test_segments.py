"""Segment-by-segment activations: the walker's values at a cut are the graph's own, only the live ones are
kept, and peeking, selecting channels and replacing a value act on exactly what they name."""

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from compressor.cnn.models import export_module
from compressor.cnn.segments import GraphWalker


class SizedReshape(nn.Module):
    """The batch size is read at the input and used after the convs (HF EfficientNet's classifier input is
    reshaped so): a scalar the walker carries across cuts, beside the tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.conv2 = nn.Conv2d(6, 4, 3, padding=1)

    def forward(self, x):
        batch = x.shape[0]
        y = self.conv2(F.relu(self.conv1(x)))
        return y.mean((2, 3)).reshape(batch, -1)


@pytest.fixture(scope="module")
def exported():
    """The exported model (read-only: the walker never changes the graph) and six inputs."""
    torch.manual_seed(0)
    x = torch.randn(6, 3, 8, 8)
    return export_module(SizedReshape().eval(), x[:2]), x


def _convs(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and "conv2d" in str(n.target)]


def _output(gm: fx.GraphModule) -> fx.Node:
    output = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    return output[0] if isinstance(output, tuple | list) else output


def _relu_of_conv1(gm: fx.GraphModule, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return F.relu(F.conv2d(x, gm.conv1.weight, gm.conv1.bias, padding=1))


def test_the_walker_carries_scalars_across_cuts_and_matches_the_graph(exported):
    gm, x = exported
    conv2 = _convs(gm)[1]
    assert any("sym_size" in str(n.target) for n in gm.graph.nodes)  # the scalar this test is about
    walker = GraphWalker(gm, x.split(4), torch.device("cpu"))
    values = walker.advance(conv2.args[0])  # conv2's input, with the batch size still live
    torch.testing.assert_close(torch.cat(values), _relu_of_conv1(gm, x))
    final = torch.cat(walker.advance(_output(gm)))
    with torch.no_grad():
        torch.testing.assert_close(final, gm(x))


def test_only_the_values_used_after_the_cut_are_kept(exported):
    gm, x = exported
    relu = _convs(gm)[1].args[0]
    walker = GraphWalker(gm, x.split(4), torch.device("cpu"))
    assert [n.op for n in walker.values] == ["placeholder"] and [v.shape[0] for v in walker.values[walker.at]] == [4, 2]
    walker.advance(relu)
    # the input and conv1's output are no longer needed; the batch size (a scalar per batch) still is
    size = next(n for n in gm.graph.nodes if "sym_size" in str(n.target))
    assert walker.values.keys() == {relu, size} and walker.at is relu
    assert walker.values[size] == [4, 2] and [v.shape[0] for v in walker.values[relu]] == [4, 2]
    with pytest.raises(ValueError, match="cannot go back"):
        walker.advance(_convs(gm)[0])


def test_peek_computes_later_values_per_batch_without_moving_the_cut(exported):
    gm, x = exported
    conv1, conv2 = _convs(gm)
    relu = conv2.args[0]
    walker = GraphWalker(gm, x.split(4), torch.device("cpu"))
    walker.advance(conv1)
    at, kept = walker.at, dict(walker.values)
    peeked = list(walker.peek([relu, conv1]))  # one later node, one live now
    assert len(peeked) == 2  # one list per batch
    torch.testing.assert_close(torch.cat([p[0] for p in peeked]), _relu_of_conv1(gm, x))
    torch.testing.assert_close(torch.cat([p[1] for p in peeked]), torch.cat(kept[conv1]))
    assert walker.at is at and walker.values.keys() == kept.keys()  # the cut did not move
    walker.advance(relu)
    with pytest.raises(ValueError, match="live or after the cut"):
        next(walker.peek([conv1]))  # computed before the cut and no longer live


def test_select_channels_and_replace_change_only_the_named_live_values(exported):
    gm, x = exported
    relu = _convs(gm)[1].args[0]
    walker = GraphWalker(gm, x.split(4), torch.device("cpu"))
    before = torch.cat(walker.advance(relu))
    keep = torch.tensor([0, 2, 5])
    walker.select_channels(frozenset({relu.name, "no_such_node"}), keep)
    torch.testing.assert_close(torch.cat(walker.values[relu]), before[:, keep])
    assert [v for n, v in walker.values.items() if n is not relu] == [[4, 2]]  # the scalar is untouched
    zeros = [torch.zeros(4, 3, 8, 8), torch.zeros(2, 3, 8, 8)]
    walker.replace(relu, zeros)
    assert walker.values[relu] is zeros


def test_a_graph_with_two_inputs_is_refused():
    graph = fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    graph.output(graph.call_function(torch.add, (a, b)))
    with pytest.raises(ValueError, match="expected one graph input, found 2"):
        GraphWalker(fx.GraphModule(nn.Module(), graph), [torch.zeros(1)], torch.device("cpu"))
