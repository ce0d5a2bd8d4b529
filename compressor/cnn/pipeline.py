"""Sequential channel pruning of a conv graph (paper appendix B.1, "pruning strategies").

Channel groups (`graph.analyse`: in-block units and coupled groups through residual adds) are pruned
one at a time, in graph order of their first consumer's input. For each consumer i, H_i = X_i^T X_i
comes from the *pruned* model's input to it (unfolded into kH kW patches; a Linear's pooled features as
they are) and G_i = X_i^T X_hat_i W_hat_i from the *dense* model's input and weight, so every layer
compensates the error of the layers pruned before it. The solver picks the channels; surgery removes
them from every producer, chain entry, pad and consumer, and each consumer gets its refit weight.

**Coupled groups: one shared support, the objective summed over consumers.** A group read by m
consumers is solved as one problem: f(S) = sum_i f_i(S), each f_i(W_i) = 1/2 Tr(W_i^T H_i W_i) -
Tr(G_i^T W_i) with its own statistics, and the support S (the kept channels) shared. `combine` places
the H_i block-diagonally (and the G_i, the dense W_hat_i, on their own output columns) and interleaves
the rows so that channel c's rows of every consumer form one contiguous group of g = sum_i g_i rows
(g_i = kH kW of consumer i, 1 for a Linear). Then, unchanged, the solver's state is the per-consumer
state side by side: H_SS^-1 of a block-diagonal H is block-diagonal, pruning or restoring channel c is a
rank-g update that is the m rank-g_i updates of the consumers at once, B_c (Lemma A.1) is the sum of the
consumers' impacts of c, and the optimal weight on S is each consumer's own least-squares refit
W_i = (H_i)_SS^-1 (G_i)_S. So OSSCAR's greedy and swaps search one support for the summed objective
with the low-rank updates of every consumer, and every consumer is refit (with its own intercept into
its BatchNorm or bias). MP+ on the same problem ranks channels by sum_i ||W_hat_i[c]||^2 (the squared
Frobenius norm of the group's rows), then refits every consumer. An in-block unit is the case m = 1.
An option-A shortcut that reads the group (into the next stage's stream) is one more reader in the sum,
a 1 x 1 identity on its subsampled input (`_shortcut`), so the channels it carries onward count; it
stays a selection (its refit is not applied).

Where a group is solved: at its first consumer's input (the cut). Inputs of its later consumers
(e.g. the next blocks' first convs on a residual stream) are computed ahead from the live values of
both models (`GraphWalker.peek`, one batch at a time), with the pruned model as it is at that moment;
the in-block units between them are pruned afterwards, each against the pruned stream.

Memory: the dense and the pruned activations advance segment by segment (`segments.GraphWalker`):
only the values live at the current cut are kept, on the CPU, and only the running segment's
parameters are on the compute device, one calibration batch at a time. A coupled group's problem has
C (sum_i g_i) rows (ResNet-56's last stage: 64 x 82 = 5,248).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, fx

from ..errors import UnsupportedArchitecture
from ..layerstats import (
    FinishedStatistics,
    KeptSolution,
    LayerObservation,
    LayerStatistics,
    Widths,
    check_plan,
    compute_device,
    floored_scale,
    planned_prune,
    prune_layer,
)
from ..progress import RECONSTRUCTION, Progress, ProgressFn, emit, warning
from ..refine import RefineConfig, check_method
from ..reports import LayerReport, fit_numbers
from .graph import BATCH_NORM_OPS, ChannelGroup, ChannelPad, Consumer, ConvSpec, LinearSpec, analyse, residual_add
from .refine import reconstruct_graph
from .segments import GraphWalker
from .surgery import add_output_shift, get_tensor, prune_group

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
    if bn.target not in BATCH_NORM_OPS or bn.args[0] is not consumer or not isinstance(bn.args[4], fx.Node):
        return None  # (no running variance: a BatchNorm of batch statistics scales by no fixed number)
    eps_index = 7 if bn.target is torch.ops.aten.batch_norm.default else 6
    gamma = get_tensor(gm, bn.args[1].target) if isinstance(bn.args[1], fx.Node) else None
    var = get_tensor(gm, bn.args[4].target)
    scale = torch.rsqrt(var.double() + float(bn.args[eps_index]))
    # floored: a channel whose gamma is 0 (network slimming, zero-init residual BNs) would unscale to 0 / 0
    return floored_scale(scale * gamma.double()) if gamma is not None else scale


def _dense_matrix(consumer: Consumer, W_hat: Tensor, scale: Tensor | None, device: torch.device) -> Tensor:
    """A consumer's dense weight as a (C_in kH kW, C_out) matrix (rows channel-major), columns scaled."""
    W_mat = W_hat.reshape(W_hat.shape[0], -1).T.to(device=device, dtype=torch.float64)
    return W_mat * scale.to(device) if scale is not None else W_mat  # solved for conv + BN; unscaled after


