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

from ..errors import UnsupportedArchitecture
from ..layerstats import (
    LayerObservation,
    LayerStatistics,
    Widths,
    check_plan,
    compute_device,
    kept_solution,
    planned_prune,
)
from ..reports import LayerReport
from ..solver import solve_layer
from .graph import BATCH_NORM_OPS, ChannelUnit, analyse
from .segments import GraphWalker
from .surgery import add_output_shift, get_tensor, prune_unit

log = logging.getLogger(__name__)


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
                      dense_inputs: list[Tensor], device: torch.device) -> tuple[LayerStatistics, Tensor]:
    """Statistics of one unit's consumer from its pruned and dense input batches (unfolded into
    kH kW patches), and W_hat as a (C_in kH kW, C_out) matrix with columns scaled by `scale`."""
    spec = unit.consumer
    kernel = W_hat.shape[2:]
    W_mat = W_hat.reshape(W_hat.shape[0], -1).T.to(device=device, dtype=torch.float64)
    if scale is not None:
        W_mat = W_mat * scale.to(device)  # solve for the conv + BN layer; unscaled after the solve
    stats = LayerStatistics(W_mat)

    def patches(x: Tensor) -> Tensor:  # (N, C, H, W) -> (N L, C kH kW)
        cols = F.unfold(x, kernel, dilation=spec.dilation, padding=spec.padding, stride=spec.stride)
        return cols.transpose(1, 2).reshape(-1, cols.shape[1]).to(torch.float64)

    for x, x_hat in zip(inputs, dense_inputs, strict=True):
        stats.add(patches(x.to(device)), patches(x_hat.to(device)))
    return stats, W_mat


def channel_cost(unit: ChannelUnit) -> float:
    """FLOPs (multiply-adds) one channel of `unit` costs per sample: its producer's output channel and
    the consumer's input channel (shapes from the exported graph's metadata)."""

    def spatial(node: fx.Node) -> int:
        val = node.meta.get("val")
        return int(val.shape[2] * val.shape[3]) if val is not None and val.dim() == 4 else 1

    def kernel(node: fx.Node) -> tuple[int, int]:
        weight = node.args[1].meta.get("val") if isinstance(node.args[1], fx.Node) else None
        return (int(weight.shape[1] * weight.shape[2] * weight.shape[3]), int(weight.shape[0])) \
            if weight is not None else (1, 1)

    produce_per_out, _ = kernel(unit.producer.node)  # Cin/groups kH kW per output channel
    consume_k, consume_out = kernel(unit.consumer.node)
    consume_per_in = consume_out * consume_k // max(1, unit.channels)  # Cout kH kW per input channel
    return float(produce_per_out * spatial(unit.producer.node) + consume_per_in * spatial(unit.consumer.node))


def prune_conv_graph(
    gm: fx.GraphModule,
    images: Tensor,
    ratio: Widths,
    *,
    method: str = "osscar",
    device: str | torch.device | None = None,
    batch_size: int = 100,
    weight_by_next_bn: bool = True,
    bias_correction: bool = True,
    progress: Callable[[str], None] | None = None,
    observe: Callable[[LayerObservation], None] | None = None,
) -> tuple[fx.GraphModule, list[LayerReport]]:
    """Prune the channels of every prunable unit of `gm` (`ratio`: a uniform ratio, or the kept
    channels of each unit by name); returns (pruned copy, reports). `observe` sees each layer's
    statistics before its solve (ratio 0 + observe = the dense statistics pass)."""
    check_plan(ratio)
    with torch.no_grad():
        return _prune_conv_graph(gm, images, ratio, method, device, batch_size, weight_by_next_bn,
                                 bias_correction, progress, observe)


def _prune_conv_graph(gm: fx.GraphModule, images: Tensor, ratio: Widths, method: str,
                      device: str | torch.device | None, batch_size: int, weight_by_next_bn: bool,
                      bias_correction: bool, progress: Callable[[str], None] | None,
                      observe: Callable[[LayerObservation], None] | None,
                      ) -> tuple[fx.GraphModule, list[LayerReport]]:
    device = compute_device(device)
    dense = copy.deepcopy(gm).eval()
    pruned = copy.deepcopy(gm).eval()
    dense_units = analyse(dense).units
    units = analyse(pruned).units
    if not units:
        reasons = "; ".join(f"{k}: {v}" for k, v in analyse(pruned).refused.items())
        raise UnsupportedArchitecture(f"no prunable conv channels in this graph ({reasons or 'no convs'})")
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
        stats, W_hat = _layer_statistics(unit, W_dense, scale, inputs, dense_inputs, device)
        finished = stats.finish(center=bias_correction)
        g = int(W_hat.shape[0] // unit.channels)
        if observe:
            observe(LayerObservation(unit.name, "conv_channels", finished.H, finished.G, g, finished.energy,
                                     channel_cost(unit)))
        sol = solve_layer(finished.H, finished.G, g, planned_prune(unit.name, unit.channels, ratio), method,
                          dense_weight=W_hat)
        kept = kept_solution(sol, g, scale, finished)
        keep, W = kept.keep, kept.weight  # (kept kH kW, C_out)
        shift = kept.shift if bias_correction else None  # the intercept, C_out
        old = get_tensor(pruned, unit.consumer.weight)
        new_weight = W.T.reshape(old.shape[0], len(keep), *old.shape[2:]).to(dtype=old.dtype, device=old.device)
        prune_unit(pruned, unit, keep, new_weight)
        if shift is not None:
            add_output_shift(pruned, unit.consumer, shift.cpu())
        kept_channels = torch.tensor(keep)
        pruned_walk.replace(cut, [x.index_select(1, kept_channels) for x in inputs])  # kept channels unchanged
        report = LayerReport.measure(unit.name, "conv_channels", unit.channels, len(keep), sol.objective,
                                     finished.energy, start, kept=keep)
        reports.append(report)
        if progress:
            progress(f"[{index + 1}/{len(units)}] {unit.name}: {unit.channels} -> {len(keep)} channels, "
                     f"relative error {report.relative_error:.4f} ({report.seconds:.1f}s)")
    return pruned, reports
