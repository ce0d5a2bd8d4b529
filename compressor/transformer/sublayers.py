"""A layer's attention or its FFN alone removed: the sub-layer's update to the residual stream becomes one
constant vector (the calibration mean of what it added, its bias compensation; zeros without one).

Depth at a finer grain than whole layers: a decoder's attention costs its projections, its score matrix and
its KV cache, its FFN the widest matrices of the block, and the two matter unequally to the outputs (one is
often nearly redundant where the other is not). A removed sub-layer is a module of this file standing where
the sub-layer was, so the model's own forward, its export and a reload (`surgery.apply_widths`: width 0)
need nothing else:

- where the module holding the output projection returns the update and the block adds the residual
  (Llama's `self_attn` and `mlp`, GPT-2's `attn`, ...), that module is replaced whole by `RemovedSublayer`;
- where the output projection's own module adds the residual and normalises (BERT's `attention.output`,
  `output`; OPT's FFN is inline in the block), the projection is replaced by `RemovedSublayer` and what
  computed its input (`FamilyAdapter.attention_core` / `ffn_core`) by `EmptyCore`, so nothing of the
  sub-layer is computed but the residual add and its norm.

An attention that is gone has no KV cache: the attentions left are renumbered (`layer_idx`, what the cache
is indexed by) and `kv_layers` says how many caches a decode step carries.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import UnsupportedArchitecture
from ..modules import owner_of
from .adapters import FamilyAdapter, adapter_at, adapter_for, block_hidden, layers

ATTENTION, FFN = "attention_heads", "ffn_neurons"  # the unit kinds of the width curves: a sub-layer is all of one
KINDS = (ATTENTION, FFN)


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
    """The hidden states a sub-layer is called with: its first tensor argument, positional or named (DistilBERT
    passes query=, key=, value=)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, Tensor):
            return value
    raise TypeError("a removed sub-layer was called without a tensor")


class RemovedSublayer(nn.Module):
    """Stands in for a removed attention or FFN (or for its output projection): every token gets the same
    update, `update` (hidden,), shaped to broadcast over the tokens of the hidden states it is called with.
    `pair`: return (update, None), as an attention returns (output, weights) and gpt-oss's FFN (output, scores).
    `full`: the update at every token (..., hidden), for a block that reshapes what the sub-layer returns (Swin's
    windows)."""

    def __init__(self, update: Tensor, pair: bool, full: bool = False) -> None:
        super().__init__()
        assert update.dim() == 1, update.shape
        self.pair, self.full = pair, full
        self.register_buffer("update", update.detach().clone())  # saved with the weights

    def forward(self, *args: Any, **kwargs: Any) -> Tensor | tuple[Tensor, None]:
        x = _first_tensor(args, kwargs)  # (..., d)
        out = self.update.to(x.dtype).reshape((1,) * (x.dim() - 1) + (-1,))  # (1, ..., 1, hidden)
        if self.full:
            out = out.expand(*x.shape[:-1], -1).contiguous()  # (..., hidden)
        return (out, None) if self.pair else out

    def extra_repr(self) -> str:
        return f"hidden={self.update.shape[0]}, pair={self.pair}" + (", full=True" if self.full else "")


class EmptyCore(nn.Module):
    """Stands in for what computed a removed sub-layer's projection input, where the projection is a
    `RemovedSublayer` that reads only the rank of its input: one column of the hidden states, no compute."""

    def __init__(self, pair: bool) -> None:
        super().__init__()
        self.pair = pair

    def forward(self, *args: Any, **kwargs: Any) -> Tensor | tuple[Tensor, None]:
        x = _first_tensor(args, kwargs)
        out = x[..., :1]  # (..., 1)
        return (out, None) if self.pair else out

    def extra_repr(self) -> str:
        return f"pair={self.pair}"