def _rows(consumer: Consumer, W_hat: Tensor, x: Tensor) -> Tensor:
    """A consumer's input batch as rows of its layer problem: kH kW patches of a conv's input, a
    Linear's features as they are (one row per image, or per position of a channels-last map)."""
    if isinstance(consumer, LinearSpec):
        return x.reshape(-1, x.shape[-1]).to(torch.float64)
    cols = F.unfold(x, W_hat.shape[2:], dilation=consumer.dilation, padding=consumer.padding,
                    stride=consumer.stride)
    return cols.transpose(1, 2).reshape(-1, cols.shape[1]).to(torch.float64)


@dataclass
class GroupProblem:
    """The layer problem of a channel group: every consumer's own H_i and G_i, placed block-diagonally
    and interleaved so that channel c's rows of all consumers are one contiguous group of
    g = sum(g_i) rows (see the module docstring)."""

    stats: FinishedStatistics  # combined H, G, energy, means
    W_hat: Tensor  # combined dense weight (block-diagonal, scaled columns)
    scale: Tensor | None  # combined column scales (None: no consumer has one)
    group_size: int  # g
    offsets: list[int]  # where consumer i's g_i rows start within a channel's group
    sizes: list[int]  # g_i
    columns: list[slice]  # consumer i's output columns

    def rows(self, i: int, channels: int) -> Tensor:
        """Row indices of consumer i's rows for `channels` consecutive groups, in its own (channel-major)
        order."""
        base = torch.arange(channels)[:, None] * self.group_size + self.offsets[i]
        return (base + torch.arange(self.sizes[i])[None, :]).reshape(-1)


