"""Physical removal of attention heads and FFN neurons in HF transformer blocks, and reloading.

Heads: q/k/v output rows and the output projection's input rows, head_dim at a time. Under
grouped-query attention there are two units: whole KV groups (`prune_heads`: a KV head with all the
query heads that share it, so every layer keeps `heads / kv_heads` query heads per KV head, as
`repeat_kv` assumes), or single query heads (`prune_query_heads`: the paper's groups; a KV head goes
when no kept query head reads it, and the attention reads KV heads through an index, `attention.py`).
Without GQA both are the same. FFN neurons: up (and gate) output rows, down input rows.
Fused projections keep their layout: [q | k | v] (GPT-2, Phi-3 under GQA), [q_h | k_h | v_h] per head
(GPT-NeoX), [gate | up] (Phi-3); a count the attention reads from its shared config (Phi-3's query heads)
moves to a per-layer view of that config (`LayerConfig`).
Projections are nn.Linear (weight out x in) or transformers' Conv1D (weight in x out); the helpers
below are the only code that knows the difference.
Whole layers (`remove_layers`): the block leaves the ModuleList and the config counts one layer fewer
(its per-layer lists too), so a saved model is a standard, shallower checkpoint of its family.
Layers end up with different widths; `widths()` records them and `load_pruned()` rebuilds the model
from its config, applies the widths and loads the weights, so save -> reload gives the same outputs.
"""

from __future__ import annotations

import copy
import json
import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import ModelReferenceError, UnsupportedArchitecture
from ..modules import check_keep, owner_of
from ..solver.problem import group_rows
from .adapters import (
    FIXED_HEADS,
    LINEAR_MIXER,
    adapter_at,
    adapter_for,
    base_path,
    dense_ffn_layers,
    dims,
    has_module,
    layers,
    layers_path,
    restate_dense_ffn_layers,
    submodule,
)
from .attention import use_gathered_attention
from .experts import expert_hidden, expert_width, is_experts, keep_expert_neurons
from .sublayers import ATTENTION, FFN, is_removed, remove_sublayer, renumber_caches, softmax_attentions

MANIFEST = "osscar_widths.json"

log = logging.getLogger(__name__)


def _is_conv1d(module: nn.Module) -> bool:
    # by the MRO: a half-precision model read in float32 (`precision.float32_view`) has a parametrized subclass
    return any(cls.__name__ == "Conv1D" for cls in type(module).__mro__) and hasattr(module, "nf") \
        and hasattr(module, "nx")


def is_projection(module: nn.Module) -> bool:
    """An nn.Linear, or transformers' Conv1D (GPT-2: a Linear with its weight stored transposed)."""
    return isinstance(module, nn.Linear) or _is_conv1d(module)


def projection(layer: nn.Module, path: str) -> nn.Module:
    """The projection at `path`, or a Mixture-of-Experts layer's experts (their down projections: `in_features` is
    each expert's width, `out_features` the stream's; the weight helpers below refuse them)."""
    module = layer.get_submodule(path)
    if not is_projection(module) and not is_experts(module):
        raise TypeError(f"{path} is a {type(module).__name__}, expected nn.Linear, Conv1D or a layer's experts")
    return module


def in_features(proj: nn.Module) -> int:
    if is_experts(proj):
        return expert_width(proj)
    return proj.nx if _is_conv1d(proj) else proj.in_features


def out_features(proj: nn.Module) -> int:
    if is_experts(proj):
        return expert_hidden(proj)
    return proj.nf if _is_conv1d(proj) else proj.out_features


def dense_weight(proj: nn.Module) -> Tensor:
    """The weight as the solver's W_hat: in x out (a view)."""
    return proj.weight.detach() if _is_conv1d(proj) else proj.weight.detach().T


def set_weight(proj: nn.Module, weight: Tensor) -> None:
    """Replace a projection's weight values by `weight` (in x out, as `dense_weight` gives it), in the projection's
    own layout, dtype and device (the same parameter object: an optimiser or a view of it still sees it)."""
    expected = (in_features(proj), out_features(proj))
    if tuple(weight.shape) != expected:
        raise ValueError(f"new weight has shape {tuple(weight.shape)}, expected {expected}")
    proj.weight.data.copy_(weight if _is_conv1d(proj) else weight.T)


def add_bias(proj: nn.Module) -> None:
    """Give a bias-free projection a zero bias (its output's intercept: FLAP's bias compensation on Llama-style
    layers), in the weight's dtype and device; a projection with a bias keeps it."""
    if proj.bias is None:
        proj.bias = nn.Parameter(proj.weight.new_zeros(out_features(proj)), requires_grad=False)


def keep_output_rows(proj: nn.Module, rows: Tensor) -> None:
    """Keep output features `rows` of a projection (weight rows or Conv1D columns, bias entries)."""
    rows = check_keep(rows, out_features(proj), "projection output features").to(proj.weight.device)
    axis = 1 if _is_conv1d(proj) else 0
    proj.weight = nn.Parameter(proj.weight.data.index_select(axis, rows).clone(), requires_grad=False)
    if proj.bias is not None:
        proj.bias = nn.Parameter(proj.bias.data.index_select(0, rows).clone(), requires_grad=False)
    if _is_conv1d(proj):
        proj.nf = rows.numel()
    else:
        proj.out_features = rows.numel()


def keep_input_columns(proj: nn.Module, cols: Tensor, weight: Tensor | None = None) -> None:
    """Keep input features `cols` of a projection; `weight` (out x kept) replaces the slice (a refit)."""
    cols = check_keep(cols, in_features(proj), "projection input features").to(proj.weight.device)
    if weight is None:
        new = proj.weight.data.index_select(0 if _is_conv1d(proj) else 1, cols)
    else:
        if tuple(weight.shape) != (out_features(proj), cols.numel()):
            raise ValueError(f"new weight has shape {tuple(weight.shape)}, expected "
                             f"{(out_features(proj), cols.numel())}")
        new = weight.T if _is_conv1d(proj) else weight
    proj.weight = nn.Parameter(new.to(proj.weight).contiguous().clone(), requires_grad=False)
    if _is_conv1d(proj):
        proj.nx = cols.numel()
    else:
        proj.in_features = cols.numel()


def prune_ffn(model: nn.Module, index: int, keep: Sequence[int] | Tensor, down_weight: Tensor | None = None) -> None:
    """Keep FFN neurons `keep` of block `index` (down_weight: the refit down projection, out x kept)."""
    layer = layers(model)[index]
    adapter = adapter_for(model).at(layer)  # a MoE family's layer with a dense FFN: that FFN's paths
    if is_removed(model, index, FFN):
        raise ValueError(f"layer {index}'s FFN is removed: it has no neurons to keep")
    down = projection(layer, adapter.down)
    width = in_features(down)
    keep = check_keep(keep, width, f"layer {index} FFN neurons")
    if is_experts(down):  # the same neurons of every expert (`experts.keep_expert_neurons`: each its own)
        if down_weight is not None:
            raise ValueError(f"layer {index}'s experts take one refit down weight per expert (keep_expert_neurons)")
        keep_expert_neurons(down, [keep] * down.down_proj.shape[0])
        return
    rows = torch.cat([keep, width + keep]) if adapter.fused_up else keep  # [gate | up]: the neuron in each half
    for path in adapter.up:
        keep_output_rows(projection(layer, path), rows)
    keep_input_columns(down, keep, down_weight)


