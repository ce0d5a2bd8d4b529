"""Sequential channel pruning of a conv graph (paper appendix B.1, "pruning strategies").

Units are pruned one at a time in graph order. For each, H = X^T X comes from the *pruned* model's
input to the consumer conv (unfolded into kH kW patches) and G = X^T X_hat W_hat from the *dense*
model's input and weight, so every layer compensates the error of the layers pruned before it.
The solver picks the channels; surgery removes them through producer, chain and consumer, and the
consumer gets the solver's refit weight.

Memory: calibration images stay on the CPU and go to the compute device one batch at a time; only
H and G (d1 x d1 and d1 x C_out) are accumulated, no activations are kept.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, fx

from .graph import ChannelUnit, analyse
from .solve import solve_layer
from .surgery import get_tensor, prune_unit

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerReport:
    name: str  # the consumer conv
    kind: str  # "conv_channels"
    width_before: int
    width_after: int
    objective: float  # f(S) of the layer problem (minus 1/2 ||X_hat W_hat||^2, see solve_layer)
    relative_error: float  # ||X W - X_hat W_hat||^2 / ||X_hat W_hat||^2 on the calibration data
    seconds: float


def prefix_module(gm: fx.GraphModule, target: fx.Node) -> fx.GraphModule:
    """A GraphModule computing `target`'s value from the model input (shares gm's parameters)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            break
        if node.op == "call_module":  # shape guards of exported programs: not needed here
            continue
        env[node] = graph.node_copy(node, lambda n: env[n])
        if node is target:
            break
    graph.output(env[target])
    graph.eliminate_dead_code()
    return fx.GraphModule(gm, graph)


def num_to_prune(channels: int, ratio: float) -> int:
    """round(ratio * channels), keeping at least one channel."""
    return max(0, min(channels - 1, round(ratio * channels)))


def _layer_statistics(pruned: fx.GraphModule, dense: fx.GraphModule, unit: ChannelUnit, dense_unit: ChannelUnit,
                      images: Tensor, batch_size: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor, float]:
    """H, G, W_hat (float64, CPU) and 1/2 ||X_hat W_hat||^2 for one unit's consumer."""
    spec = unit.consumer
    W_hat = get_tensor(dense, dense_unit.consumer.weight).detach()  # (C_out, C_in, kH, kW)
    kernel = W_hat.shape[2:]
    W_mat = W_hat.reshape(W_hat.shape[0], -1).T.to(device=device, dtype=torch.float64)  # (C_in kH kW, C_out)
    pruned_in = prefix_module(pruned, spec.node.args[0]).to(device)
    dense_in = prefix_module(dense, dense_unit.consumer.node.args[0]).to(device)
    d1 = W_mat.shape[0]
    H = torch.zeros(d1, d1, dtype=torch.float64, device=device)
    G = torch.zeros(d1, W_mat.shape[1], dtype=torch.float64, device=device)
    energy = 0.0

    def patches(x: Tensor) -> Tensor:  # (N, C, H, W) -> (N L, C kH kW)
        cols = F.unfold(x, kernel, dilation=spec.dilation, padding=spec.padding, stride=spec.stride)
        return cols.transpose(1, 2).reshape(-1, cols.shape[1]).to(torch.float64)

    with torch.no_grad():
        for batch in images.split(batch_size):
            batch = batch.to(device)
            X = patches(pruned_in(batch))
            Y_hat = patches(dense_in(batch)) @ W_mat  # dense pre-bias output of the consumer
            H.addmm_(X.T, X)
            G.addmm_(X.T, Y_hat)
            energy += 0.5 * float(Y_hat.square().sum())
    return H, G, W_mat, energy


def prune_conv_graph(
    gm: fx.GraphModule,
    images: Tensor,
    ratio: float,
    *,
    method: str = "osscar",
    device: str | torch.device | None = None,
    batch_size: int = 100,
    progress: Callable[[str], None] | None = None,
) -> tuple[fx.GraphModule, list[LayerReport]]:
    """Prune `ratio` of the channels of every prunable unit of `gm`; returns (pruned copy, reports)."""
    if not 0 <= ratio < 1:
        raise ValueError(f"uniform ratio must be in [0, 1) (got {ratio})")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dense = copy.deepcopy(gm).eval()
    pruned = copy.deepcopy(gm).eval()
    dense_units = analyse(dense).units
    units = analyse(pruned).units
    if not units:
        reasons = "; ".join(f"{k}: {v}" for k, v in analyse(pruned).refused.items())
        raise ValueError(f"no prunable conv channels in this graph ({reasons or 'no convs'})")
    reports = []
    for index, (unit, dense_unit) in enumerate(zip(units, dense_units, strict=True)):
        start = time.perf_counter()
        # re-resolve the unit on the live graph: earlier surgery replaced parameters, not nodes
        H, G, W_hat, energy = _layer_statistics(pruned, dense, unit, dense_unit, images, batch_size, device)
        g = int(W_hat.shape[0] // unit.channels)
        k = num_to_prune(unit.channels, ratio)
        sol = solve_layer(H, G, g, k, method, dense_weight=W_hat)
        keep = [c for c in range(unit.channels) if c not in set(sol.pruned)]
        rows = torch.tensor([c * g + a for c in keep for a in range(g)], device=sol.weight.device)
        W = sol.weight.index_select(0, rows).T  # (C_out, kept kH kW)
        old = get_tensor(pruned, unit.consumer.weight)
        new_weight = W.reshape(old.shape[0], len(keep), *old.shape[2:]).to(old.dtype)
        prune_unit(pruned, unit, keep, new_weight.cpu() if old.device.type == "cpu" else new_weight)
        f0_plus = sol.objective + energy  # 1/2 ||X W - X_hat W_hat||^2
        report = LayerReport(unit.name, "conv_channels", unit.channels, len(keep), sol.objective,
                             max(0.0, f0_plus) / energy if energy > 0 else 0.0, time.perf_counter() - start)
        reports.append(report)
        if progress:
            progress(f"[{index + 1}/{len(units)}] {unit.name}: {unit.channels} -> {len(keep)} channels, "
                     f"relative error {report.relative_error:.4f} ({report.seconds:.1f}s)")
    return pruned, reports