def combine(parts: list[tuple[FinishedStatistics, Tensor, Tensor | None]], channels: int) -> GroupProblem:
    """One problem from the consumers' (statistics, dense weight matrix, column scale): block-diagonal
    H and G, rows interleaved per channel. A single consumer's problem is returned as it is."""
    sizes = [W.shape[0] // channels for _, W, _ in parts]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    widths = [W.shape[1] for _, W, _ in parts]
    columns = [slice(sum(widths[:i]), sum(widths[: i + 1])) for i in range(len(widths))]
    g = sum(sizes)
    if len(parts) == 1:
        finished, W, scale = parts[0]
        return GroupProblem(finished, W, scale, g, offsets, sizes, columns)
    ref = parts[0][1]
    D, d2 = channels * g, sum(widths)
    H = torch.zeros(D, D, dtype=ref.dtype, device=ref.device)
    G = torch.zeros(D, d2, dtype=ref.dtype, device=ref.device)
    W_hat = torch.zeros(D, d2, dtype=ref.dtype, device=ref.device)
    mean_x = torch.zeros(D, dtype=ref.dtype, device=ref.device)
    mean_y = torch.zeros(d2, dtype=ref.dtype, device=ref.device)
    scale = torch.ones(d2, dtype=ref.dtype, device=ref.device)
    problem = GroupProblem(None, None, None, g, offsets, sizes, columns)  # type: ignore[arg-type]
    for i, (finished, W, s) in enumerate(parts):
        rows = problem.rows(i, channels).to(ref.device)
        H[rows[:, None], rows[None, :]] = finished.H
        G[rows, columns[i]] = finished.G
        W_hat[rows, columns[i]] = W
        mean_x[rows] = finished.mean_x
        mean_y[columns[i]] = finished.mean_y
        if s is not None:
            scale[columns[i]] = s.to(scale)
    energy = sum(finished.energy for finished, _, _ in parts)
    problem.stats = FinishedStatistics(H, G, energy, mean_x, mean_y)
    problem.W_hat = W_hat
    problem.scale = scale if any(s is not None for _, _, s in parts) else None
    return problem


SHORTCUT = "<option-A shortcut>"


def _shortcut(pad: ChannelPad) -> ConvSpec:
    """An option-A shortcut reading a group, as a 1 x 1 identity conv on its (subsampled) input: removing
    a channel also removes it from the next stage's residual stream, which no consumer of this group
    sees, so the group's objective counts that error too (the identity's output is the dense shortcut).
    Its refit is not applied: the shortcut stays a selection, so its term is a slight underestimate."""
    node = pad.node if pad.index is None else pad.node.args[0]  # surgery turned it into pad + index_select
    return ConvSpec(node, SHORTCUT, (1, 1), (0, 0), (1, 1), 1)


def _weight(gm: fx.GraphModule, reader: ConvSpec | LinearSpec, channels: int) -> Tensor:
    if reader.weight == SHORTCUT:
        return torch.eye(channels, dtype=torch.float32).reshape(channels, channels, 1, 1)
    return get_tensor(gm, reader.weight).detach()


LINEAR_RIDGE = 1e-3  # relative to H's mean diagonal


def _toward_dense(stats: FinishedStatistics, W_hat: Tensor) -> None:
    """A Linear after global pooling sees one row per calibration image, so its H is often nearly singular
    (features that barely vary over the images), and the exact refit then grows without bound along those
    directions. Its problem gets a ridge toward the dense weight, lambda ||W - W_hat||^2 / 2 with lambda =
    LINEAR_RIDGE x mean(diag H): H + lambda I and G + lambda W_hat (in place)."""
    lam = LINEAR_RIDGE * float(stats.H.diagonal().mean())
    stats.H.diagonal().add_(lam)
    stats.G.add_(W_hat, alpha=lam)


def _warn(progress: ProgressFn | None, message: str) -> None:
    """A warning through the job's progress (a job lists its warnings in the report), else the log."""
    emit(progress, warning(message), log)


def _outputs(tensor: Tensor | None, keep: Tensor | None) -> Tensor | None:
    """Rows (output channels) `keep` of a dense weight or scale (all when None)."""
    return tensor if tensor is None or keep is None else tensor.index_select(0, keep.to(tensor.device))


def _stream_energy(walk: GraphWalker, unit: ChannelGroup) -> float | None:
    """1/2 ||residual stream||^2 (dense model, calibration images) at the add that an in-block group's
    consumer writes into, or None (a coupled group, or a consumer that joins no residual add).

    The group's loss is an error in its consumer's output, and that output is added to the stream: the
    error is felt relative to the stream, as a transformer layer's is (the target mode's default
    `normalise="stream"`); relative to the consumer's own output energy it would be overstated by the
    stream-to-branch energy ratio, and the allocation would cut the residual streams first."""
    if unit.coupled:
        return None
    add = residual_add(unit.consumer.node)
    if add is None:
        return None
    return 0.5 * float(sum(x.double().square().sum() for (x,) in walk.peek([add])))  # one host read


def channel_cost(unit: ChannelGroup) -> float:
    """FLOPs (multiply-adds) one channel of a group costs per sample: its output channel in every
    producer, its filter in every depthwise conv, its input channel in every consumer (shapes from the
    exported graph's metadata)."""

    def spatial(node: fx.Node, channels_last: bool = False) -> int:
        """Positions of a node's output map: (N, C, H, W), or (N, H, W, C) for a spatial Linear's."""
        val = node.meta.get("val")
        if val is None or val.dim() < 3:
            return 1
        return int(math.prod(val.shape[1:-1] if channels_last else val.shape[2:]))

    def weight_shape(node: fx.Node) -> tuple[int, ...] | None:
        weight = node.args[1].meta.get("val") if isinstance(node.args[1], fx.Node) else None
        return tuple(weight.shape) if weight is not None else None

    cost = 0.0
    for producer in unit.producers:
        shape = weight_shape(producer.node)
        last = isinstance(producer, LinearSpec)  # (out, in) at every position of a channels-last map
        cost += math.prod(shape[1:]) * spatial(producer.node, last) if shape else 1.0  # Cin/groups kH kW per output
    for node in unit.chain:
        if node.target not in BATCH_NORM_OPS and (shape := weight_shape(node)):
            cost += math.prod(shape[1:]) * spatial(node)  # a depthwise filter
    for consumer in unit.consumers:
        shape = weight_shape(consumer.node)
        if shape is None:
            cost += 1.0
        elif isinstance(consumer, LinearSpec):
            cost += shape[0] * (spatial(consumer.node, True) if consumer.spatial else 1)
        else:  # Cout kH kW per input channel
            cost += shape[0] * math.prod(shape[2:]) * spatial(consumer.node)
    return float(cost)


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
    progress: ProgressFn | None = None,
    observe: Callable[[LayerObservation], None] | None = None,
    refine: RefineConfig | None = None,
    teacher: fx.GraphModule | None = None,
    solve_images: int | None = None,
) -> tuple[fx.GraphModule, list[LayerReport]]:
    """Prune the channels of every prunable unit of `gm` (`ratio`: a uniform ratio, or the kept
    channels of each unit by name); returns (pruned copy, reports). `observe` sees each layer's
    statistics before its solve (ratio 0 + observe = the dense statistics pass). With `refine`
    (RefineConfig with steps > 0) the whole pruned graph is then fitted to the outputs of `teacher`
    (`compressor.cnn.refine`; not with method "mp"): by default `gm` itself, the original graph when `gm`
    is one with residual blocks removed (`compressor.cnn.depth`); its held-out errors are the last
    report's `refine`. `solve_images`: the solves' statistics from the first that many images only (the
    fit uses them all: it wants images more than the solves' H matrices do)."""
    check_plan(ratio)
    refine = refine or RefineConfig()
    check_method(refine, method)
    with torch.no_grad():
        pruned, reports = _prune_conv_graph(gm, images[:solve_images], ratio, method, device, batch_size,
                                            weight_by_next_bn, bias_correction, progress, observe)
    return fit_conv_graph(pruned, reports, gm, images, refine, teacher=teacher, device=device,
                          batch_size=batch_size, progress=progress, solve_images=solve_images)