def prune_shared_ffn(model: nn.Module, index: int, keep: Sequence[int] | Tensor,
                     down_weight: Tensor | None = None) -> None:
    """Keep neurons `keep` of block `index`'s shared expert (`FamilyAdapter.shared_down`; down_weight: its refit down
    projection, out x kept)."""
    layer = layers(model)[index]
    adapter = adapter_for(model).at(layer)
    if adapter.shared_down is None:
        raise ValueError(f"{model.config.model_type}'s layer {index} has no shared expert")
    if is_removed(model, index, FFN):
        raise ValueError(f"layer {index}'s FFN is removed: its shared expert has no neurons to keep")
    down = projection(layer, adapter.shared_down)
    width = in_features(down)
    keep = check_keep(keep, width, f"layer {index} shared expert neurons")
    rows = torch.cat([keep, width + keep]) if adapter.shared_fused_up else keep  # [gate | up]: the neuron in each half
    for path in adapter.shared_up:
        keep_output_rows(projection(layer, path), rows)
    keep_input_columns(down, keep, down_weight)


def shared_width(model: nn.Module, index: int) -> int:
    """Neurons of block `index`'s shared expert (0 once its FFN is removed, or where the layer's FFN is dense)."""
    layer = layers(model)[index]
    shared = adapter_for(model).at(layer).shared_down
    if is_removed(model, index, FFN) or shared is None:
        return 0
    return in_features(projection(layer, shared))


def _query_width(model: nn.Module, layer: nn.Module) -> int:
    """Query heads x head_dim: the output projection's inputs, whatever the q/k/v layout (a linear-attention mixer's:
    its value heads x their size, `FamilyAdapter.at`)."""
    return in_features(projection(layer, adapter_for(model).at(layer).o))


def _index_of(model: nn.Module, layer: nn.Module) -> int:
    """The index of block `layer` among the model's blocks."""
    return next(i for i, block in enumerate(layers(model)) if block is layer)


def _keep_heads(model: nn.Module, layer: nn.Module, heads: Tensor, kv_heads: Tensor, o_weight: Tensor | None) -> None:
    """Keep query heads `heads` and KV heads `kv_heads` (indices of the current ones) in q/k/v and the output
    projection, and every count the attention reads (its attributes, its config view)."""
    adapter, hd = adapter_for(model).at(layer), dims(model, _index_of(model, layer)).head_dim
    narrowed = len(heads) < _query_width(model, layer) // hd
    if not adapter.heads_prunable and narrowed:
        why = LINEAR_MIXER if adapter.recurrent else \
            f"{FIXED_HEADS}, so removing a head would renormalise every kept one"
        raise UnsupportedArchitecture(f"{model.config.model_type}'s attention heads are not a prunable unit: {why}")
    if adapter.recurrent:  # a linear-attention mixer: its attention's heads are no unit of it
        if narrowed:
            raise ValueError(f"layer {_index_of(model, layer)} mixes tokens by linear attention, whose units are no "
                             "attention heads: prune_mixer_units")
        return
    q_rows, kv_rows = group_rows(heads, hd), group_rows(kv_heads, hd)
    if adapter.latent_attention:  # each head's query rows and its key / value rows from the shared latent
        _keep_latent_heads(model, layer, heads)
    elif adapter.qkv_per_head:  # [q_h | k_h | v_h] per head (no GQA in this layout)
        assert torch.equal(heads, kv_heads), (heads, kv_heads)
        keep_output_rows(projection(layer, adapter.q), group_rows(heads, 3 * hd))
    elif adapter.fused_qkv:  # [q | k | v]: the query heads' rows, then the KV heads' in each of k and v
        qkv = projection(layer, adapter.q)
        q_width = _query_width(model, layer)
        kv_width = (out_features(qkv) - q_width) // 2
        keep_output_rows(qkv, torch.cat([q_rows, q_width + kv_rows, q_width + kv_width + kv_rows]))
    else:  # a gated query's head is its query rows and its gate's (`FamilyAdapter.gated_query`)
        keep_output_rows(projection(layer, adapter.q), group_rows(heads, 2 * hd) if adapter.gated_query else q_rows)
        keep_output_rows(projection(layer, adapter.k), kv_rows)
        if has_module(layer, adapter.v):  # none in Gemma 4's global layers: their values are their keys
            keep_output_rows(projection(layer, adapter.v), kv_rows)
    modules = dict(layer.named_modules())
    for path in adapter.per_head_outputs:  # where the block has them
        if path in modules:
            keep_output_rows(projection(layer, path), q_rows)
    keep_input_columns(projection(layer, adapter.o), q_rows, o_weight)
    # the kept heads' entries of per-head tables, where the block has them: one column per head ((positions, heads)
    # bias tables, (heads,) sinks), one row or module per query or KV head (per-head q / k norms)
    for paths, kept, axis in ((adapter.head_columns, heads, -1), (adapter.head_rows, heads, 0),
                              (adapter.kv_head_rows, kv_heads, 0)):
        for path in paths:
            owner_path, _, name = path.rpartition(".")
            owner = modules.get(owner_path)
            entries = getattr(owner, name, None)
            if isinstance(entries, nn.ModuleList):
                setattr(owner, name, nn.ModuleList([entries[i] for i in kept.tolist()]))
            elif entries is not None:
                setattr(owner, name, nn.Parameter(entries.data.index_select(axis, kept.to(entries.device)).clone(),
                                                  requires_grad=entries.requires_grad))
    for attr in adapter.head_count_attrs:
        _set_attr(layer, attr, len(heads))
    for attr in adapter.width_attrs:
        _set_attr(layer, attr, q_rows.numel())
    for attr in adapter.kv_count_attrs:
        _set_attr(layer, attr, len(kv_heads))
    if adapter.head_bias is not None:
        bias_module = layer.get_submodule(adapter.head_bias)
        current = getattr(bias_module, "bias_rows", None)
        rows = heads if current is None else torch.tensor(current, dtype=torch.long)[heads]
        set_bias_rows(bias_module, rows.tolist())
        if adapter.bias_relay is not None:
            relay_bias(layer.get_submodule(adapter.bias_relay), bias_module)
    if adapter.config_head_count:
        attention = _attention(model, layer)
        if not isinstance(attention.config, LayerConfig):
            attention.config = LayerConfig(attention.config)
        attention.config.own[adapter.heads_key] = len(heads)


def _keep_latent_heads(model: nn.Module, layer: nn.Module, heads: Tensor) -> None:
    """Multi-head latent attention's query and key / value rows of heads `heads` (`FamilyAdapter.latent_attention`):
    q_b_proj's (q_proj's without a query latent) qk_nope + qk_rope rows a head, kv_b_proj's qk_nope + v rows a head;
    the latents, and the cache that holds them, stay whole."""
    config, attention = model.config, _attention(model, layer)
    query = getattr(attention, "q_b_proj", None) or attention.q_proj
    keep_output_rows(query, group_rows(heads, int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim)))
    keep_output_rows(attention.kv_b_proj, group_rows(heads, int(config.qk_nope_head_dim) + int(config.v_head_dim)))


def set_bias_rows(module: nn.Module, rows: Sequence[int]) -> None:
    """Make `module` read only rows `rows` (its kept heads, in the dense numbering) of the per-head score bias
    it is passed as `position_bias` (batch, heads, q, k), which the model computes once for every layer. The
    rows as data (`bias_rows`, what the manifest records) and as a buffer outside the state dict; a forward
    pre-hook (installed once, kept by deepcopy and traced by the export) selects them."""
    module.bias_rows = tuple(int(r) for r in rows)
    device = next(module.parameters()).device
    module.register_buffer("bias_index", torch.tensor(module.bias_rows, dtype=torch.long, device=device),
                          persistent=False)
    if not getattr(module, "bias_hooked", False):
        import inspect

        module.bias_argument = list(inspect.signature(module.forward).parameters).index("position_bias")
        module.register_forward_pre_hook(_select_bias_rows, with_kwargs=True)
        module.bias_hooked = True


