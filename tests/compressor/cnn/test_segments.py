"""Segment-by-segment activations: the walker's values at a cut are the graph's own."""

import torch
import torch.nn.functional as F
from torch import nn

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


def test_the_walker_carries_scalars_across_cuts_and_matches_the_graph():
    torch.manual_seed(0)
    x = torch.randn(6, 3, 8, 8)
    gm = export_module(SizedReshape().eval(), x[:2])
    conv2 = [n for n in gm.graph.nodes if n.op == "call_function" and "conv2d" in str(n.target)][1]
    assert any("sym_size" in str(n.target) for n in gm.graph.nodes)  # the scalar this test is about
    walker = GraphWalker(gm, x.split(4), torch.device("cpu"))
    values = walker.advance(conv2.args[0])  # conv2's input, with the batch size still live
    with torch.no_grad():
        expected = F.relu(F.conv2d(x, gm.conv1.weight, gm.conv1.bias, padding=1))
    torch.testing.assert_close(torch.cat(values), expected)
    output = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    output = output[0] if isinstance(output, tuple | list) else output
    final = torch.cat(walker.advance(output))
    with torch.no_grad():
        torch.testing.assert_close(final, gm(x))