def fit_conv_graph(pruned: fx.GraphModule, reports: list[LayerReport], gm: fx.GraphModule, images: Tensor,
                   refine: RefineConfig, *, teacher: fx.GraphModule | None = None,
                   device: str | torch.device | None = None, batch_size: int = 100,
                   progress: ProgressFn | None = None, solve_images: int | None = None,
                   ) -> tuple[fx.GraphModule, list[LayerReport]]:
    """The fit of `prune_conv_graph` alone: `pruned`, the solves of `gm` (their `reports`, from the first
    `solve_images` images: the judge of the fit is drawn among the others where it can be), fitted in place to the
    outputs of `teacher` (`gm` when None; the original graph when `gm` lacks some blocks), as `prune_conv_graph`
    does after its solves; nothing to fit when `refine` has no steps, or when nothing was narrowed and the
    teacher is `gm` itself. Returns (pruned, reports), the last report carrying the fit's held-out errors."""
    if refine.steps and (teacher is not None or any(r.width_after < r.width_before for r in reports)):
        target = copy.deepcopy(gm if teacher is None else teacher).eval()
        solved = len(images) if solve_images is None else min(solve_images, len(images))
        fit = reconstruct_graph(pruned, target, images, refine, compute_device(device), batch_size, solved=solved)
        reports = [*reports[:-1], dataclasses.replace(reports[-1], refine=fit)]
        emit(progress, Progress(RECONSTRUCTION, "graph", numbers=fit_numbers(fit)), log)
    return pruned, reports