def _paths(adapter: FamilyAdapter, kind: str) -> tuple[str, str | None]:
    """(the path replaced by `RemovedSublayer`, the path replaced by `EmptyCore` or None), relative to a block."""
    if kind not in KINDS:
        raise ValueError(f"sub-layer kind {kind!r}: expected one of {KINDS}")
    projection, core = (adapter.o, adapter.attention_core) if kind == ATTENTION else (adapter.down, adapter.ffn_core)
    if core is not None:
        return projection, core
    return projection.rpartition(".")[0], None


def replaced_path(adapter: FamilyAdapter, kind: str) -> str:
    """The module, relative to a block, whose output a removed sub-layer's update stands in for."""
    return _paths(adapter, kind)[0]


def is_removed(model: nn.Module, index: int, kind: str) -> bool:
    """Whether block `index`'s attention (`ATTENTION`) or FFN (`FFN`) was removed."""
    path, _ = _paths(adapter_at(model, index), kind)  # a linear-attention block's mixer is its attention
    return isinstance(layers(model)[index].get_submodule(path), RemovedSublayer)


def check_removable(model: nn.Module, index: int, kind: str) -> None:
    """Refuse, in one line naming why, a sub-layer that cannot be removed: out of range, already removed, in a family
    that norms each sub-layer's output (`FamilyAdapter.normed_updates`), a causal LM's last attention, or a causal
    LM's attention when its layers
    are of several kinds (sliding-window and global: a KV cache built
    from the config lays its layers out by kind, which renumbered attentions would no longer match)."""
    n = len(layers(model))
    if not 0 <= index < n:
        raise ValueError(f"layer index {index} is out of range [0, {n})")
    if is_removed(model, index, kind):
        raise ValueError(f"layer {index}'s {'attention' if kind == ATTENTION else 'FFN'} is already removed")
    if adapter_for(model).normed_updates:
        raise UnsupportedArchitecture(f"{model.config.model_type} norms each sub-layer's output before the residual "
                                      "add, which would turn a removed sub-layer's constant into a full-size update: "
                                      "an attention or an FFN alone is not removed (whole layers are)")
    if kind == ATTENTION and adapter_at(model, index).recurrent:
        raise UnsupportedArchitecture(f"layer {index} of {model.config.model_type} mixes tokens by linear attention "
                                      "(its state carried by the decode step): that mixer is not removed alone (its "
                                      "units and whole layers are)")
    if kind == FFN and not adapter_for(model).ffn_alone:
        raise UnsupportedArchitecture(f"{model.config.model_type}'s FFN is its MoE block and a shared expert beside "
                                      "it in the layer: an FFN alone is not removed (whole layers are)")
    if kind == ATTENTION and adapter_for(model).parallel_mixer is not None:
        raise UnsupportedArchitecture(f"layer {index} of {model.config.model_type} runs a recurrent mixer beside its "
                                      "attention, one cache layer holding the states of both: an attention alone is "
                                      "not removed (whole layers are)")
    if kind == ATTENTION and not adapter_for(model).attention_alone:
        raise UnsupportedArchitecture(f"{model.config.model_type}'s attention returns the position bias every later "
                                      "layer reads: an attention alone is not removed (whole layers are)")
    if kind == ATTENTION and adapter_for(model).linear_attention and softmax_attentions(model) == [index]:
        raise UnsupportedArchitecture(f"layer {index}'s attention is the last one beside linear-attention layers: "
                                      "transformers runs such a hybrid decoder's cache with one at least")
    if kind == ATTENTION and adapter_for(model).causal and kv_layers(model) == 1:
        raise UnsupportedArchitecture(f"layer {index}'s attention is the last one left: a decoder without any would "
                                      "read no context, and its KV cache (empty) would give every decoded token "
                                      "position 0")
    kinds = set(getattr(model.config, "layer_types", None) or ())
    if kind == ATTENTION and adapter_for(model).causal and len(kinds) > 1:
        raise UnsupportedArchitecture(f"{model.config.model_type} mixes layer kinds ({', '.join(sorted(kinds))}): "
                                      "its KV cache is laid out by kind, so an attention alone is not removed (whole "
                                      "layers are)")


