"""Channel groups of a conv graph in torch.export's ATen IR (`ExportedProgram.module()`).

Every activation tensor has a *channel space* (dim 1). An op that acts on each channel alone keeps its
input's space: BatchNorm, depthwise convs, spatial pads, slices and pools, spatial means, a flatten of a
1 x 1 map, and every **pointwise op by rule** — any op with `torch.Tag.pointwise` (clamp, hardtanh,
hardswish, sigmoid, mul/add, ...) or a value-preserving op (clone, alias, dropout in eval), provided each
other operand is a scalar, a one-element tensor, a per-channel parameter (shape (C, 1, 1) or
(1, C, 1, 1), sliced with the channels) or an activation broadcast over channels. Two activations that
meet in a pointwise op with the same channel count (a residual add, a squeeze-excitation product) share
one space. Each space is one **channel group**: removing channel c removes

- output channel c of every *producer* (the non-grouped convs that write the space, and their biases),
- entry c of every BatchNorm, depthwise filter and per-channel parameter in it (the *chain*),
- input channel c of every *consumer* (non-grouped convs reading it, and a Linear reading pooled
  features: the classifier after global pooling is a consumer too),
- and the matching channel of every *channel pad* reading or writing it: the CIFAR ResNets' option-A
  shortcut (stride-2 subsample, then zero channels before and after) maps channel c of one stage's space
  to channel `before + c` of the next one. Surgery rewrites such a pad as a zero channel appended and an
  `index_select` (`surgery.rewrite_channel_pad`), so both spaces are pruned independently; a kept
  channel of the wider space whose source channel was removed reads zeros (the pruned model's
  statistics see exactly that).

**Channels-last spaces.** A Linear applied at every position of a map (input rank > 2: ConvNeXt's pointwise
layers, after a permute to channels-last) reads its input's last dim and writes a space of its own whose
channels are the last dim. Element-wise ops with scalar or per-channel (last-dim) operands keep it (GELU, a
layer scale); anything else reading it (the permute back, a LayerNorm over the channels) refuses it. So
ConvNeXt's inverted bottleneck, Linear -> GELU -> Linear, is a unit (kind `ffn_neurons`, `channel_dim` -1),
and its residual stream, normalised over the channels, is not.

A group with one producer, one consumer and no pad is an in-block *unit* (kind `conv_channels`); a
group with several producers or consumers (a residual stream) is *coupled* (`coupled_channels`),
named after its first producer (`coupled:<conv>`). How the pipeline chooses a coupled group's channels
(one shared support for the OSSCAR objective summed over its consumers) is in `pipeline.py`.

A space is refused, with the reason (per consumer conv in `ChannelAnalysis.refused`), when anything
else touches it: an op that is not channel-wise (named, with why), a concat, a channel slice, a
reshape, a grouped (not depthwise) conv, the model's input or output, or no conv writing it.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from ..modules import get_attr

aten = torch.ops.aten

CONV_OPS = (aten.conv2d.default, aten.conv2d.padding, aten.convolution.default)  # .padding: 'same'/'valid'
BATCH_NORM_OPS = (aten.batch_norm.default, aten._native_batch_norm_legit_no_training.default)
LINEAR_OPS = (aten.linear.default,)
# element-wise ops that torch does not tag pointwise: value-preserving ones (dropout is the identity in
# eval) and hardswish (x * relu6(x + 3) / 6, untagged in ATen)
# (in place too: HF MobileNets' classifier dropout is inplace=True, which kept their last 1x1 conv whole)
DROPOUT_OPS = {aten.dropout.default, aten.dropout_.default, aten.feature_dropout.default,
               aten.feature_dropout_.default, aten.alpha_dropout.default, aten.alpha_dropout_.default,
               aten.feature_alpha_dropout.default, aten.feature_alpha_dropout_.default}
UNTAGGED_ELEMENTWISE_OPS = {aten.alias.default, aten.contiguous.default, aten.detach.default,
                            aten.lift_fresh_copy.default, aten.hardswish.default, aten.hardswish_.default,
                            *DROPOUT_OPS}
PAD_OPS = (aten.pad.default, aten.constant_pad_nd.default)
# spatial ops that keep every channel apart
SPATIAL_OPS = {aten.max_pool2d.default, aten.avg_pool2d.default, aten.adaptive_avg_pool2d.default,
               aten.max_pool2d_with_indices.default, aten.upsample_nearest2d.vec, aten.upsample_bilinear2d.vec,
               aten.upsample_nearest2d.default, aten.upsample_bilinear2d.default}
REDUCE_OPS = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default}
RESHAPE_OPS = {aten.flatten.using_ints, aten.view.default, aten.reshape.default, aten.squeeze.dim,
               aten.squeeze.dims, aten.unsqueeze.default, aten._unsafe_view.default}
# ops that read a tensor's metadata only
HARMLESS_OPS = {aten.sym_size.int, aten._assert_tensor_metadata.default, aten.sym_numel.default}


@dataclass(frozen=True)
class ConvSpec:
    """The arguments of one conv node that surgery and calibration need."""

    node: fx.Node
    weight: str  # attribute path of the weight (out, in/groups, kH, kW); the bias is read from the graph
    # when needed (`surgery.live_bias`): surgery may add one after the analysis
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    groups: int

    @property
    def name(self) -> str:
        return self.weight.removesuffix(".weight")


@dataclass(frozen=True)
class LinearSpec:
    """A Linear reading a channel space as features: the classifier after global pooling, or (`spatial`) a
    Linear applied at every position of a channels-last map (ConvNeXt's pointwise layers, which also write a
    channels-last space of their own)."""

    node: fx.Node
    weight: str  # (out, in)
    spatial: bool = False  # its input is (batch, ..., features): one row per position, not per image

    @property
    def name(self) -> str:
        return self.weight.removesuffix(".weight")


Consumer = ConvSpec | LinearSpec


@dataclass(eq=False)
class ChannelPad:
    """A constant pad that adds zero channels: output channel `before + c` is input channel c. Shared by
    the group it reads and the group it writes; surgery records what each kept and rewrites the node."""

    node: fx.Node  # the pad; after surgery the index_select that replaced it
    before: int
    in_channels: int
    out_channels: int
    in_keep: list[int] | None = None  # input channels kept so far (None: all)
    out_keep: list[int] | None = None  # output channels kept so far
    index: str | None = None  # attribute of the index buffer once rewritten


@dataclass(frozen=True, eq=False)
class ChannelGroup:
    """Channels that are removed together: see the module docstring."""

    channels: int
    producers: tuple[ConvSpec | LinearSpec, ...]  # graph order: convs, or spatial Linears (channels last)
    chain: tuple[fx.Node, ...]  # BatchNorms and depthwise convs, graph order
    consumers: tuple[Consumer, ...]  # graph order of their inputs
    pads_in: tuple[ChannelPad, ...] = ()  # channel pads reading this space
    pads_out: tuple[ChannelPad, ...] = ()  # channel pads writing (a block of) it
    params: tuple[tuple[str, int], ...] = ()  # per-channel operands of pointwise ops: (attribute, dim)
    tensors: frozenset[str] = frozenset()  # names of the nodes whose values carry these channels
    channel_dim: int = 1  # -1: a channels-last space (written by a spatial Linear)

    @property
    def coupled(self) -> bool:
        return len(self.producers) > 1 or len(self.consumers) > 1 or bool(self.pads_in or self.pads_out)

    @property
    def kind(self) -> str:
        if self.coupled:
            return "coupled_channels"
        # a spatial Linear pair (ConvNeXt's inverted bottleneck) is an MLP's hidden layer: its neurons
        return "ffn_neurons" if self.channel_dim == -1 else "conv_channels"

    @property
    def name(self) -> str:
        return f"coupled:{self.producers[0].name}" if self.coupled else self.consumers[0].name

    @property
    def producer(self) -> ConvSpec | LinearSpec:
        return self.producers[0]

    @property
    def consumer(self) -> Consumer:
        return self.consumers[0]


@dataclass
class ChannelAnalysis:
    units: list[ChannelGroup] = field(default_factory=list)  # in graph order of their first consumer's input
    refused: dict[str, str] = field(default_factory=dict)  # consumer conv -> why it is not prunable


def _pair(value, default: int) -> tuple[int, int]:
    if value is None:
        return (default, default)
    if isinstance(value, int):
        return (value, value)
    value = tuple(value)
    return (value[0], value[0]) if len(value) == 1 else (int(value[0]), int(value[1]))


def _attr(node: object) -> str | None:
    return node.target if isinstance(node, fx.Node) and node.op == "get_attr" else None


def conv_spec(node: fx.Node) -> ConvSpec | None:
    """Arguments of a 2-d conv node, or None if it is not one we can edit (no weight attribute,
    transposed, not 2-d)."""
    if node.op != "call_function" or node.target not in CONV_OPS:
        return None
    args = list(node.args) + [None] * 9
    if node.target is aten.convolution.default:
        # convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
        if args[6]:
            return None
        stride, padding, dilation, groups = args[3], args[4], args[5], args[8]
    else:
        stride, padding, dilation, groups = (node.kwargs.get(k, args[i]) for k, i in
                                             (("stride", 3), ("padding", 4), ("dilation", 5), ("groups", 6)))
    weight = _attr(args[1])
    if weight is None:
        return None
    if isinstance(padding, str):
        padding = _named_padding(padding, args[1], _pair(dilation, 1))
        if padding is None:
            return None
    return ConvSpec(node, weight, _pair(stride, 1), _pair(padding, 0), _pair(dilation, 1),
                    int(groups or 1))


def _unsupported_conv(node: fx.Node) -> str:
    """Why `conv_spec` gives no spec for a conv node with a weight attribute."""
    args = list(node.args) + [None] * 9
    if node.target is aten.convolution.default and args[6]:
        return "a transposed conv"
    padding = node.kwargs.get("padding", args[4])
    if isinstance(padding, str):
        return f"padding={padding!r} with an even kernel pads one side more than the other"
    return "not a 2-d conv"


def _named_padding(name: str, weight: fx.Node, dilation: tuple[int, int]) -> tuple[int, int] | None:
    """The numbers of conv2d's padding="valid" / "same" (stride 1, as torch requires for "same"), or None
    where they are not one symmetric pad per side (an even kernel's "same")."""
    if name == "valid":
        return (0, 0)
    shape = _shape(weight)
    if name != "same" or shape is None or len(shape) != 4:
        return None
    total = [d * (k - 1) for d, k in zip(dilation, shape[2:], strict=True)]
    return (total[0] // 2, total[1] // 2) if all(t % 2 == 0 for t in total) else None


def _is_depthwise(spec: ConvSpec, gm: fx.GraphModule) -> bool:
    shape = get_attr(gm, spec.weight).shape
    return spec.groups > 1 and shape[1] == 1 and shape[0] == spec.groups


def _shape(node: object) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(int(s) if isinstance(s, int) else -1 for s in val.shape) if isinstance(val, torch.Tensor) else None


def _channel_pad(node: fx.Node) -> tuple[int, int] | str | None:
    """(before, after) zero channels of a pad that pads channels, None for a spatial pad, else why not."""
    pads = node.args[1] if len(node.args) > 1 else node.kwargs.get("pad")
    if not isinstance(pads, (list, tuple)) or not all(isinstance(p, int) for p in pads):
        return "pads that are not constants"
    # pairs pad the last dims first: the channels (dim 1) are pair rank - 2 (a 4-D map's third, a vector's first)
    shape = _shape(node.args[0])
    channel_pair = len(shape) - 2 if shape is not None and len(shape) >= 2 else 2
    if len(pads) <= 2 * channel_pair:
        return None
    mode = node.args[2] if node.target is aten.pad.default and len(node.args) > 2 else "constant"
    value = node.args[-1] if node.target is aten.pad.default and len(node.args) > 3 else \
        node.args[2] if node.target is aten.constant_pad_nd.default and len(node.args) > 2 else 0
    if len(pads) > 2 * channel_pair + 2 or mode != "constant" or (value or 0) != 0 or min(pads) < 0:
        return "a pad of the batch, a non-zero or non-constant channel pad, or a crop"
    if any(pads[:2 * channel_pair]):
        return "a pad of channels and space at once"
    return (pads[2 * channel_pair], pads[2 * channel_pair + 1])


class _Spaces:
    """Union-find over activation nodes, with what each space holds."""

    def __init__(self) -> None:
        self.parent: dict[fx.Node, fx.Node] = {}
        self.notes: dict[fx.Node, dict] = {}

    def find(self, node: fx.Node) -> fx.Node:
        self.parent.setdefault(node, node)
        while self.parent[node] is not node:
            self.parent[node] = self.parent[self.parent[node]]
            node = self.parent[node]
        return node

    def note(self, node: fx.Node, key: str, value) -> None:
        self.notes.setdefault(node, {}).setdefault(key, []).append(value)

    def union(self, a: fx.Node, b: fx.Node) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra is not rb:
            self.parent[rb] = ra

    def spaces(self) -> dict[fx.Node, dict]:
        out: dict[fx.Node, dict] = {}
        for node in self.parent:
            merged = out.setdefault(self.find(node), {"tensors": []})
            merged["tensors"].append(node)
            for key, values in self.notes.get(node, {}).items():
                merged.setdefault(key, []).extend(values)
        return out


def _operands(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes]


def _pointwise(node: fx.Node) -> bool:
    target = node.target
    tagged = isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags
    return tagged or target in UNTAGGED_ELEMENTWISE_OPS


ADD_OPS = (aten.add.Tensor, aten.add_.Tensor)


def residual_add(consumer: fx.Node) -> fx.Node | None:
    """The residual add that a conv's output joins through its own BatchNorm and unary channel-wise ops
    (the second conv of a ResNet basic block: conv -> BN -> add), or None when it joins none."""
    node = consumer
    while len(node.users) == 1:
        (user,) = node.users
        if user.target in ADD_OPS and all(isinstance(a, fx.Node) for a in user.args[:2]):
            return user
        unary = _pointwise(user) and len(user.all_input_nodes) == 1
        if not (user.target in BATCH_NORM_OPS or user.target is operator.getitem or unary):
            return None
        node = user
    return None


def analyse(gm: fx.GraphModule) -> ChannelAnalysis:
    """Every channel group of `gm` that can be pruned, and why the others cannot."""
    spaces = _Spaces()
    derived: set[fx.Node] = set()  # nodes computed from the model input (activations)
    last: set[fx.Node] = set()  # activations whose channels are their last dim (a spatial Linear's output)
    order = {node: i for i, node in enumerate(gm.graph.nodes)}

    def refuse(node: fx.Node, why: str) -> None:
        spaces.note(node, "refused", why)

    def refuse_through(node: fx.Node, inputs: list[fx.Node], why: str) -> None:
        """The channels a node reads and those it writes, for one reason."""
        for a in inputs:
            refuse(a, why)
        refuse(node, why)

    def tensor(node: fx.Node) -> None:
        derived.add(node)
        spaces.find(node)

    # a weight that two convs / linears read (a shared or recurrent layer) would be sliced once per reader, each
    # time with indices of its full width: such readers are refused, with the weight's name
    readers: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and (node.target in CONV_OPS or node.target in LINEAR_OPS):
            weight = _attr(node.args[1]) if len(node.args) > 1 else None
            if weight is not None:
                readers[weight] = readers.get(weight, 0) + 1

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            tensor(node)
            refuse(node, "its input channels are the model's input")
            continue
        if node.op == "output":
            for arg in _operands(node):
                if arg in derived:
                    refuse(arg, f"{arg.name} is a model output")
            continue
        if node.op != "call_function":
            continue  # get_attr (parameters) and call_module (the exported program's shape guards)
        inputs = [a for a in _operands(node) if a in derived]
        if not inputs:
            continue  # computed from parameters only: a constant
        tensor(node)
        target = node.target
        x = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        if any(a in last for a in inputs) and target not in LINEAR_OPS and target not in HARMLESS_OPS:
            why = _channels_last_operands(node, inputs, last, spaces, gm)
            if why is not None:
                refuse_through(node, inputs, f"{node.name} ({target}) {why}")
            continue
        weight = _attr(node.args[1]) if target in CONV_OPS or target in LINEAR_OPS else None
        if weight is not None and readers[weight] > 1:
            refuse_through(node, inputs, f"{weight.removesuffix('.weight')} is applied {readers[weight]} times (a "
                           "shared weight)")
            continue
        spec = conv_spec(node)
        if spec is None and target in CONV_OPS and weight is not None:
            # named by its module, with why: an even kernel's padding="same" pads one side more than the other
            refuse_through(node, inputs, f"{weight.removesuffix('.weight')} is a conv this tool does not edit "
                                         f"({_unsupported_conv(node)})")
            continue
        if spec is not None:
            others = [a for a in inputs if a is not x]
            if others:  # a weight computed from an activation
                refuse_through(node, inputs, f"{node.name} uses an activation as a conv weight")
            elif _is_depthwise(spec, gm):
                spaces.union(x, node)
                spaces.note(node, "chain", node)
            elif spec.groups == 1:
                spaces.note(x, "consumers", spec)
                spaces.note(node, "producers", spec)
            else:  # named by its module: the FX node's name (conv2d_2) is nothing a user can find
                refuse_through(node, [x], f"{spec.name} is a grouped conv (groups={spec.groups})")
            continue
        if target in LINEAR_OPS:
            shape = _shape(x)
            weight = _attr(node.args[1]) if len(node.args) > 1 else None
            if shape is not None and len(shape) == 2 and weight is not None and len(inputs) == 1:
                spaces.note(x, "consumers", LinearSpec(node, weight))
                refuse(node, f"{node.name} is a linear layer's output")
            elif shape is not None and len(shape) > 2 and weight is not None and len(inputs) == 1:
                # features last at every position: it reads one channels-last space and writes another
                spec = LinearSpec(node, weight, spatial=True)
                spaces.note(x, "consumers", spec)
                spaces.note(x, "last", True)
                spaces.note(node, "producers", spec)
                spaces.note(node, "last", True)
                last.add(node)
            else:
                for a in inputs:
                    refuse(a, f"{node.name} (linear) reads more than pooled features")
                refuse(node, f"{node.name} is a linear layer's output")
            continue
        if target in BATCH_NORM_OPS:
            if inputs != [x]:
                refuse(x, f"{node.name} normalises with statistics computed from activations")
            elif len(node.args) > 3 and node.args[3] is None:
                name = (_attr(node.args[1]) or node.name).removesuffix(".weight")
                refuse_through(node, [x], f"{name} is a BatchNorm without running statistics (track_running_stats="
                                          "False): it normalises every batch by its own statistics")
                continue
            spaces.union(x, node)
            spaces.note(node, "chain", node)
            continue
        if target is operator.getitem:
            source = node.args[0]
            if node.args[1] == 0 and (source.target in BATCH_NORM_OPS or source.target in SPATIAL_OPS):
                spaces.union(source, node)  # the output of a BatchNorm / pool with extra results
            else:
                refuse(node, f"{node.name} takes a secondary result of {source.name}")
            continue
        if target in PAD_OPS:
            pad = _channel_pad(node)
            if pad is None:
                spaces.union(x, node)
            elif isinstance(pad, str):
                refuse(x, f"{node.name} ({target}) is {pad}")
                refuse(node, f"{node.name} ({target}) is {pad}")
            else:
                in_shape, out_shape = _shape(x), _shape(node)
                link = ChannelPad(node, pad[0], in_shape[1], out_shape[1])
                spaces.note(x, "pads_in", link)
                spaces.note(node, "pads_out", link)
            continue
        if target is aten.slice.Tensor:
            dim = node.args[1] if len(node.args) > 1 else 0
            rank = len(_shape(node) or (0, 0, 0, 0))
            if dim % rank == 1:
                refuse(x, f"{node.name} slices channels")
                refuse(node, f"{node.name} slices channels")
            else:
                spaces.union(x, node)
            continue
        if target in SPATIAL_OPS:
            spaces.union(x, node)
            continue
        if target in REDUCE_OPS or target in RESHAPE_OPS:
            in_shape, out_shape = _shape(x), _shape(node)
            why = _keeps_channels(target, node, in_shape, out_shape)
            if why is None:
                spaces.union(x, node)
            else:
                refuse(x, f"{node.name} ({target}) {why}")
                refuse(node, f"{node.name} ({target}) {why}")
            continue
        if target in HARMLESS_OPS:
            continue
        if _pointwise(node):
            why = _pointwise_operands(node, inputs, spaces, gm)
            if why is not None:
                refuse_through(node, inputs, f"{node.name} ({target}) is not channel-wise: {why}")
            continue
        why = ("not element-wise (no torch.Tag.pointwise), nor a conv, linear, BatchNorm, spatial "
               "pad/slice/pool or a per-channel reduction")
        refuse_through(node, inputs, f"{node.name} ({target}) is not channel-wise: {why}")

    return _groups(gm, spaces, order)


def _keeps_channels(target, node: fx.Node, in_shape, out_shape) -> str | None:
    """None when a reduction / reshape keeps dim 1 as the channels (spatial means, flattening a 1 x 1
    map), else why not."""
    if in_shape is None or out_shape is None or len(in_shape) < 2 or len(out_shape) < 2:
        return "has no known shape"
    if target in REDUCE_OPS:
        dims = node.args[1] if len(node.args) > 1 else None
        dims = [dims] if isinstance(dims, int) else list(dims or [])
        dims = [d % len(in_shape) for d in dims]
        return None if dims and 0 not in dims and 1 not in dims else "reduces over channels or the batch"
    if in_shape[1] == out_shape[1] and in_shape[0] == out_shape[0] and \
            math.prod(in_shape[2:]) == 1 and math.prod(out_shape[2:]) == 1:
        return None
    return "reshapes the channels"


def _pointwise_operands(node: fx.Node, inputs: list[fx.Node], spaces: _Spaces, gm: fx.GraphModule) -> str | None:
    """Join a pointwise op to its operands' spaces; None when it is channel-wise, else why not."""
    out = _shape(node)
    if out is None or len(out) < 2:
        return "its output has no channel dimension"
    rank, channels = len(out), out[1]
    joined = False
    for arg in _operands(node):
        shape = _shape(arg)
        if arg in inputs:
            if shape is None:
                return f"operand {arg.name} has no known shape"
            if len(shape) != rank:
                return f"operand {arg.name} of shape {shape} is not an activation of the output's layout"
            aligned = shape
            if aligned[1] == channels:
                spaces.union(node, arg)
                joined = True
            elif aligned[1] != 1:
                return f"operand {arg.name} has {aligned[1]} channels, the output {channels}"
            continue
        # a constant operand: a parameter, buffer or lifted constant
        value = get_attr(gm, arg.target) if arg.op == "get_attr" else None
        size = value.numel() if value is not None else (math.prod(shape) if shape else None)
        if size == 1:
            continue
        if value is None:
            return f"operand {arg.name} is a computed constant of shape {shape}"
        dims = tuple(value.shape)
        aligned = (1,) * (rank - len(dims)) + dims
        if len(dims) > rank or aligned[1] != channels or any(s != 1 for i, s in enumerate(aligned) if i != 1):
            return f"operand {arg.target} of shape {dims} is neither a scalar nor per-channel"
        spaces.note(node, "params", (arg.target, len(dims) - (rank - 1)))
    if not joined:
        return "no operand carries the output's channels"
    return None


def _channels_last_operands(node: fx.Node, inputs: list[fx.Node], last: set[fx.Node], spaces: _Spaces,
                            gm: fx.GraphModule) -> str | None:
    """Join an op reading a channels-last space (a spatial Linear's output) to it when it is element-wise with
    each other operand a scalar or a per-channel (last-dim) parameter (GELU; ConvNeXt's layer scale); None
    then, else why not (a permute back to channels-first, a LayerNorm over the channels)."""
    if not _pointwise(node):
        return "is not element-wise on a channels-last map (its channels are the last dim)"
    out = _shape(node)
    if out is None:
        return "has no known shape"
    for arg in _operands(node):
        if arg in inputs:
            if arg not in last or _shape(arg) != out:
                return f"mixes {arg.name} into a channels-last map of another layout"
            continue
        value = get_attr(gm, arg.target) if arg.op == "get_attr" else None
        if value is None:  # a lifted or computed constant: a scalar only
            if math.prod(_shape(arg) or (2,)) != 1:
                return f"operand {arg.name} is a computed constant"
            continue
        if value.numel() == 1:
            continue
        if tuple(value.shape) != (out[-1],):
            return f"operand {arg.target} of shape {tuple(value.shape)} is neither a scalar nor per-channel"
        spaces.note(node, "params", (arg.target, 0))
    for arg in inputs:
        spaces.union(node, arg)
    last.add(node)
    return None


def _groups(gm: fx.GraphModule, spaces: _Spaces, order: dict[fx.Node, int]) -> ChannelAnalysis:
    result = ChannelAnalysis()
    outputs: dict[str, str] = {}  # why a conv's output channels stay, where no conv reads them
    for space in spaces.spaces().values():
        consumers = sorted(dict.fromkeys(space.get("consumers", [])), key=lambda c: order[c.node.args[0]])
        producers = sorted(dict.fromkeys(space.get("producers", [])), key=lambda p: order[p.node])
        reasons = space.get("refused", [])
        if not consumers:
            # read by no conv or pooled Linear (a grouped conv, a transposed conv, a flatten of a 2 x 3 map): the
            # convs writing it keep their output channels, and say why under their own names
            for producer in producers:
                if reasons and isinstance(producer, ConvSpec):
                    outputs.setdefault(producer.name, reasons[0])
            continue
        names = [c.name for c in consumers if isinstance(c, ConvSpec)]
        if not reasons and not producers:
            reasons = ["no conv writes these channels"]
        spatial = [s for s in (*producers, *consumers) if isinstance(s, LinearSpec) and s.spatial]
        if not reasons and space.get("last") and len(spatial) != len(producers) + len(consumers):
            # a conv writes dim 1, a spatial Linear reads the last one: not the same channels
            reasons = ["a channels-last map written or read by other than a Linear at every position"]
        tensors = space["tensors"]
        dim = -1 if space.get("last") else 1
        channels = next((_shape(n)[dim] for n in tensors if _shape(n) is not None and len(_shape(n)) > 1), None)
        if not reasons and channels is None:
            reasons = ["the channel count is unknown"]
        if reasons:
            for name in names:
                result.refused[name] = reasons[0]
            continue
        chain = sorted(dict.fromkeys(space.get("chain", [])), key=order.__getitem__)
        result.units.append(ChannelGroup(
            channels, tuple(producers), tuple(chain), tuple(consumers), tuple(dict.fromkeys(space.get("pads_in", []))),
            tuple(dict.fromkeys(space.get("pads_out", []))), tuple(dict.fromkeys(space.get("params", []))),
            frozenset(n.name for n in tensors), dim))
    for name, why in outputs.items():  # beside why its input channels stay, where they do
        inputs = result.refused.get(name)
        if inputs is not None and not inputs.startswith("its input channels"):
            inputs = f"its input channels: {inputs}"
        result.refused[name] = "; ".join(filter(None, [inputs, f"its output channels: {why}"]))
    result.units.sort(key=lambda g: order[g.consumers[0].node.args[0]])
    return result