def _prune_conv_graph(gm: fx.GraphModule, images: Tensor, ratio: Widths, method: str,
                      device: str | torch.device | None, batch_size: int, weight_by_next_bn: bool,
                      bias_correction: bool, progress: ProgressFn | None,
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
    pairs = list(zip(units, dense_units, strict=True))  # in graph order of their first consumer's input
    batches = images.split(batch_size)
    pruned_walk = GraphWalker(pruned, batches, device)
    dense_walk = GraphWalker(dense, batches, device)
    reports = []
    kept_outputs: dict[str, Tensor] = {}  # conv weight -> its output channels kept so far
    for index, (unit, dense_unit) in enumerate(pairs):
        start = time.perf_counter()
        # the consumers, then each option-A shortcut reading the group as an identity reader (see below)
        readers = list(unit.consumers) + [_shortcut(pad) for pad in unit.pads_in]
        dense_readers = list(dense_unit.consumers) + [_shortcut(pad) for pad in dense_unit.pads_in]
        inputs = [c.node.args[0] for c in readers]  # read now: surgery may have replaced a node
        dense_inputs = [c.node.args[0] for c in dense_readers]
        pruned_walk.advance(inputs[0])
        dense_walk.advance(dense_inputs[0])
        # a consumer that is also a producer of a group pruned before keeps only those output channels
        outputs = [kept_outputs.get(c.weight) for c in readers]
        dense_weights = [_outputs(_weight(dense, c, unit.channels), out)
                         for c, out in zip(dense_readers, outputs, strict=True)]
        scales = [_outputs(output_scale(dense, c.node), out)
                  if weight_by_next_bn and isinstance(c, ConvSpec) and c.weight != SHORTCUT else None
                  for c, out in zip(dense_readers, outputs, strict=True)]
        mats = [_dense_matrix(c, W, s, device) for c, W, s in zip(readers, dense_weights, scales, strict=True)]
        stats = [LayerStatistics(W) for W in mats]
        # every consumer's pruned and dense inputs, batch by batch (later consumers computed ahead of the cut)
        for xs, dense_xs in zip(pruned_walk.peek(inputs), dense_walk.peek(dense_inputs), strict=True):
            for c, W, st, x, x_hat in zip(readers, dense_weights, stats, xs, dense_xs, strict=True):
                st.add(_rows(c, W, x), _rows(c, W, x_hat))
        finished_parts = [st.finish(center=bias_correction) for st in stats]
        num_prune = planned_prune(unit.name, unit.channels, ratio)
        for c, part, W in zip(readers, finished_parts, mats, strict=True):
            if isinstance(c, LinearSpec) and not c.spatial:  # one row per image: see _toward_dense
                _toward_dense(part, W)
                if num_prune and part.rank is not None and part.rank <= unit.channels - num_prune:
                    _warn(progress, f"{unit.name}: {c.weight} sees one row per calibration image (rank(H) <= "
                                    f"{part.rank}) while it keeps {unit.channels - num_prune} inputs: its refit can "
                                    "reproduce the dense outputs on the calibration images exactly and generalise "
                                    "poorly to others; calibrate on more images than it keeps inputs (--samples)")
        problem = combine([(part, W, s) for part, W, s in zip(finished_parts, mats, scales, strict=True)],
                          unit.channels)
        apply = functools.partial(_surgery, pruned, pruned_walk, unit, problem, dense_weights, bias_correction,
                                  kept_outputs)
        reports.append(prune_layer(
            unit.name, unit.kind, problem.stats, problem.group_size, num_prune, method, dense_weight=problem.W_hat,
            scale=problem.scale, apply=apply, position=(index + 1, len(units)), start=start, observe=observe,
            costs=functools.partial(_costs, dense_walk, unit, dense_unit),
            progress=progress, numbers={"consumers": len(unit.consumers)} if unit.coupled else None))
    return pruned, reports


def _surgery(pruned: fx.GraphModule, walk: GraphWalker, unit: ChannelGroup, problem: GroupProblem,
             dense_weights: list[Tensor], bias_correction: bool, kept_outputs: dict[str, Tensor],
             kept: KeptSolution) -> None:
    """A group's kept channels and their refit weights (and intercepts) into every consumer; the walk's
    live values keep those channels."""
    keep = kept.keep
    new_weights, shifts = [], []
    for i, old in enumerate(dense_weights):
        rows = problem.rows(i, len(keep)).to(kept.weight.device)
        W = kept.weight.index_select(0, rows)[:, problem.columns[i]]  # (kept g_i, C_out)
        new_weights.append(W.T.reshape(old.shape[0], len(keep), *old.shape[2:]).to(dtype=old.dtype))
        shifts.append(kept.shift[problem.columns[i]] if bias_correction else None)  # the intercept
    # a shortcut's "refit" is not applied (it stays a selection of the kept channels)
    new_weights, shifts = new_weights[: len(unit.consumers)], shifts[: len(unit.consumers)]
    kept_rows = torch.tensor(keep)
    writes = {p.weight for p in unit.producers}
    for i, consumer in enumerate(unit.consumers):
        if consumer.weight in writes:  # it reads and writes the group: its removed outputs go too
            new_weights[i] = new_weights[i].index_select(0, kept_rows.to(new_weights[i].device))
            shifts[i] = shifts[i].index_select(0, kept_rows.to(shifts[i].device)) if shifts[i] is not None else None
    prune_group(pruned, unit, keep, new_weights)
    for producer in unit.producers:
        kept_outputs[producer.weight] = torch.tensor(keep)
    for consumer, shift in zip(unit.consumers, shifts, strict=True):
        if shift is not None:
            add_output_shift(pruned, consumer, shift.cpu())
    walk.select_channels(unit.tensors, torch.tensor(keep), unit.channel_dim)  # live values of the kept channels


def _costs(dense_walk: GraphWalker, unit: ChannelGroup, dense_unit: ChannelGroup) -> tuple[float, float | None]:
    """What a group's observation adds to its statistics: one channel's FLOPs, the stream's energy."""
    return channel_cost(unit), _stream_energy(dense_walk, dense_unit)


def resize_conv_graph(gm: fx.GraphModule, plan: Widths) -> fx.GraphModule:
    """A copy of `gm` with every prunable unit at its planned width, keeping each unit's first channels
    and slicing the weights (no statistics, no solve): the structure, and so the latency, that pruning
    to `plan` returns. Target mode measures these to search the widths before it pays for a solve."""
    check_plan(plan)
    resized = copy.deepcopy(gm).eval()
    with torch.no_grad():
        for unit in analyse(resized).units:
            kept = unit.channels - planned_prune(unit.name, unit.channels, plan)
            if kept < unit.channels:
                prune_group(resized, unit, torch.arange(kept))
    return resized

