"""Channel dependencies of a conv graph in torch.export's ATen IR (`ExportedProgram.module()`).

A *channel unit* is a conv whose input channels come from exactly one producer conv through
channel-wise ops only (BatchNorm, element-wise activations, spatial padding, depthwise convs), where
every tensor on that path feeds nothing else. Pruning input channel c of the consumer then removes
output channel c of the producer, entry c of every BatchNorm and depthwise filter c on the path.
Channels that meet anything else (a residual add, a concat, a channel pad, a reshape, a linear
layer) are left alone, and the reason is reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx

from ..modules import get_attr

aten = torch.ops.aten

CONV_OPS = (aten.conv2d.default, aten.convolution.default)
BATCH_NORM_OPS = (aten.batch_norm.default, aten._native_batch_norm_legit_no_training.default)
# element-wise on each channel, no parameters
ELEMENTWISE_OPS = {
    aten.relu.default, aten.relu_.default, aten.relu6.default, aten.hardtanh.default,
    aten.hardtanh_.default, aten.silu.default, aten.silu_.default, aten.gelu.default,
    aten.sigmoid.default, aten.hardswish.default, aten.hardswish_.default, aten.hardsigmoid.default,
    aten.leaky_relu.default, aten.elu.default, aten.tanh.default, aten.mish.default,
    aten.dropout.default, aten.clone.default, aten.contiguous.default, aten.alias.default,
}
PAD_OPS = (aten.pad.default, aten.constant_pad_nd.default)


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


@dataclass(frozen=True)
class ChannelUnit:
    """Producer conv -> channel-wise chain -> consumer conv; `channels` can be pruned together."""

    producer: ConvSpec
    chain: tuple[fx.Node, ...]  # BatchNorms, activations, pads and depthwise convs, in order
    consumer: ConvSpec
    channels: int

    @property
    def name(self) -> str:
        return self.consumer.weight.removesuffix(".weight")


@dataclass
class ChannelAnalysis:
    units: list[ChannelUnit] = field(default_factory=list)
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
    if weight is None or isinstance(padding, str):
        return None
    return ConvSpec(node, weight, _pair(stride, 1), _pair(padding, 0), _pair(dilation, 1),
                    int(groups or 1))


def _is_depthwise(spec: ConvSpec, gm: fx.GraphModule) -> bool:
    shape = get_attr(gm, spec.weight).shape
    return spec.groups > 1 and shape[1] == 1 and shape[0] == spec.groups


def _is_spatial_pad(node: fx.Node) -> bool:
    pads = node.args[1] if len(node.args) > 1 else node.kwargs.get("pad")
    # (left, right, top, bottom) pads only the last two (spatial) dims of NCHW
    return isinstance(pads, (list, tuple)) and len(pads) <= 4


def analyse(gm: fx.GraphModule) -> ChannelAnalysis:
    """Every conv's channel unit, or why it has none."""
    result = ChannelAnalysis()
    for node in gm.graph.nodes:
        consumer = conv_spec(node)
        if consumer is None:
            continue
        name = consumer.weight.removesuffix(".weight")
        if consumer.groups != 1:
            result.refused[name] = "grouped/depthwise conv: its input channels are pruned with its producer"
            continue
        chain: list[fx.Node] = []
        current = node.args[0]
        reason = None
        while True:
            if not isinstance(current, fx.Node) or current.op != "call_function":
                reason = "its input is not produced by a conv (model input or a non-ATen op)"
                break
            if len(current.users) != 1:
                reason = f"{current.name} also feeds {len(current.users) - 1} other node(s) (e.g. a residual)"
                break
            spec = conv_spec(current)
            if spec is not None:
                if _is_depthwise(spec, gm):
                    chain.append(current)
                    current = current.args[0]
                    continue
                if spec.groups != 1:
                    reason = f"{current.name} is a grouped conv"
                    break
                channels = get_attr(gm, spec.weight).shape[0]
                result.units.append(ChannelUnit(spec, tuple(reversed(chain)), consumer, channels))
                break
            if current.target in BATCH_NORM_OPS or current.target in ELEMENTWISE_OPS:
                chain.append(current)
                current = current.args[0]
                continue
            if current.target in PAD_OPS and _is_spatial_pad(current):
                chain.append(current)
                current = current.args[0]
                continue
            reason = f"{current.name} ({current.target}) is not channel-wise"
            break
        if reason is not None:
            result.refused[name] = reason
    return result

