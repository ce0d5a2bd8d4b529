"""Sequential channel pruning of a conv graph (paper appendix B.1, "pruning strategies").

Units are pruned one at a time in graph order. For each, H = X^T X comes from the *pruned* model's
input to the consumer conv (unfolded into kH kW patches) and G = X^T X_hat W_hat from the *dense*
model's input and weight, so every layer compensates the error of the layers pruned before it.
The solver picks the channels; surgery removes them through producer, chain and consumer, and the
consumer gets the solver's refit weight.

Memory: the dense and the pruned activations advance segment by segment (`segments.GraphWalker`):
only the values live at the current cut are kept, on the CPU, and only the running segment's
parameters are on the compute device, one calibration batch at a time.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, fx

from .graph import BATCH_NORM_OPS, ChannelUnit, analyse
from .reports import LayerReport
from .segments import GraphWalker
from .solve import solve_layer
from .surgery import add_output_shift, get_tensor, prune_unit

log = logging.getLogger(__name__)


def num_to_prune(channels: int, ratio: float) -> int:
    """round(ratio * channels), keeping at least one channel."""
    return max(0, min(channels - 1, round(ratio * channels)))


def output_scale(gm: fx.GraphModule, consumer: fx.Node) -> Tensor | None:
    """gamma / sqrt(var + eps) of the BatchNorm that alone consumes `consumer`'s output, if any.

    That BatchNorm scales each output channel before anything else sees it, so the error that reaches
    the network is the scaled one: the layer objective weights output column c by scale_c^2 (the
    conv + BN layer, as BN folding would make it). Columns are independent given the support, so
    the scaling changes which channels are kept, not the refit of each column.
    """
    if len(consumer.users) != 1:
        return None
    bn = next(iter(consumer.users))
    if bn.target not in BATCH_NORM_OPS or bn.args[0] is not consumer:
        return None
    eps_index = 7 if bn.target is torch.ops.aten.batch_norm.default else 6
    gamma = get_tensor(gm, bn.args[1].target) if isinstance(bn.args[1], fx.Node) else None
    var = get_tensor(gm, bn.args[4].target)
    scale = torch.rsqrt(var.double() + float(bn.args[eps_index]))
    return scale * gamma.double() if gamma is not None else scale


def _layer_statistics(unit: ChannelUnit, W_hat: Tensor, scale: Tensor | None, inputs: list[Tensor],
                      dense_inputs: list[Tensor], device: torch.device, center: bool,
                      ) -> tuple[Tensor, Tensor, Tensor, float, Tensor, Tensor]:
    """H, G (float64), W_hat as a (C_in kH kW, C_out) matrix (columns scaled by `scale`), the energy
    1/2 ||X_hat W_hat||^2 and the means of X and X_hat W_hat, from the consumer's pruned and dense
    input batches; with `center`, H and G are those of the centred data (a refit with intercept)."""
    spec = unit.consumer
    kernel = W_hat.shape[2:]
    W_mat = W_hat.reshape(W_hat.shape[0], -1).T.to(device=device, dtype=torch.float64)
    if scale is not None:
        W_mat = W_mat * scale.to(device)  # solve for the conv + BN layer; unscaled after the solve
    d1 = W_mat.shape[0]
    H = torch.zeros(d1, d1, dtype=torch.float64, device=device)
    G = torch.zeros(d1, W_mat.shape[1], dtype=torch.float64, device=device)
    sum_x = torch.zeros(d1, dtype=torch.float64, device=device)
    sum_y = torch.zeros(W_mat.shape[1], dtype=torch.float64, device=device)
    energy, rows = 0.0, 0

    def patches(x: Tensor) -> Tensor:  # (N, C, H, W) -> (N L, C kH kW)
        cols = F.unfold(x, kernel, dilation=spec.dilation, padding=spec.padding, stride=spec.stride)
        return cols.transpose(1, 2).reshape(-1, cols.shape[1]).to(torch.float64)

    for x, x_hat in zip(inputs, dense_inputs, strict=True):
        X = patches(x.to(device))
        Y_hat = patches(x_hat.to(device)) @ W_mat  # the dense layer's pre-bias output
        H.addmm_(X.T, X)
        G.addmm_(X.T, Y_hat)
        energy += 0.5 * float(Y_hat.square().sum())
        sum_x += X.sum(0)
        sum_y += Y_hat.sum(0)
        rows += X.shape[0]
    mu, nu = sum_x / rows, sum_y / rows
    if center:
        # least squares with an intercept = least squares on centred data, for every support
        H -= rows * torch.outer(mu, mu)
        H.diagonal().clamp_(min=0)  # constant features: zero variance, not -1e-12 from rounding
        G -= rows * torch.outer(mu, nu)
        energy -= 0.5 * rows * float(nu.square().sum())
    return H, G, W_mat, energy, mu, nu


def prune_conv_graph(
    gm: fx.GraphModule,
    images: Tensor,
    ratio: float,
    *,
    method: str = "osscar",
    device: str | torch.device | None = None,
    batch_size: int = 100,
    weight_by_next_bn: bool = True,
    bias_correction: bool = True,
    progress: Callable[[str], None] | None = None,
) -> tuple[fx.GraphModule, list[LayerReport]]:
    """Prune `ratio` of the channels of every prunable unit of `gm`; returns (pruned copy, reports)."""
    if not 0 <= ratio < 1:
        raise ValueError(f"uniform ratio must be in [0, 1) (got {ratio})")
    with torch.no_grad():
        return _prune_conv_graph(gm, images, ratio, method, device, batch_size, weight_by_next_bn,
                                 bias_correction, progress)


def _prune_conv_graph(gm: fx.GraphModule, images: Tensor, ratio: float, method: str,
                      device: str | torch.device | None, batch_size: int, weight_by_next_bn: bool,
                      bias_correction: bool, progress: Callable[[str], None] | None,
                      ) -> tuple[fx.GraphModule, list[LayerReport]]:
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dense = copy.deepcopy(gm).eval()
    pruned = copy.deepcopy(gm).eval()
    dense_units = analyse(dense).units
    units = analyse(pruned).units
    if not units:
        reasons = "; ".join(f"{k}: {v}" for k, v in analyse(pruned).refused.items())
        raise ValueError(f"no prunable conv channels in this graph ({reasons or 'no convs'})")
    if method == "mp":  # magnitude pruning stays what it is: no refit, no intercept, raw magnitudes
        weight_by_next_bn = bias_correction = False
    # dense and pruned activations advance cut by cut (cuts = consumer inputs, in graph order)
    order = {node: i for i, node in enumerate(pruned.graph.nodes)}
    pairs = sorted(zip(units, dense_units, strict=True), key=lambda p: order[p[0].consumer.node.args[0]])
    batches = images.split(batch_size)
    pruned_walk = GraphWalker(pruned, batches, device)
    dense_walk = GraphWalker(dense, batches, device)
    reports = []
    for index, (unit, dense_unit) in enumerate(pairs):
        start = time.perf_counter()
        cut = unit.consumer.node.args[0]
        inputs = pruned_walk.advance(cut)
        dense_inputs = dense_walk.advance(dense_unit.consumer.node.args[0])
        W_dense = get_tensor(dense, dense_unit.consumer.weight).detach()  # (C_out, C_in, kH, kW)
        scale = output_scale(dense, dense_unit.consumer.node) if weight_by_next_bn else None
        H, G, W_hat, energy, mu, nu = _layer_statistics(unit, W_dense, scale, inputs, dense_inputs, device,
                                                        bias_correction)
        g = int(W_hat.shape[0] // unit.channels)
        k = num_to_prune(unit.channels, ratio)
        sol = solve_layer(H, G, g, k, method, dense_weight=W_hat)
        keep = [c for c in range(unit.channels) if c not in set(sol.pruned)]
        rows = torch.tensor([c * g + a for c in keep for a in range(g)], device=sol.weight.device)
        W = sol.weight.index_select(0, rows)  # (kept kH kW, C_out)
        shift = (nu - mu @ sol.weight.to(mu.device)) if bias_correction else None  # intercept, C_out
        if scale is not None:
            W = W / scale.to(W.device)
            shift = None if shift is None else shift / scale.to(shift.device)
        old = get_tensor(pruned, unit.consumer.weight)
        new_weight = W.T.reshape(old.shape[0], len(keep), *old.shape[2:]).to(dtype=old.dtype, device=old.device)
        prune_unit(pruned, unit, keep, new_weight)
        if shift is not None:
            add_output_shift(pruned, unit.consumer, shift.cpu())
        kept = torch.tensor(keep)
        pruned_walk.replace(cut, [x.index_select(1, kept) for x in inputs])  # kept channels are unchanged
        report = LayerReport.measure(unit.name, "conv_channels", unit.channels, len(keep), sol.objective,
                                     energy, start)
        reports.append(report)
        if progress:
            progress(f"[{index + 1}/{len(units)}] {unit.name}: {unit.channels} -> {len(keep)} channels, "
                     f"relative error {report.relative_error:.4f} ({report.seconds:.1f}s)")
    return pruned, reports
