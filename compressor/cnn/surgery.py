"""Physical channel removal on an exported conv graph: small typed functions, one per tensor role.

Parameters live as attributes of the GraphModule (`get_attr` nodes); removing channels replaces them
by smaller tensors, a depthwise conv's `groups` argument is rewritten in the graph, and a channel pad
(option-A shortcut) becomes a zero channel appended plus an `index_select`. Every function checks its
indices and lists every bad one. `prune_group` removes a channel group through all of its roles.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import Tensor, fx, nn

from ..errors import SurgeryError
from ..modules import check_keep, get_attr, owner_of
from .graph import BATCH_NORM_OPS, ChannelGroup, ChannelPad, ConvSpec, LinearSpec, conv_spec

aten = torch.ops.aten


def get_tensor(gm: fx.GraphModule, target: str) -> Tensor:
    return get_attr(gm, target)


def set_tensor(gm: fx.GraphModule, target: str, value: Tensor) -> None:
    """Replace a parameter or buffer of the GraphModule, keeping its kind."""
    owner, name = owner_of(gm, target)
    if name in owner._parameters:
        owner._parameters[name] = nn.Parameter(value.detach().clone(), requires_grad=False)
    elif name in owner._buffers:
        owner._buffers[name] = value.detach().clone()
    else:
        setattr(owner, name, value.detach().clone())


def _slice(gm: fx.GraphModule, target: str | None, dim: int, keep: Tensor) -> None:
    if target is not None:
        tensor = get_tensor(gm, target)
        set_tensor(gm, target, tensor.index_select(dim, keep.to(tensor.device)))


def live_bias(conv: ConvSpec | LinearSpec) -> str | None:
    """The conv's (or Linear's) bias attribute as the graph has it now (surgery may have added one)."""
    args = conv.node.args
    bias = args[2] if len(args) > 2 else conv.node.kwargs.get("bias")
    return bias.target if isinstance(bias, fx.Node) and bias.op == "get_attr" else None


def prune_conv_out_channels(gm: fx.GraphModule, conv: ConvSpec | LinearSpec, keep: Sequence[int] | Tensor) -> None:
    """Keep output channels `keep` of a (non-grouped) conv, or output features of a spatial Linear: weight rows
    and bias entries."""
    keep = check_keep(keep, get_tensor(gm, conv.weight).shape[0], f"{conv.weight} output channels")
    _slice(gm, conv.weight, 0, keep)
    _slice(gm, live_bias(conv), 0, keep)


def prune_conv_in_channels(gm: fx.GraphModule, conv: ConvSpec, keep: Sequence[int] | Tensor,
                           weight: Tensor | None = None) -> None:
    """Keep input channels `keep` of a non-grouped conv; `weight` (out, kept, kH, kW) replaces the
    sliced weight (the solver's refit), when given."""
    w = get_tensor(gm, conv.weight)
    keep = check_keep(keep, w.shape[1], f"{conv.weight} input channels")
    if weight is None:
        weight = w.index_select(1, keep.to(w.device))
    expected = (w.shape[0], keep.numel(), *w.shape[2:])
    if tuple(weight.shape) != expected:
        raise SurgeryError(f"{conv.weight}: new weight has shape {tuple(weight.shape)}, expected {expected}")
    set_tensor(gm, conv.weight, weight.to(dtype=w.dtype, device=w.device))


def prune_depthwise(gm: fx.GraphModule, conv: ConvSpec, keep: Sequence[int] | Tensor) -> None:
    """Keep filters `keep` of a depthwise conv and rewrite its `groups` argument."""
    keep = check_keep(keep, conv.groups, f"{conv.weight} depthwise filters")
    _slice(gm, conv.weight, 0, keep)
    _slice(gm, live_bias(conv), 0, keep)
    node = conv.node
    if node.target is torch.ops.aten.convolution.default:
        node.update_arg(8, keep.numel())
    elif "groups" in node.kwargs:
        node.update_kwarg("groups", keep.numel())
    else:
        args = list(node.args) + [None] * (7 - len(node.args))
        args[5] = args[5] if args[5] is not None else [1, 1]  # dilation must precede groups
        args[6] = keep.numel()
        node.args = tuple(args)


def prune_batch_norm(gm: fx.GraphModule, node: fx.Node, keep: Sequence[int] | Tensor) -> None:
    """Keep entries `keep` of a BatchNorm's weight, bias, running mean and variance."""
    if node.target not in BATCH_NORM_OPS:
        raise SurgeryError(f"{node.name} is not a batch norm")
    mean = node.args[3]
    size = get_tensor(gm, mean.target).shape[0]
    keep = check_keep(keep, size, f"{node.name} entries")
    for arg in node.args[1:5]:
        if isinstance(arg, fx.Node) and arg.op == "get_attr":
            _slice(gm, arg.target, 0, keep)


def prune_linear_in_features(gm: fx.GraphModule, linear: LinearSpec, keep: Sequence[int] | Tensor,
                             weight: Tensor | None = None) -> None:
    """Keep input features `keep` of a Linear; `weight` (out, kept) replaces the sliced weight, when given."""
    w = get_tensor(gm, linear.weight)
    keep = check_keep(keep, w.shape[1], f"{linear.weight} input features")
    if weight is None:
        weight = w.index_select(1, keep.to(w.device))
    if tuple(weight.shape) != (w.shape[0], keep.numel()):
        raise SurgeryError(f"{linear.weight}: new weight has shape {tuple(weight.shape)}, expected "
                           f"{(w.shape[0], keep.numel())}")
    set_tensor(gm, linear.weight, weight.to(dtype=w.dtype, device=w.device))


def prune_consumer(gm: fx.GraphModule, consumer: ConvSpec | LinearSpec, keep: Sequence[int] | Tensor,
                   weight: Tensor | None = None) -> None:
    if isinstance(consumer, LinearSpec):
        prune_linear_in_features(gm, consumer, keep, weight)
    else:
        prune_conv_in_channels(gm, consumer, keep, weight)


def rewrite_channel_pad(gm: fx.GraphModule, pad: ChannelPad) -> None:
    """Make a channel pad produce `pad.out_keep` of its output channels from the `pad.in_keep` channels its
    input still has: a zero channel is appended to the input and an index buffer picks, for each kept
    output channel `before + c`, input channel c where it is kept and the zero channel otherwise."""
    in_keep = pad.in_keep if pad.in_keep is not None else list(range(pad.in_channels))
    out_keep = pad.out_keep if pad.out_keep is not None else list(range(pad.out_channels))
    position = {c: i for i, c in enumerate(in_keep)}
    index = torch.tensor([position.get(o - pad.before, len(in_keep)) for o in out_keep], dtype=torch.long)
    if pad.index is not None:
        set_tensor(gm, pad.index, index)
        return
    names = {name for name, _ in gm.named_buffers()}
    pad.index = next(f"osscar_channel_index_{i}" for i in range(len(names) + 1)
                     if f"osscar_channel_index_{i}" not in names)
    gm.register_buffer(pad.index, index)
    node = pad.node
    graph = gm.graph
    with graph.inserting_before(node):
        zero = graph.call_function(torch.ops.aten.constant_pad_nd.default, (node.args[0], [0, 0, 0, 0, 0, 1], 0.0))
        index_node = graph.get_attr(pad.index)
        gather = graph.call_function(torch.ops.aten.index_select.default, (zero, 1, index_node))
    node.replace_all_uses_with(gather)
    graph.erase_node(node)
    pad.node = gather


def prune_group(gm: fx.GraphModule, group: ChannelGroup, keep: Sequence[int] | Tensor,
                consumer_weights: Sequence[Tensor | None] | None = None) -> None:
    """Remove every channel of `group` not in `keep`: producers' outputs, BatchNorm entries, depthwise
    filters, per-channel parameters, channel pads, and consumers' inputs (`consumer_weights[i]`, when
    given, replaces consumer i's sliced weight: the solver's refit)."""
    keep = check_keep(keep, group.channels, f"group {group.name}")
    weights = list(consumer_weights) if consumer_weights is not None else [None] * len(group.consumers)
    if len(weights) != len(group.consumers):
        raise SurgeryError(f"group {group.name}: {len(weights)} consumer weights for {len(group.consumers)} consumers")
    for producer in group.producers:
        prune_conv_out_channels(gm, producer, keep)
    for node in group.chain:
        if node.target in BATCH_NORM_OPS:
            prune_batch_norm(gm, node, keep)
        elif (spec := conv_spec(node)) is not None:
            prune_depthwise(gm, spec, keep)
    for target, dim in group.params:
        _slice(gm, target, dim, keep)
    for pad in group.pads_in:
        pad.in_keep = keep.tolist()
        rewrite_channel_pad(gm, pad)
    for pad in group.pads_out:
        pad.out_keep = keep.tolist()
        rewrite_channel_pad(gm, pad)
    for consumer, weight in zip(group.consumers, weights, strict=True):
        prune_consumer(gm, consumer, keep, weight)
    _resize_reshapes(gm, group, len(keep))
    gm.recompile()


SHAPED_RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _resize_reshapes(gm: fx.GraphModule, group: ChannelGroup, kept: int) -> None:
    """A reshape in the group's space (the analysis lets through only those that keep dim 1 as the channels,
    a 1 x 1 map flattened) whose target shape states the channel count as a constant says the new one (HF
    EfficientNet's pooled features: `view(batch, 320)`)."""
    for node in gm.graph.nodes:
        if node.name not in group.tensors or node.target not in SHAPED_RESHAPES:
            continue
        shape = list(node.args[1])
        if len(shape) > 1 and isinstance(shape[1], int) and shape[1] == group.channels:
            shape[1] = kept
            node.args = (node.args[0], shape, *node.args[2:])


prune_unit = prune_group  # an in-block unit is a group with one producer and one consumer


def add_output_shift(gm: fx.GraphModule, conv: ConvSpec | LinearSpec, shift: Tensor) -> None:
    """Add a constant per output channel to a conv's (or a Linear's) output: into its bias, else into the
    running mean of the BatchNorm that alone consumes it, else as a new bias parameter."""
    w = get_tensor(gm, conv.weight)
    if shift.shape != (w.shape[0],):
        raise SurgeryError(f"{conv.weight}: shift has shape {tuple(shift.shape)}, expected ({w.shape[0]},)")
    if (bias_target := live_bias(conv)) is not None:
        bias = get_tensor(gm, bias_target)
        set_tensor(gm, bias_target, bias + shift.to(bias))
        return
    users = list(conv.node.users)
    if len(users) == 1 and users[0].target in BATCH_NORM_OPS and users[0].args[0] is conv.node:
        mean_node = users[0].args[3]
        mean = get_tensor(gm, mean_node.target)
        set_tensor(gm, mean_node.target, mean - shift.to(mean))  # BN(y + s) = BN'(y), mean' = mean - s
        return
    owner, _ = owner_of(gm, conv.weight)
    owner_path = conv.weight.rpartition(".")[0]
    name = "bias"
    for i in itertools.count(1):  # a free name: convs whose weights one module holds must not share one bias
        if not hasattr(owner, name):
            break
        name = "output_shift" if i == 1 else f"output_shift_{i}"
    owner.register_parameter(name, nn.Parameter(shift.to(w).clone(), requires_grad=False))
    target = f"{owner_path}.{name}" if owner_path else name
    with gm.graph.inserting_before(conv.node):
        bias_node = gm.graph.get_attr(target)
    args = list(conv.node.args) + [None] * (3 - len(conv.node.args))  # conv2d(x, w) has no bias slot yet
    args[2] = bias_node
    conv.node.args = tuple(args)
    gm.recompile()
