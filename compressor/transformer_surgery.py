"""Physical removal of attention heads and FFN neurons in HF transformer blocks, and reloading.

Heads: q/k/v output rows and the output projection's input columns, head_dim at a time. With
grouped-query attention whole KV groups are removed (a KV head with all the query heads that share
it): every layer keeps `heads / kv_heads` query heads per KV head, which the attention kernels and
`repeat_kv` assume, and the width of a layer is still any multiple of the group.
FFN neurons: up (and gate) output rows, down input columns.
Layers end up with different widths; `widths()` records them and `load_pruned()` rebuilds the model
from its config, applies the widths and loads the weights, so save -> reload gives the same outputs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from .adapters import adapter_for, dims, layers
from .surgery import check_keep

MANIFEST = "osscar_widths.json"


def _linear(layer: nn.Module, path: str) -> nn.Linear:
    module = layer.get_submodule(path)
    if not isinstance(module, nn.Linear):
        raise TypeError(f"{path} is a {type(module).__name__}, expected nn.Linear")
    return module


def keep_output_rows(linear: nn.Linear, rows: Tensor) -> None:
    """Keep output features `rows` of a Linear (weight rows, bias entries)."""
    rows = check_keep(rows, linear.out_features, "linear output features").to(linear.weight.device)
    linear.weight = nn.Parameter(linear.weight.data.index_select(0, rows).clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data.index_select(0, rows).clone(), requires_grad=False)
    linear.out_features = rows.numel()


def keep_input_columns(linear: nn.Linear, cols: Tensor, weight: Tensor | None = None) -> None:
    """Keep input features `cols` of a Linear; `weight` (out x kept) replaces the slice (a refit)."""
    cols = check_keep(cols, linear.in_features, "linear input features").to(linear.weight.device)
    new = linear.weight.data.index_select(1, cols) if weight is None else weight
    if tuple(new.shape) != (linear.out_features, cols.numel()):
        raise ValueError(f"new weight has shape {tuple(new.shape)}, expected {(linear.out_features, cols.numel())}")
    linear.weight = nn.Parameter(new.to(linear.weight).clone(), requires_grad=False)
    linear.in_features = cols.numel()


def prune_ffn(model: nn.Module, index: int, keep: Sequence[int] | Tensor, down_weight: Tensor | None = None) -> None:
    """Keep FFN neurons `keep` of block `index` (down_weight: the refit down projection, out x kept)."""
    adapter, layer = adapter_for(model), layers(model)[index]
    down = _linear(layer, adapter.down)
    keep = check_keep(keep, down.in_features, f"layer {index} FFN neurons")
    for path in adapter.up:
        keep_output_rows(_linear(layer, path), keep)
    keep_input_columns(down, keep, down_weight)


def head_groups(model: nn.Module, index: int) -> int:
    """Prunable head groups of block `index`: KV heads under GQA, heads otherwise."""
    adapter, layer = adapter_for(model), layers(model)[index]
    d = dims(model)
    q_rows = _linear(layer, adapter.q).out_features
    return q_rows // (d.head_dim * d.group)


def prune_heads(model: nn.Module, index: int, keep_groups: Sequence[int] | Tensor,
                o_weight: Tensor | None = None) -> None:
    """Keep head groups `keep_groups` of block `index` (see head_groups); o_weight: the refit output
    projection (out x kept query-head rows)."""
    adapter, layer = adapter_for(model), layers(model)[index]
    d = dims(model)
    groups = head_groups(model, index)
    keep = check_keep(keep_groups, groups, f"layer {index} head groups")
    hd, g = d.head_dim, d.group
    # a group is one KV head and the g query heads that share it (g = 1 without GQA)
    q_rows = (keep.view(-1, 1) * g * hd + torch.arange(g * hd)).reshape(-1)
    kv_rows = (keep.view(-1, 1) * hd + torch.arange(hd)).reshape(-1)
    keep_output_rows(_linear(layer, adapter.q), q_rows)
    keep_output_rows(_linear(layer, adapter.k), kv_rows)
    keep_output_rows(_linear(layer, adapter.v), kv_rows)
    keep_input_columns(_linear(layer, adapter.o), q_rows, o_weight)


def widths(model: nn.Module) -> dict[str, list[int]]:
    """Per-layer kept head groups count and FFN width (what the config cannot say)."""
    adapter = adapter_for(model)
    out: dict[str, list[int]] = {"head_groups": [], "ffn": []}
    for i, layer in enumerate(layers(model)):
        out["head_groups"].append(head_groups(model, i))
        out["ffn"].append(_linear(layer, adapter.down).in_features)
    return out


def save_pruned(model: nn.Module, directory: str | Path) -> None:
    """save_pretrained plus the width manifest that `load_pruned` applies."""
    directory = Path(directory)
    model.save_pretrained(directory)
    (directory / MANIFEST).write_text(json.dumps(widths(model), indent=1))


def load_pruned(directory: str | Path, model_class: type | None = None) -> nn.Module:
    """Rebuild a pruned model: config -> model -> resize every layer to the manifest -> weights."""
    import transformers
    from safetensors.torch import load_file

    directory = Path(directory)
    config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    cls = model_class or getattr(transformers, config.architectures[0])
    model = cls(config)
    manifest = json.loads((directory / MANIFEST).read_text()) if (directory / MANIFEST).exists() else None
    if manifest is not None:
        for i in range(len(layers(model))):
            prune_heads(model, i, range(manifest["head_groups"][i]))
            prune_ffn(model, i, range(manifest["ffn"][i]))
    state = {}
    for shard in sorted(directory.glob("*.safetensors")):
        state.update(load_file(str(shard)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("lm_head.weight")]  # tied to the embeddings
    if missing or unexpected:
        raise ValueError(f"{directory}: weights do not match the manifest (missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]})")
    if getattr(config, "tie_word_embeddings", False) and hasattr(model, "tie_weights"):
        model.tie_weights()
    return model.eval()