def _select_bias_rows(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    at = module.bias_argument
    if kwargs.get("position_bias") is not None:
        kwargs = {**kwargs, "position_bias": kwargs["position_bias"].index_select(1, module.bias_index)}
    elif len(args) > at and args[at] is not None:
        args = (*args[:at], args[at].index_select(1, module.bias_index), *args[at + 1:])
    return args, kwargs


def relay_bias(relay: nn.Module, attention: nn.Module) -> None:
    """Make `relay` (T5's layer.0, which calls `attention` with the per-head position bias it was handed and returns the
    bias the attention returns) hand on the whole bias it was given, not the rows of the heads `attention` kept
    (`set_bias_rows`), and compute it where it was handed none and the attention would (the first layer's): a later
    layer reads its own heads' rows of the dense bias. Two hooks, installed once, kept by deepcopy and traced by the
    export."""
    if getattr(relay, "bias_relayed", False):
        return
    relay.register_forward_pre_hook(_whole_bias_in, with_kwargs=True)
    relay.register_forward_hook(_whole_bias_on, with_kwargs=True)
    relay.bias_relayed = True


def _relayed_attention(relay: nn.Module) -> nn.Module:
    return next(m for m in relay.children() if getattr(m, "bias_hooked", False))


def _whole_bias_in(relay: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    if kwargs.get("position_bias") is not None:
        return None
    attention = _relayed_attention(relay)
    if not getattr(attention, "has_relative_attention_bias", False):
        return None
    length = args[0].shape[1] if args else kwargs["hidden_states"].shape[1]  # (batch, length, hidden)
    bias = attention.compute_bias(length, length, device=attention.relative_attention_bias.weight.device)
    return args, {**kwargs, "position_bias": bias}  # (1, dense heads, length, length)


def _whole_bias_on(relay: nn.Module, args: tuple, kwargs: dict, output: tuple) -> tuple:
    return (output[0], kwargs.get("position_bias"), *output[2:])


class LayerConfig:
    """A model's config as one layer's attention reads it: the counts in `own` (this layer's), every other
    field read from and written to the shared config. So a switch of the model's attention implementation
    (the ONNX export's, `use_gathered_attention`) still reaches a layer whose head count differs."""

    def __init__(self, base: object) -> None:
        self.__dict__["base"] = base
        self.__dict__["own"] = {}

    def __getattr__(self, name: str):  # only for names not in __dict__
        if name.startswith("__") or name in ("base", "own"):  # copy/pickle probe special names before __init__
            raise AttributeError(name)
        own = self.__dict__["own"]
        return own[name] if name in own else getattr(self.base, name)

    def __setattr__(self, name: str, value) -> None:
        if name in self.own:
            self.own[name] = value
        else:
            setattr(self.base, name, value)


def head_groups(model: nn.Module, index: int) -> int:
    """Prunable head groups of block `index`: KV heads under GQA, heads otherwise."""
    _check_whole_groups(model, index)
    d = dims(model, index)
    return _query_width(model, layers(model)[index]) // (d.head_dim * d.group)


def _check_whole_groups(model: nn.Module, index: int) -> None:
    """Groups are `group` query heads over one KV head each: not so once query heads were pruned one by one."""
    mapping = getattr(_attention(model, layers(model)[index]), "kv_map", None)
    group = dims(model, index).group
    if mapping is not None and list(mapping) != [h // group for h in range(len(mapping))]:
        raise ValueError(f"layer {index}'s query heads were pruned one by one (KV heads {list(mapping)}): its heads "
                         "are no longer whole groups; prune them with prune_query_heads")


def prune_heads(model: nn.Module, index: int, keep_groups: Sequence[int] | Tensor,
                o_weight: Tensor | None = None) -> None:
    """Keep head groups `keep_groups` of block `index` (see head_groups); o_weight: the refit output
    projection (out x kept query-head rows)."""
    layer, d = layers(model)[index], dims(model, index)
    if is_removed(model, index, ATTENTION):
        raise ValueError(f"layer {index}'s attention is removed: it has no heads to keep")
    _check_whole_groups(model, index)
    width = _query_width(model, layer)
    keep = check_keep(keep_groups, width // (d.head_dim * d.group), f"layer {index} head groups")
    # a group is one KV head and the `group` query heads that share it (one without GQA)
    _keep_heads(model, layer, group_rows(keep, d.group), keep, o_weight)


def linear_mixer(model: nn.Module, index: int) -> nn.Module:
    """Block `index`'s linear-attention mixer whose units are prunable (`FamilyAdapter.linear_heads`), refusing any
    other block."""
    adapter = adapter_at(model, index)
    if not (adapter.recurrent and adapter.heads_prunable):
        raise ValueError(f"layer {index} has no linear-attention mixer with prunable units")
    return layers(model)[index].get_submodule(adapter_for(model).linear_attention)


# the attribute a pruned Mamba2 mixer keeps its unit's head count in (`ssd_unit_heads`); private (a leading
# underscore), so the remote code of a pruned model (`remote.py`) does not take it for a changed field
UNIT_HEADS = "_osscar_unit_heads"


def is_ssd(mixer: nn.Module) -> bool:
    """Whether a linear-attention mixer is a Mamba2 mixer (a selective scan with a state size)."""
    return hasattr(mixer, "ssm_state_size")


def is_short_conv(mixer: nn.Module) -> bool:
    """Whether a linear-attention mixer is LFM2's gated short convolution (else a Gated DeltaNet or a Mamba2 mixer)."""
    return not hasattr(mixer, "num_k_heads") and not is_ssd(mixer)


def ssd_unit_heads(mixer: nn.Module) -> int:
    """A Mamba2 mixer's heads in one of its units: a group's (its B and C rows, read by those heads alone) where it
    was built with several; one head where it was built with one group, whose B and C every head reads. Read from the
    mixer as built (`UNIT_HEADS`, set as it is first pruned): a mixer of several groups pruned to one keeps groups
    as its units."""
    built = getattr(mixer, UNIT_HEADS, None)
    if built is not None:
        return int(built)
    groups = int(mixer.n_groups)
    return int(mixer.num_heads) // groups if groups > 1 else 1


def mixer_units(model: nn.Module, index: int) -> int:
    """Prunable units of block `index`'s linear-attention mixer: a Gated DeltaNet's key heads (each with the value
    heads reading it), a short convolution's channels, a Mamba2 mixer's groups (or heads, in one group)."""
    mixer = linear_mixer(model, index)
    if is_ssd(mixer):
        return int(mixer.num_heads) // ssd_unit_heads(mixer)
    return int(mixer.conv.in_channels) if is_short_conv(mixer) else int(mixer.num_k_heads)


def mixer_unit_width(model: nn.Module, index: int) -> int:
    """The output projection's input columns of one unit of block `index`'s linear-attention mixer: a key group's
    value heads', one channel's, a Mamba2 unit's heads'."""
    mixer = linear_mixer(model, index)
    if is_ssd(mixer):
        return ssd_unit_heads(mixer) * int(mixer.head_dim)
    if is_short_conv(mixer):
        return 1
    return int(mixer.num_v_heads) // int(mixer.num_k_heads) * int(mixer.head_v_dim)


def prune_mixer_units(model: nn.Module, index: int, keep: Sequence[int] | Tensor,
                      o_weight: Tensor | None = None, energy: Tensor | None = None) -> None:
    """Keep units `keep` of block `index`'s linear-attention mixer (`mixer_units`); o_weight: the refit output
    projection (out x kept columns). Every other unit's output is unchanged, so removing one equals zeroing its
    output projection columns (but a Mamba2 mixer's heads of one group: `energy`, each output projection input's
    mean square on calibration data, rescales its gated norm, `_keep_ssd_units`)."""
    mixer = linear_mixer(model, index)
    if is_ssd(mixer):
        _keep_ssd_units(mixer, check_keep(keep, mixer_units(model, index), f"layer {index} Mamba2 units"), o_weight,
                        energy)
    elif is_short_conv(mixer):
        _keep_conv_channels(mixer, check_keep(keep, int(mixer.conv.in_channels), f"layer {index} conv channels"),
                            o_weight)
    else:
        _keep_key_groups(mixer, check_keep(keep, int(mixer.num_k_heads), f"layer {index} delta-net key heads"),
                         o_weight)


def _keep_depthwise(conv: nn.Conv1d, channels: Tensor) -> None:
    """Keep `channels` of a depthwise conv (a channel's filter is its weight row)."""
    conv.weight = nn.Parameter(conv.weight.data.index_select(0, channels.to(conv.weight.device)).clone(),
                               requires_grad=False)
    if conv.bias is not None:
        conv.bias = nn.Parameter(conv.bias.data.index_select(0, channels.to(conv.bias.device)).clone(),
                                 requires_grad=False)
    conv.in_channels = conv.out_channels = conv.groups = channels.numel()


def _keep_conv_channels(mixer: nn.Module, keep: Tensor, o_weight: Tensor | None) -> None:
    """LFM2's short convolution y = C * conv(B * x), each channel c its own: its B, C and x rows of in_proj ([B | C |
    x], a third each), its filter and its out_proj column."""
    width = int(mixer.conv.in_channels)
    keep_output_rows(mixer.in_proj, torch.cat([keep, width + keep, 2 * width + keep]))
    _keep_depthwise(mixer.conv, keep)
    keep_input_columns(mixer.out_proj, keep, o_weight)


def _keep_ssd_units(mixer: nn.Module, keep: Tensor, o_weight: Tensor | None, energy: Tensor | None = None) -> None:
    """A Mamba2 mixer's units `keep` (`ssd_unit_heads`): each head's gate (z), x and time-step rows of in_proj ([z | x |
    B | C | dt]), its x conv channels, A_log, D and dt_bias entries, its gated norm's weights and out_proj columns; a
    kept group's B and C rows and conv channels. A head's scan reads its own x and time step and its group's B and C;
    the gated norm normalises each group: with several groups a group removed leaves the others' outputs as they were,
    with one group the kept heads are normalised over themselves, their outputs scaled by rms_all / rms_kept (the root
    mean square of the gated scan over every channel, over the kept ones). Where `energy` gives each output projection
    input's mean square (x_c = w_c g_c / rms_all, the norm's weight w), the kept norm weights are multiplied by that
    factor's inverse on average: the root of the kept channels' mean of energy_c / w_c^2 over all channels' (an
    approximation still, per token; the refit output projection and the job's measured loss account for the rest)."""
    heads, size = int(mixer.num_heads), int(mixer.head_dim)
    groups, state = int(mixer.n_groups), int(mixer.ssm_state_size)
    inner, grouped = heads * size, groups * state  # x's channels; B's (and C's)
    unit = ssd_unit_heads(mixer)
    kept_groups = keep if groups > 1 else torch.zeros(1, dtype=torch.long, device=keep.device)
    kept_heads = group_rows(keep, unit)
    channels, states = group_rows(kept_heads, size), group_rows(kept_groups, state)  # of x; of B (and C)
    keep_output_rows(mixer.in_proj, torch.cat([channels, inner + channels, 2 * inner + states,
                                               2 * inner + grouped + states, 2 * inner + 2 * grouped + kept_heads]))
    _keep_depthwise(mixer.conv1d, torch.cat([channels, inner + states, inner + grouped + states]))
    for name in ("A_log", "D", "dt_bias"):  # one entry per head
        entries = getattr(mixer, name)
        setattr(mixer, name, nn.Parameter(entries.data.index_select(0, kept_heads.to(entries.device)).clone(),
                                          requires_grad=entries.requires_grad))
    norm = mixer.norm
    scale = 1.0
    if groups == 1 and energy is not None:  # each channel's normalised mean square, g_c^2 / rms(g)^2 on average
        weight = norm.weight.detach().double().cpu()
        relative = energy.detach().double().cpu() / weight.square().clamp(min=1e-12 * float(weight.square().max()))
        scale = float((relative[channels.cpu()].mean() / relative.mean()).sqrt())
    norm.weight = nn.Parameter(norm.weight.data.index_select(0, channels.to(norm.weight.device)).clone() * scale,
                               requires_grad=False)
    if groups == 1:
        norm.group_size = channels.numel()
    keep_input_columns(mixer.out_proj, channels, o_weight)
    mixer.num_heads, mixer.n_groups, mixer.intermediate_size = kept_heads.numel(), kept_groups.numel(), channels.numel()
    mixer.conv_dim = channels.numel() + 2 * states.numel()
    setattr(mixer, UNIT_HEADS, unit)  # a unit stays what it was built as (several groups pruned to one: groups)


def _keep_key_groups(mixer: nn.Module, keep: Tensor, o_weight: Tensor | None) -> None:
    """A Gated DeltaNet's key heads `keep`, each with the value heads that read it (value head j reads key head
    j // (value heads / key heads)): their query and key rows, their value heads' value, output gate (z), beta (b) and
    decay (a) rows, conv channels, decay parameters (A_log, dt_bias) and output projection columns. A value head's
    state reads its own key head, the conv is per channel and the gated norm per head. Qwen3-Next's fused
    projections hold each key group's rows together ([q_g | k_g | v_g | z_g], [b_g | a_g])."""
    k_heads, v_heads = int(mixer.num_k_heads), int(mixer.num_v_heads)
    hk, hv, ratio = int(mixer.head_k_dim), int(mixer.head_v_dim), v_heads // k_heads
    values = group_rows(keep, ratio)  # the kept value heads
    key_rows, value_rows = group_rows(keep, hk), group_rows(values, hv)
    key_dim = k_heads * hk
    # the conv's channels are [q | k | v] in every layout (Qwen3-Next's are concatenated so before the conv)
    channels = torch.cat([key_rows, key_dim + key_rows, 2 * key_dim + value_rows])
    if hasattr(mixer, "in_proj_qkvz"):  # per key group: [q_g | k_g | v_g | z_g] and [b_g | a_g]
        keep_output_rows(mixer.in_proj_qkvz, group_rows(keep, 2 * hk + 2 * ratio * hv))
        keep_output_rows(mixer.in_proj_ba, group_rows(keep, 2 * ratio))
    else:
        keep_output_rows(mixer.in_proj_qkv, channels)
        keep_output_rows(mixer.in_proj_z, value_rows)
        keep_output_rows(mixer.in_proj_b, values)
        keep_output_rows(mixer.in_proj_a, values)
    _keep_depthwise(mixer.conv1d, channels)
    for name in ("A_log", "dt_bias"):  # one entry per value head
        entries = getattr(mixer, name)
        setattr(mixer, name, nn.Parameter(entries.data.index_select(0, values.to(entries.device)).clone(),
                                          requires_grad=entries.requires_grad))
    keep_input_columns(mixer.out_proj, value_rows, o_weight)
    mixer.num_k_heads, mixer.num_v_heads = len(keep), len(values)
    mixer.key_dim, mixer.value_dim = len(keep) * hk, len(values) * hv
    mixer.conv_dim = channels.numel()


def query_heads(model: nn.Module, index: int) -> int:
    """Query heads of block `index` (0 once its attention is removed)."""
    if is_removed(model, index, ATTENTION):
        return 0
    return _query_width(model, layers(model)[index]) // dims(model, index).head_dim


def ffn_width(model: nn.Module, index: int) -> int:
    """FFN neurons of block `index` (0 once its FFN is removed): each expert's in a MoE layer."""
    if is_removed(model, index, FFN):
        return 0
    layer = layers(model)[index]
    return in_features(projection(layer, adapter_for(model).at(layer).down))


def _attention(model: nn.Module, layer: nn.Module) -> nn.Module:
    """The attention module of a block (the owner of its q projection; a linear-attention block's mixer)."""
    return layer.get_submodule(adapter_for(model).at(layer).q.rpartition(".")[0])


def kv_index(model: nn.Module, index: int) -> Tensor:
    """The KV head each query head of block `index` reads (h // group until query heads were pruned)."""
    mapping = getattr(_attention(model, layers(model)[index]), "kv_map", None)
    if mapping is None:
        return torch.arange(query_heads(model, index)) // dims(model, index).group
    return torch.tensor(mapping, dtype=torch.long)


def prune_query_heads(model: nn.Module, index: int, keep_heads: Sequence[int] | Tensor,
                      o_weight: Tensor | None = None) -> None:
    """Keep query heads `keep_heads` of block `index`, one by one; a KV head stays while a kept query
    head reads it. o_weight: the refit output projection (out x kept query-head rows). Without GQA this
    is `prune_heads`."""
    if dims(model, index).group == 1:
        prune_heads(model, index, keep_heads, o_weight)
        return
    mapping = kv_index(model, index)
    keep = check_keep(keep_heads, len(mapping), f"layer {index} query heads")
    kv_keep = torch.unique(mapping[keep])  # sorted
    if _multi_query(model, index):
        # one KV head that every query head reads: the family's own attention repeats it for the heads kept (its
        # num_key_value_groups follows them), so no map is needed and transformers' code still runs the layer
        _keep_heads(model, layers(model)[index], keep, kv_keep, o_weight)
        return
    if not hasattr(_attention(model, layers(model)[index]), "kv_map") and torch.equal(
            keep, group_rows(kv_keep, dims(model, index).group)):
        # whole groups kept (every head, say, where only the FFN narrows): the family's own attention reads them,
        # and a model without a gathered layer loads in transformers with its remote code, or its config alone
        prune_heads(model, index, kv_keep, o_weight)
        return
    _resize_attention(model, index, keep, kv_keep, torch.searchsorted(kv_keep, mapping[keep]), o_weight)


def _multi_query(model: nn.Module, index: int) -> bool:
    """Whether block `index` runs multi-query attention as its family's own code (`FamilyAdapter.multi_query_key`;
    no gathered map)."""
    attention = _attention(model, layers(model)[index])
    return adapter_for(model).multi_query_key is not None and dims(model, index).kv_heads == 1 and \
        not hasattr(attention, "kv_map")


def _resize_attention(model: nn.Module, index: int, heads: Tensor, kv_heads: Tensor, new_index: Tensor,
                      o_weight: Tensor | None) -> None:
    """Keep query heads `heads` and KV heads `kv_heads` (indices of the current ones); `new_index`: the
    kept KV head (0..len(kv_heads)-1) each kept query head reads."""
    adapter, layer = adapter_at(model, index), layers(model)[index]
    assert len(new_index) == len(heads) and set(new_index.tolist()) == set(range(len(kv_heads))), new_index
    _keep_heads(model, layer, heads, kv_heads, o_weight)
    attention = _attention(model, layer)
    # the map as data (what the manifest records; a streamed block's tensors go back to the meta device
    # once stored) and as the buffer the attention gathers with, outside the state dict so that
    # checkpoints keep their keys
    attention.kv_map = tuple(int(k) for k in new_index.tolist())
    attention.register_buffer("kv_index", new_index.to(projection(layer, adapter.q).weight.device), persistent=False)
    use_gathered_attention(model)


# config lists with one entry per layer (which attention each layer runs; SmolLM3's 1 / 0 for a layer with or without
# rotary positions): they shrink with the layers
PER_LAYER_CONFIG = ("layer_types", "no_rope_layers")
# older config keys that state `layer_types` by a rule over the layer index (what a reader from before
# `layer_types` builds the layers from, and what transformers 5 builds them from when a config has no
# `layer_types`): key -> that rule, the attention type of layer i for the key's value v
LEGACY_LAYER_PATTERNS: dict[str, Callable[[int, int], str]] = {
    # Qwen2 / Qwen3 (where a sliding window is set): full attention below the value, sliding from it on
    "max_window_layers": lambda i, v: "sliding_attention" if i >= v else "full_attention",
    # Gemma 3: every v-th layer global
    "sliding_window_pattern": lambda i, v: "sliding_attention" if (i + 1) % v else "full_attention",
    # ModernBERT: layer 0 and every v-th after it global
    "global_attn_every_n_layers": lambda i, v: "sliding_attention" if i % v else "full_attention",
}

# ... and keys listing the layers of one type by index (LFM2's full_attn_idxs; Bamba's attn_layer_indices, from which
# its config computes `layer_types`): key -> that type
LEGACY_LAYER_INDICES: dict[str, str] = {"full_attn_idxs": "full_attention", "attn_layer_indices": "full_attention"}


def remove_layers(model: nn.Module, indices: Sequence[int]) -> None:
    """Remove whole blocks, in place: each becomes the identity of the residual stream (its attention and
    FFN updates gone). The blocks left are renumbered (their `layer_idx`, which a KV cache is indexed by)
    and the config says the new depth, so export, the decode step's cache and a saved checkpoint all see
    an ordinary shallower model. Indices out of range or repeated are refused, listing every bad one."""
    check_removable_layers(model, indices)
    if not indices:
        return
    for key in PER_LAYER_CONFIG:  # before anything changes: a list the config computes from keys not known here
        if getattr(model.config, key, None) is not None and not settable(model.config, key) and \
                not _index_sources(model.config) and not _follows_depth(model.config, key, indices):
            raise UnsupportedArchitecture(f"{model.config.model_type}'s config computes {key} from keys of its own, "
                                          "which removed layers would leave stating another model: layers are not "
                                          "removed whole")
    blocks = layers(model)
    gone = set(indices)
    kept = [block for i, block in enumerate(blocks) if i not in gone]
    for new, (old, block) in enumerate((i, b) for i, b in enumerate(blocks) if i not in gone):
        _keep_inverse_layer_scaling(block, old, new)
    _fold_layer_scales(model, blocks, gone)
    config = model.config
    overrides = per_layer_overrides(config)
    if overrides is not None:  # re-stated for the kept layers below, once the config says their number
        config.per_layer_config = None
    dense = dense_ffn_layers(config)  # a MoE family's layers with a dense FFN, as the config states them
    if dense is not None and len(dense) == len(blocks):
        restate_dense_ffn_layers(config, [flag for i, flag in enumerate(dense) if i not in gone])
    for key in PER_LAYER_CONFIG:
        values = getattr(config, key, None)
        if isinstance(values, list | tuple) and len(values) == len(blocks):
            values = [v for i, v in enumerate(values) if i not in gone]
            if settable(config, key):
                setattr(config, key, values)
                continue
            for source in _index_sources(config):  # computed from the keys it reads (Bamba's attn_layer_indices)
                setattr(config, source, [i for i, v in enumerate(values) if v == LEGACY_LAYER_INDICES[source]])
    _restate_legacy_patterns(config)
    left = [i for i in range(len(blocks)) if i not in gone]
    _restate_backbone_outputs(config, left, len(blocks))
    _keep_layer_columns(model, left, len(blocks))
    _keep_layer_outputs(model, left, len(blocks))
    key = adapter_for(model).depth_scale_key
    if key is not None and getattr(config, key, None) is not None:  # key / sqrt(layers) the same with fewer layers
        setattr(config, key, float(getattr(config, key)) * math.sqrt(len(kept) / len(blocks)))
    owner, name = owner_of(model, layers_path(model))
    setattr(owner, name, nn.ModuleList(kept))
    config.num_hidden_layers = len(kept)
    if overrides is not None:
        config.per_layer_config = {new: overrides[old] for new, old in enumerate(left) if old in overrides}
    restate_depth(model)
    renumber_caches(model)


def _index_sources(config: Any) -> list[str]:
    """The keys of `LEGACY_LAYER_INDICES` the config holds: lists, or None for no layer of that kind (Bamba's
    default)."""
    return [key for key in LEGACY_LAYER_INDICES if hasattr(config, key) and
            isinstance(getattr(config, key), list | type(None))]


def _follows_depth(config: Any, key: str, gone: Sequence[int]) -> bool:
    """Whether the config computes `key` from its depth alone, so that stating the new depth restates it (Falcon-H1's
    layer_types, "hybrid" for every layer): a copy of the config told the depth left computes the kept layers' list."""
    values, gone = getattr(config, key), set(gone)
    if not isinstance(values, list | tuple) or len(values) != config.num_hidden_layers:
        return False
    probe = copy.deepcopy(config)
    probe.num_hidden_layers = config.num_hidden_layers - len(gone)
    return list(getattr(probe, key)) == [v for i, v in enumerate(values) if i not in gone]


def settable(config: Any, key: str) -> bool:
    """Whether the config stores `key` (Bamba's layer_types is a property computed from attn_layer_indices,
    Falcon-H1's from the depth)."""
    name = getattr(type(config), "attribute_map", {}).get(key, key)
    found = getattr(type(config), name, None)
    return not (isinstance(found, property) and found.fset is None)


def restate_depth(model: nn.Module) -> None:
    """What the model's base computed from its depth as it was built, from the config's depth now: Gemma 4's first
    layer reading earlier layers' keys and values (`first_kv_shared_layer_idx`, none without such layers: the
    depth itself)."""
    owner = owner_of(model, layers_path(model))[0]
    if hasattr(owner, "first_kv_shared_layer_idx"):
        config = model.config
        owner.first_kv_shared_layer_idx = config.num_hidden_layers - int(getattr(config, "num_kv_shared_layers", 0))


def per_layer_overrides(config: Any) -> dict[int, dict] | None:
    """A config's per-layer fields (transformers' `per_layer_config`: layer index -> the fields that layer states
    otherwise), or None where it has none."""
    if not getattr(config, "is_heterogeneous", False):
        return None
    return {int(i): dict(fields) for i, fields in config._heterogeneity_spec.per_layer_overrides.items()}


def _fold_layer_scales(model: nn.Module, blocks: Sequence[nn.Module], gone: set[int]) -> None:
    """A removed block's output scalar (`FamilyAdapter.layer_scale`: it multiplies the whole stream, so a removed
    block is the stream times its scalar) carried by the next kept block: that block's scalar is multiplied by it,
    its updates (through the norms of `scaled_norms`) divided by it, its raw reads of the stream (`scaled_reads`)
    multiplied, so that it adds the same updates to a stream that lacks the factor and gives out the same stream
    (its input norms read the stream's direction only). After the last kept block the final norm reads the
    direction only: nothing to carry."""
    adapter = adapter_for(model)
    if adapter.layer_scale is None:
        return
    carried = None  # the product of the removed blocks' scalars since the last kept one
    with torch.no_grad():
        for i, block in enumerate(blocks):
            scale = getattr(block, adapter.layer_scale)
            if i in gone:
                carried = scale.clone() if carried is None else carried * scale
                continue
            if carried is None:
                continue
            scale.mul_(carried.to(scale))
            for path in adapter.scaled_norms:
                norm = submodule(block, path)
                if norm is not None and getattr(norm, "weight", None) is not None:
                    norm.weight.div_(carried.to(norm.weight))
            for path in adapter.scaled_reads:
                linear = submodule(block, path)
                if linear is not None:
                    linear.weight.mul_(carried.to(linear.weight))
            carried = None


def _keep_layer_outputs(model: nn.Module, kept: Sequence[int], count: int) -> None:
    """The output blocks of the kept layers in each module of `FamilyAdapter.layer_outputs` (beside the blocks' list:
    one equal block of a Linear's rows or an Embedding's columns per layer of the `count`, layer after layer)."""
    owner = owner_of(model, layers_path(model))[0]  # the text model of a causal LM, or the base model itself
    for path in adapter_for(model).layer_outputs:
        module = submodule(owner, path)
        if module is None:  # a config without them (Gemma 4 without per-layer embeddings)
            continue
        embedding = isinstance(module, nn.Embedding)
        width = module.weight.shape[1] if embedding else out_features(module)
        assert width % count == 0, (path, width, count)
        block = width // count
        keep = torch.cat([torch.arange(i * block, (i + 1) * block) for i in kept])
        if embedding:
            module.weight = nn.Parameter(module.weight.data[:, keep.to(module.weight.device)].clone(),
                                         requires_grad=module.weight.requires_grad)
            module.embedding_dim = len(keep)
        else:
            keep_output_rows(module, keep)


def check_removable_layers(model: nn.Module, indices: Sequence[int]) -> None:
    """Refuse, before any work, layers that `remove_layers` cannot remove: indices out of range or repeated (every
    bad one listed), all of them, any in a family whose blocks differ by their place, a first layer built unlike
    the others, a hybrid decoder's last attention layers (`softmax_attentions`), or layers that would leave a layer
    of another kind last than the config rebuilds last (`FamilyAdapter.last_layer_kind`)."""
    n = len(layers(model))
    bad = sorted({i for i in indices if not 0 <= i < n} | {i for i in indices if list(indices).count(i) > 1})
    if bad:
        raise ValueError(f"layer indices {bad} are out of range [0, {n}) or repeated")
    if len(set(indices)) >= n:
        raise UnsupportedArchitecture(f"removing all {n} layers leaves no model")
    if not indices:
        return
    if not adapter_for(model).whole_layers:
        raise UnsupportedArchitecture(f"{model.config.model_type}'s blocks differ by their place in a stage (every "
                                      "other one shifts its windows): a model rebuilt from its config with fewer "
                                      "blocks would misplace them, so no layer is removed whole (its attention or FFN "
                                      "alone can be)")
    if adapter_for(model).linear_attention and set(softmax_attentions(model)) <= set(indices):
        raise UnsupportedArchitecture(f"removing layers {sorted(indices)} leaves {model.config.model_type} no "
                                      "attention beside its linear-attention layers: transformers runs such a hybrid "
                                      "decoder's cache with one at least")
    kind, kinds = adapter_for(model).last_layer_kind, getattr(model.config, "layer_types", None)
    last = max(set(range(n)) - set(indices))
    if kind is not None and kinds is not None and kinds[last] != kind:
        raise UnsupportedArchitecture(f"removing layers {sorted(indices)} leaves layer {last} ({kinds[last]}) last, "
                                      f"which {model.config.model_type}'s config rebuilds as {kind}: its last layer "
                                      f"must stay a {kind} one")
    if 0 in indices and adapter_for(model).first_layer_fixed:
        raise UnsupportedArchitecture(f"{model.config.model_type}'s first layer is built unlike the others (a model "
                                      "rebuilt from its config could not load the second in its place): it is "
                                      "never removed whole")


def _keep_layer_columns(model: nn.Module, kept: Sequence[int], count: int) -> None:
    """The input columns of the kept layers in each linear of `FamilyAdapter.layer_columns` (one equal block of columns
    per layer of the `count`, layer after layer), so that the model the config builds with fewer layers loads them."""
    base = base_path(model)
    for path in adapter_for(model).layer_columns:
        full = f"{base}.{path}" if base else path
        try:
            linear = model.get_submodule(full)
        except AttributeError:  # a checkpoint without that head
            continue
        width = in_features(linear)
        assert width % count == 0, (full, width, count)
        block = width // count
        keep_input_columns(linear, torch.cat([torch.arange(i * block, (i + 1) * block) for i in kept]))
        head = owner_of(model, full)[0]
        if isinstance(getattr(head, "in_features", None), int):  # ESM's contact head states its width too
            head.in_features = in_features(linear)


def _restate_backbone_outputs(config: Any, kept: Sequence[int], count: int) -> None:
    """A backbone config's stages (DINOv2's: "stem" and "stageN", the output after block N - 1, one per block of the
    `count`) and the ones its backbone outputs (`out_indices`), restated for the blocks `kept`: a config still naming a
    removed block's stage is refused as it loads. A removed block's stage is its last kept predecessor's (the block is
    the identity now); two outputs that become one stage are output once (with a warning: a neck reading every
    output then gets fewer)."""
    names = getattr(config, "stage_names", None)
    if names != ["stem"] + [f"stage{i}" for i in range(1, count + 1)] or \
            not hasattr(config, "set_output_features_output_indices"):
        return
    before = [i % (count + 1) for i in (config.out_indices or [count])]
    stages = sorted({sum(k < i for k in kept) for i in before})
    if len(stages) < len(before):
        log.warning("the backbone's outputs after blocks %s land on %d stage(s) once blocks are removed: it outputs "
                    "%s", before, len(stages), stages)
    config.stage_names = ["stem"] + [f"stage{i}" for i in range(1, len(kept) + 1)]
    config.set_output_features_output_indices(out_features=None, out_indices=stages)


def _restate_legacy_patterns(config: Any) -> None:
    """Each older key of `LEGACY_LAYER_PATTERNS` that the config holds, set to a value whose rule gives the shrunk
    `layer_types` (kept when it still does): left at its dense value it would state another model to every reader
    that builds the layers from it (ModernBERT's layer 1 removed, n = 2: full, sliding, full instead of full, full,
    sliding). Where no value states the new pattern, the key is kept and a warning says which readers misplace the
    layers (transformers 5 reads `layer_types`)."""
    types = getattr(config, "layer_types", None)
    if not isinstance(types, list | tuple):
        return
    n = len(types)
    for key, kind in LEGACY_LAYER_INDICES.items():
        if isinstance(getattr(config, key, None), list):
            setattr(config, key, [i for i, t in enumerate(types) if t == kind])
    for key, rule in LEGACY_LAYER_PATTERNS.items():
        attributes = [a for a in (key, f"_{key}") if isinstance(getattr(config, a, None), int)]
        if not attributes:
            continue
        old = getattr(config, attributes[0])
        if key == "max_window_layers" and getattr(config, "sliding_window", None) is None:
            continue  # the rule applies only where a window is set: every layer is full whatever the value
        lowest = 0 if key == "max_window_layers" else 1  # the others divide by the value
        values = [old, *range(lowest, n + 2)] if old >= lowest else list(range(lowest, n + 2))
        value = next((v for v in values if all(rule(i, v) == t for i, t in enumerate(types))), None)
        if value is None:
            log.warning("config.json's %s = %d cannot state the layers' attention types once layers are removed "
                        "(%s): readers that build the layers from it instead of layer_types (transformers before "
                        "5) misplace the sliding-window layers", key, old, ", ".join(types))
            continue
        for attribute in attributes:
            setattr(config, attribute, value)


def _keep_inverse_layer_scaling(block: nn.Module, old: int, new: int) -> None:
    """GPT-2 with `scale_attn_by_inverse_layer_idx` divides a layer's attention scores by its index + 1, computed
    from the index when the model is built: a block moved from `old` to `new` would be scaled by 1 / (new + 1)
    once rebuilt from the config. The ratio is folded into its queries (and its `scaling` set to what a rebuilt
    block computes), so the pruned model in memory, its export and its reload are one model."""
    if old == new:
        return
    for module in block.modules():
        if getattr(module, "scale_attn_by_inverse_layer_idx", False) and hasattr(module, "c_attn"):
            factor = (new + 1) / (old + 1)
            q = module.split_size  # c_attn's outputs are [q | k | v], each split_size wide (Conv1D: (in, out))
            with torch.no_grad():
                module.c_attn.weight[:, :q] *= factor
                if module.c_attn.bias is not None:
                    module.c_attn.bias[:q] *= factor
            module.scaling = module.scaling * (old + 1) / (new + 1)


def _set_attr(layer: nn.Module, path: str, value: int) -> None:
    module, name = owner_of(layer, path)
    if not hasattr(module, name):
        raise AttributeError(f"{path} not found: the adapter table is out of date for this transformers version")
    setattr(module, name, value)


def added_biases(model: nn.Module) -> list[str]:
    """The output projections ("layer.path") that have a bias where the model its config builds has none
    (`add_bias`)."""
    adapter = adapter_for(model)

    def outputs(layer: nn.Module) -> tuple[tuple[str, str], ...]:
        here = adapter.at(layer)  # a dense FFN's or a linear-attention mixer's paths where the block has them
        return (here.o, ATTENTION), (here.down, FFN)

    if all(getattr(projection(layer, path), "bias", None) is None for i, layer in enumerate(layers(model))
           for path, kind in outputs(layer) if not is_removed(model, i, kind)):
        return []  # nothing to compare: no model is built from the config
    with torch.device("meta"):
        reference = type(model)._from_config(model.config)
    added = []
    for i, (layer, dense) in enumerate(zip(layers(model), layers(reference), strict=True)):
        for path, kind in outputs(layer):
            if not is_removed(model, i, kind) and getattr(projection(layer, path), "bias", None) is not None \
                    and getattr(projection(dense, path), "bias", None) is None:
                added.append(f"{i}.{path}")
    return added


def widths(model: nn.Module) -> dict[str, list]:
    """What the config cannot say, per layer: kept query heads (`heads`), FFN width (`ffn`), a shared expert's
    width (`shared`, where the family has one), a linear-attention mixer's units (`mixer_units`: a Gated DeltaNet's
    key groups, a short convolution's channels; 0 for an attention layer, where the family has such layers) and,
    once query heads were pruned one by one, the KV head each query head reads (`kv_index`). A removed attention or
    FFN (`sublayers`) has width 0. Output projections given a bias (`add_bias`) are listed as `biases`."""
    adapter = adapter_for(model)
    out: dict[str, list] = {"heads": [], "ffn": []}
    if adapter.shared_down is not None:
        out["shared"] = [shared_width(model, i) for i in range(len(layers(model)))]
    gathered = any(hasattr(_attention(model, layer), "kv_map") for layer in layers(model))
    biased = adapter.head_bias is not None and any(hasattr(layer.get_submodule(adapter.head_bias), "bias_rows")
                                                   for layer in layers(model))
    linear = [adapter.linear_heads and adapter_at(model, i).recurrent for i in range(len(layers(model)))]
    for i, layer in enumerate(layers(model)):
        # a linear-attention layer's are its mixer's units (`mixer_units`; an earlier release wrote its out_proj's
        # width in attention heads, of a whole mixer)
        out["heads"].append(mixer_units(model, i) if linear[i] else query_heads(model, i))
        out["ffn"].append(ffn_width(model, i))
        if gathered:
            out.setdefault("kv_index", []).append(kv_index(model, i).tolist())
        if biased:  # which rows of the shared per-head bias each layer reads
            rows = getattr(layer.get_submodule(adapter.head_bias), "bias_rows", range(query_heads(model, i)))
            rows = rows if query_heads(model, i) else []
            out.setdefault("bias_rows", []).append(list(rows))
    if adapter.linear_heads:  # each linear-attention mixer's kept units (0 for an attention layer)
        out["mixer_units"] = [mixer_units(model, i) if linear[i] else 0 for i in range(len(layers(model)))]
    biases = added_biases(model)
    if biases:
        out["biases"] = biases
    return out


def apply_widths(model: nn.Module, manifest: dict[str, list]) -> None:
    """Resize every block to the manifest's widths (weights are loaded afterwards). Manifests of earlier
    releases count KV groups (`head_groups`) instead of query heads."""
    n, d = len(layers(model)), dims(model)
    heads = [k * d.group for k in manifest["head_groups"]] if "head_groups" in manifest else manifest.get("heads", [])
    maps, shared, units = manifest.get("kv_index"), manifest.get("shared"), manifest.get("mixer_units")
    if len(heads) != n or len(manifest.get("ffn", [])) != n or (maps is not None and len(maps) != n) \
            or (shared is not None and len(shared) != n) or (units is not None and len(units) != n):
        raise ModelReferenceError(f"width manifest does not describe {n} layers: {manifest}")
    recurrent = [adapter_at(model, i).recurrent for i in range(n)]
    if units is not None and not adapter_for(model).linear_heads:
        raise ModelReferenceError(f"width manifest: mixer_units for {model.config.model_type}, which has no "
                                  "linear-attention layers whose units are pruned")
    if units is not None and any((u != 0) != r or u < 0 or (r and u > mixer_units(model, i))
                                 for i, (u, r) in enumerate(zip(units, recurrent, strict=True))):
        raise ModelReferenceError(f"width manifest: mixer_units {units} are not kept units of the linear-attention "
                                  f"layers {[i for i, r in enumerate(recurrent) if r]} (0 elsewhere): "
                                  f"{[mixer_units(model, i) if r else 0 for i, r in enumerate(recurrent)]} at most")
    if shared is not None and adapter_for(model).shared_down is None:
        raise ModelReferenceError(f"width manifest: shared expert widths for {model.config.model_type}, which has "
                                  "no shared expert")
    has_shared = [adapter_for(model).at(layer).shared_down is not None for layer in layers(model)]
    if shared is not None and any((s == 0) != (f == 0) for s, f, h in zip(shared, manifest["ffn"], has_shared,
                                                                          strict=True) if h):
        raise ModelReferenceError(f"width manifest: a layer's shared expert and its FFN are removed together "
                                  f"(ffn {manifest['ffn']}, shared {shared})")
    if shared is not None and any(s for s, h in zip(shared, has_shared, strict=True) if not h):
        raise ModelReferenceError(f"width manifest: shared expert widths {shared} for layers without one (a dense "
                                  "FFN's layers have 0)")
    for i in range(n):
        if recurrent[i] and units is not None:  # a linear-attention mixer's kept units (its heads say them too)
            if heads[i] != units[i]:
                raise ModelReferenceError(f"width manifest: layer {i}'s heads {heads[i]} are not its mixer_units "
                                          f"{units[i]}")
            if units[i] < mixer_units(model, i):
                prune_mixer_units(model, i, range(units[i]))
        elif recurrent[i]:  # an earlier release's: a whole mixer, its out_proj's width in attention heads
            if heads[i] != query_heads(model, i):
                raise ModelReferenceError(f"width manifest: layer {i} mixes tokens by linear attention, kept whole, "
                                          f"but the manifest gives it {heads[i]} of {query_heads(model, i)} heads")
        elif heads[i] == 0:  # the attention removed: its stand-in's update is loaded with the weights
            remove_sublayer(model, i, ATTENTION)
        elif maps is not None:
            mapping = torch.tensor(maps[i], dtype=torch.long)
            kv = sorted(set(maps[i]))
            if len(mapping) != heads[i] or kv != list(range(len(kv))):
                raise ModelReferenceError(f"width manifest: layer {i}'s kv_index {maps[i]} does not map "
                                          f"{heads[i]} query heads onto the kept KV heads")
            _resize_attention(model, i, torch.arange(heads[i]), torch.arange(len(kv)), mapping, None)
        elif _multi_query(model, i):  # any number of query heads over the one KV head
            _keep_heads(model, layers(model)[i], torch.arange(heads[i]), torch.arange(1), None)
        else:
            prune_heads(model, i, range(heads[i] // dims(model, i).group))  # (Gemma 4's global layers: their own)
        if "bias_rows" in manifest:
            rows = manifest["bias_rows"][i]
            if len(rows) != heads[i]:
                raise ModelReferenceError(f"width manifest: layer {i}'s bias_rows {rows} are not one per query head")
            if heads[i]:
                adapter = adapter_for(model)
                set_bias_rows(attention := layers(model)[i].get_submodule(adapter.head_bias), rows)
                if adapter.bias_relay is not None:
                    relay_bias(layers(model)[i].get_submodule(adapter.bias_relay), attention)
        if manifest["ffn"][i] == 0:
            remove_sublayer(model, i, FFN)
        else:
            prune_ffn(model, i, range(manifest["ffn"][i]))
            if shared is not None and has_shared[i]:
                prune_shared_ffn(model, i, range(shared[i]))
    blocks, adapter = layers(model), adapter_for(model)
    for name in manifest.get("biases", []):
        index, _, path = str(name).partition(".")
        if not index.isdigit() or int(index) >= n or path not in (
                (here := adapter.at(blocks[int(index)])).o, here.down):
            raise ModelReferenceError(f"width manifest: {name!r} is not an output projection of one of {n} layers")
        add_bias(projection(blocks[int(index)], path))


def tied_aliases(model: nn.Module) -> set[str]:
    """Names of parameters that share another parameter's storage (tied embeddings), first name kept."""
    seen: set[int] = set()
    aliases = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = id(tensor)
        if key in seen:
            aliases.add(name)
        seen.add(key)
    return aliases


def state_to_save(model: nn.Module, prefix: str = "") -> dict[str, Tensor]:
    """The model's own state dict keys (not a checkpoint conversion's), tied aliases dropped."""
    aliases = tied_aliases(model)
    return {prefix + k: v.detach().contiguous() for k, v in model.state_dict().items() if k not in aliases}


def save_config_and_widths(model: nn.Module, directory: Path) -> None:
    """config.json naming the model's class (what `load_pruned` instantiates) and the width manifest
    it applies: everything `load_pruned` needs besides the weights and generation settings."""
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(directory)
    (directory / MANIFEST).write_text(json.dumps(widths(model), indent=1))


def save_pruned(model: nn.Module, directory: str | Path) -> None:
    """config.json, model.safetensors in the model's own parameter names, and the width manifest
    that `load_pruned` applies."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_config_and_widths(model, directory)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(directory)
    save_file(state_to_save(model), str(directory / "model.safetensors"), metadata={"format": "pt"})


def load_pruned(directory: str | Path, model_class: type | None = None) -> nn.Module:
    """Rebuild a pruned model: config -> model -> resize every layer to the manifest -> weights
    (every *.safetensors file of the directory)."""
    import transformers
    from safetensors.torch import load_file

    directory = Path(directory)
    config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    cls = model_class or getattr(transformers, config.architectures[0])
    model = cls._from_config(config)  # in the config's dtype (a bf16 checkpoint stays bf16)
    manifest = json.loads((directory / MANIFEST).read_text()) if (directory / MANIFEST).exists() else None
    if manifest is not None:
        apply_widths(model, manifest)
    state = {}
    for shard in sorted(directory.glob("*.safetensors")):
        state.update(load_file(str(shard)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = sorted(set(missing) - tied_aliases(model))
    if missing or unexpected:
        raise ModelReferenceError(f"{directory}: weights do not match the manifest (missing {missing[:5]}, "
                                  f"unexpected {unexpected[:5]})")
    if (directory / "generation_config.json").is_file() and getattr(model, "generation_config", None) is not None:
        # built from config.json alone, the model generates with that file's ids: an instruct model's end-of-turn
        # ids and sampling defaults live here (and a streamed job saved the model again from this one)
        model.generation_config = transformers.GenerationConfig.from_pretrained(directory, local_files_only=True)
    return model.eval()
