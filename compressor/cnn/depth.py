"""Depth pruning of a conv graph: whole residual blocks removed before its channels are pruned.

A *residual block* here is a residual add `y = branch(x) + x` whose branch reads nothing from the rest of
the graph but `x` and the parameters of its own ops, and whose ops are used by nothing outside it (a
ResNet basic or bottleneck block with an identity shortcut, a MobileNetV2 inverted residual). Removing
it replaces `y` by `x`: the branch's contribution becomes zero, its ops and parameters leave the graph,
and what follows the add (a ReLU of a ResNet block) reads `x` instead. Blocks whose shortcut changes the
tensor (the CIFAR ResNets' option-A subsample and zero padding, a projection conv) are never removed:
they change the stream's shape.

Channel pruning cannot take out the per-op cost of a block (its convs, norms and add still run at any
width); a removed block's cost is gone. On ResNet-56 at batch 64 in ONNX Runtime (CPU), removing 6 of its
25 removable blocks measured 1.30x before any channel was pruned (bench/RESULTS.md).

Which blocks: greedily, the block whose removal (with those already chosen) changes the graph's outputs
on calibration images least (relative squared error against the dense outputs), one at a time. Every
later stage (the channel solves, the whole-graph reconstruction) sees the shallower graph; the
reconstruction fits it to the *dense* graph's outputs (`pipeline.prune_conv_graph(teacher=...)`).

How many: `--remove-blocks K`, or in target mode each prefix of the greedy order weighed against the
widths it spares (`service.job.targeting.plan_depth`), with each block's removal loss in the width
curves' currency (`removal_losses`).
"""

from __future__ import annotations

import copy
import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, fx

from ..errors import UnsupportedArchitecture
from ..progress import DEPTH, Progress, ProgressFn
from .graph import ADD_OPS, CONV_OPS, LINEAR_OPS
from .refine import graph_output

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResidualBlock:
    """A removable residual block of a graph (see the module docstring)."""

    name: str  # the common module path of its convs' weights (e.g. "layer1.3"), else its add node's name
    add: str  # the residual add node's name
    shortcut: str  # the node name of x
    parameters: tuple[str, ...]  # attribute paths its ops alone read (removed with it)


def _branch(add: fx.Node, out: fx.Node, x: fx.Node) -> tuple[set[fx.Node], set[fx.Node]] | None:
    """(ops, get_attr leaves) of the branch computing `out` from `x` alone, or None when `out` reads any
    other activation or one of its ops is used outside the block."""
    ops: set[fx.Node] = set()
    leaves: set[fx.Node] = set()
    stack = [out]
    reads_x = False
    while stack:
        node = stack.pop()
        if node is x:
            reads_x = True
            continue
        if node in ops or node in leaves:
            continue
        if node.op == "get_attr":
            leaves.add(node)
            continue
        if node.op != "call_function":  # the model input, or a module call: not a closed branch
            return None
        ops.add(node)
        stack.extend(node.all_input_nodes)
    if not reads_x:
        return None
    inside = ops | {add}
    if any(user not in inside for node in ops for user in node.users):
        return None
    if any(user not in ops for leaf in leaves for user in leaf.users):  # a parameter shared with another op
        return None
    return ops, leaves


def residual_blocks(gm: fx.GraphModule) -> list[ResidualBlock]:
    """Every removable residual block of `gm`, in graph order."""
    blocks = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in ADD_OPS or len(node.args) < 2:
            continue
        if node.kwargs.get("alpha", 1) != 1 or any(not isinstance(a, fx.Node) for a in node.args[:2]):
            continue
        for out, x in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
            found = _branch(node, out, x)
            if found is None:
                continue
            ops, leaves = found
            convs = [op for op in ops if op.target in CONV_OPS]
            if not convs:  # a branch of pointwise ops only: nothing worth removing
                continue
            # named after every weight of the branch: a ConvNeXt block's one conv (its depthwise) and its Linears
            # share the block's path, the conv alone names a module inside it
            weighted = [op for op in ops if op.target in CONV_OPS or op.target in LINEAR_OPS]
            weights = sorted(str(op.args[1].target) for op in weighted if isinstance(op.args[1], fx.Node))
            name = ".".join(_common_prefix([w.split(".")[:-1] for w in weights])) or node.name
            if name in {b.name for b in blocks}:  # blocks that share a module path: told apart by their add
                name = f"{name}#{node.name}"
            blocks.append(ResidualBlock(name, node.name, x.name, tuple(sorted(str(leaf.target) for leaf in leaves))))
            break
    return blocks


def _common_prefix(paths: list[list[str]]) -> list[str]:
    """The leading components every path shares."""
    prefix = paths[0] if paths else []
    for path in paths[1:]:
        n = 0
        while n < min(len(prefix), len(path)) and prefix[n] == path[n]:
            n += 1
        prefix = prefix[:n]
    return prefix