def _swap(model: nn.Module, index: int, kind: str, update: Tensor | None) -> list[tuple[nn.Module, str, nn.Module]]:
    """Put the stand-ins of a removed sub-layer in place; returns (owner, name, module replaced) to undo it."""
    adapter, layer, hidden = adapter_at(model, index), layers(model)[index], block_hidden(model, index)
    path, core = _paths(adapter, kind)
    dtype = next((p.dtype for p in layer.get_submodule(path).parameters() if p.is_floating_point()), torch.float32)
    device = next((p.device for p in layer.get_submodule(path).parameters()), torch.device("cpu"))
    if update is None:
        update = torch.zeros(hidden, dtype=dtype, device=device)
    if tuple(update.shape) != (hidden,):
        raise ValueError(f"a removed sub-layer's update has shape {tuple(update.shape)}, expected ({hidden},)")
    attention = kind == ATTENTION
    # the module replaced whole returns what the block unpacks: an attention's (output, weights); a projection
    # standing alone returns one tensor
    pair = core is None and (attention or adapter.ffn_pair)  # gpt-oss's FFN returns its router's scores too
    swaps = [(path, RemovedSublayer(update.to(device=device, dtype=dtype), pair=pair, full=adapter.full_updates))]
    if core is not None:
        swaps.append((core, EmptyCore(pair=attention)))
    undo = []
    for where, module in swaps:
        owner, name = owner_of(layer, where)
        undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, module)
    return undo


def remove_sublayer(model: nn.Module, index: int, kind: str, update: Tensor | None = None) -> None:
    """Remove block `index`'s attention or FFN, in place: its update to the residual stream becomes `update`
    (hidden,), zeros when None. What the block still computes is its residual add (and, post-norm, its norm)."""
    check_removable(model, index, kind)
    _swap(model, index, kind, update)
    if kind == ATTENTION:
        renumber_caches(model)


@contextmanager
def sublayer_removed(model: nn.Module, index: int, kind: str, update: Tensor | None = None) -> Iterator[None]:
    """`remove_sublayer` for the duration of the block (the modules are put back after it; the caches are not
    renumbered: for passes without a KV cache, such as measuring what the removal changes)."""
    check_removable(model, index, kind)
    undo = _swap(model, index, kind, update)
    try:
        yield
    finally:
        for owner, name, module in undo:
            setattr(owner, name, module)


def renumber_caches(model: nn.Module) -> None:
    """Number the blocks whose attention is left 0, 1, ... (`layer_idx`, the index of their KV cache): a
    removed attention keeps no cache, and whole blocks removed left gaps."""
    cache = 0
    for i, block in enumerate(layers(model)):
        if is_removed(model, i, ATTENTION):
            continue
        for module in block.modules():
            if isinstance(getattr(module, "layer_idx", None), int):
                module.layer_idx = cache
        cache += 1


def kv_layers(model: nn.Module) -> int:
    """How many KV caches the model keeps: its blocks with an attention."""
    return sum(not is_removed(model, i, ATTENTION) for i in range(len(layers(model))))


def softmax_attentions(model: nn.Module) -> list[int]:
    """The blocks whose token mixer is a (softmax) attention, not removed: all of them but linear-attention mixers'
    (`FamilyAdapter.recurrent`). A hybrid decoder (Qwen3.5, Qwen3-Next) keeps one: transformers sizes every layer's
    mask by an attention layer's cache and fails on a cache of linear-attention layers alone."""
    return [i for i in range(len(layers(model)))
            if not adapter_at(model, i).recurrent and not is_removed(model, i, ATTENTION)]


def removed_sublayers(model: nn.Module) -> list[tuple[int, str]]:
    """(block index, kind) of every removed sub-layer, in block order."""
    return [(i, kind) for i in range(len(layers(model))) for kind in KINDS if is_removed(model, i, kind)]