def remove_blocks(gm: fx.GraphModule, names: list[str]) -> fx.GraphModule:
    """A copy of `gm` without the residual blocks named (`ResidualBlock.name`): each add replaced by its
    shortcut, the branch's ops and parameters deleted. Unknown names are refused, listing the known ones."""
    known = {b.name: b for b in residual_blocks(gm)}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise UnsupportedArchitecture(f"no removable residual block named {unknown} (this graph has: "
                                      f"{sorted(known) or 'none'})")
    out = copy.deepcopy(gm)
    nodes = {node.name: node for node in out.graph.nodes}
    stands_for: dict[str, fx.Node] = {}  # a removed add -> the node that replaced it

    def live(name: str) -> fx.Node:
        node = nodes[name]
        while node.name in stands_for:
            node = stands_for[node.name]
        return node

    for name in names:
        block = known[name]
        add = nodes[block.add]
        # chained blocks without an op between them (HF MobileNetV2): a block's shortcut can be the add of one
        # removed before it, whose own shortcut then stands in
        shortcut = live(block.shortcut)
        add.replace_all_uses_with(shortcut)
        stands_for[add.name] = shortcut
        out.graph.erase_node(add)
    # an inference graph's random ops are the identity (an eval-mode Dropout ending HF EfficientNet's branches):
    # counted impure, as FX counts them by default, they kept the removed branch alive with its weights
    out.graph.eliminate_dead_code(is_impure_node=lambda node: node.is_impure(impure_random=False))
    # the removed ops' parameters, and what else their modules hold that the graph never reads (a
    # BatchNorm's num_batches_tracked)
    used = {str(node.target) for node in out.graph.nodes if node.op == "get_attr"}
    owners = {target.rpartition(".")[0] for name in names for target in known[name].parameters}
    for path in sorted(owners):
        module = out.get_submodule(path) if path else out
        for attr in [*module._parameters, *module._buffers]:
            if f"{path}.{attr}".lstrip(".") not in used:
                delattr(module, attr)
    out.recompile()
    return out


def _relative_error(outputs: Tensor, reference: Tensor) -> float:
    return float((outputs - reference).square().sum() / reference.square().sum().clamp_min(1e-30))


def greedy_blocks(gm: fx.GraphModule, images: Tensor, *, device: torch.device, batch_size: int = 100
                  ) -> Iterator[tuple[str, float]]:
    """Blocks in the order the greedy removes them, lazily, with the output relative error (against the
    dense outputs on `images`) once each is removed together with the ones before it: each time the block
    whose removal leaves the outputs closest to the dense ones. A caller stops when it has enough."""
    blocks = residual_blocks(gm)

    @torch.no_grad()
    def outputs(module: fx.GraphModule) -> Tensor:
        module = module.to(device)
        parts = [graph_output(module(batch.to(device))).float().cpu() for batch in images.split(batch_size)]
        return torch.cat(parts)

    reference = outputs(copy.deepcopy(gm))  # a copy: `gm` (the caller's dense graph) stays where it is
    chosen: list[str] = []
    while len(chosen) < len(blocks):
        errors = {b.name: _relative_error(outputs(remove_blocks(gm, [*chosen, b.name])), reference)
                  for b in blocks if b.name not in chosen}
        best = min(errors, key=errors.__getitem__)
        chosen.append(best)
        yield best, errors[best]


def choose_blocks(gm: fx.GraphModule, images: Tensor, count: int, *, device: torch.device,
                  batch_size: int = 100, progress: ProgressFn | None = None) -> list[str]:
    """`count` blocks to remove, greedily (`greedy_blocks`)."""
    blocks = residual_blocks(gm)
    if count > len(blocks):
        raise UnsupportedArchitecture(f"{count} residual blocks to remove, but this graph has {len(blocks)} removable "
                                      "ones (identity shortcuts only): "
                                      f"{[b.name for b in blocks] or 'none'}")
    chosen = []
    for step, (best, error) in enumerate(itertools.islice(greedy_blocks(gm, images, device=device,
                                                                        batch_size=batch_size), count)):
        chosen.append(best)
        if progress is None:
            log.info("depth: block %d/%d: %s (output relative error with it removed %.4f)", step + 1, count, best,
                     error)
        else:
            progress(Progress(DEPTH, best, numbers={"step": step + 1, "steps": count, "error": error}))
    return chosen


class _BranchEnergies(fx.Interpreter):
    """Runs a graph and sums, at each residual block's add, ||branch||^2 and ||x + branch||^2."""

    def __init__(self, gm: fx.GraphModule, blocks: list[ResidualBlock]) -> None:
        super().__init__(gm)
        self.shortcut = {b.add: b.shortcut for b in blocks}
        self.branch = dict.fromkeys(self.shortcut, 0.0)
        self.stream = dict.fromkeys(self.shortcut, 0.0)

    def run_node(self, node: fx.Node) -> object:
        if node.name not in self.shortcut:
            return super().run_node(node)
        branch = next(self.env[a] for a in node.args[:2]
                      if isinstance(a, fx.Node) and a.name != self.shortcut[node.name])
        # read before the add runs: an in-place one (`out += x`, HF ResNet's) writes the sum into the branch
        self.branch[node.name] += float(branch.double().square().sum())
        out = super().run_node(node)
        self.stream[node.name] += float(out.double().square().sum())
        return out


@torch.no_grad()
def removal_losses(gm: fx.GraphModule, images: Tensor, *, device: torch.device, batch_size: int = 100
                   ) -> dict[str, float]:
    """Each removable block's removal loss in the currency of the width curves: ||branch(x)||^2 /
    ||x + branch(x)||^2 on `images` (dense graph).

    Removing a block adds -branch(x) to the residual stream it writes, and a width loss is an error in a
    consumer's output relative to the stream it joins (`pipeline._stream_energy`); removing a block is
    its last conv pruned to no channel at all. So the two compare, and one allocation can weigh them."""
    blocks = residual_blocks(gm)
    runner = _BranchEnergies(copy.deepcopy(gm).to(device), blocks)
    for batch in images.split(batch_size):
        runner.run(batch.to(device))
    return {b.name: runner.branch[b.add] / max(runner.stream[b.add], 1e-30) for b in blocks}
