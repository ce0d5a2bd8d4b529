"""Architecture knowledge as data: where each transformer family keeps its heads and FFN neurons.

Every read of a transformers config or module path goes through this file, so a config rename in a
new transformers release breaks one table entry, not the pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class FamilyAdapter:
    """Submodule paths of one family, relative to the model (layers) or to a layer (the rest)."""

    layers: str  # path of the ModuleList of blocks
    q: str
    k: str
    v: str
    o: str  # attention output projection: its input rows are the heads
    up: tuple[str, ...]  # FFN input projections (up, and gate for gated FFNs)
    down: str  # FFN output projection: its input rows are the neurons
    heads_key: str = "num_attention_heads"
    kv_heads_key: str | None = None  # grouped-query attention
    # post-norm families: the LayerNorm right after each projection's residual add (its gamma scales
    # every output channel of the projection before anything else sees it)
    o_norm: str | None = None
    down_norm: str | None = None


BERT_LIKE = FamilyAdapter(layers="encoder.layer", q="attention.self.query", k="attention.self.key",
                          v="attention.self.value", o="attention.output.dense", up=("intermediate.dense",),
                          down="output.dense", o_norm="attention.output.LayerNorm", down_norm="output.LayerNorm")
LLAMA_LIKE = FamilyAdapter(layers="model.layers", q="self_attn.q_proj", k="self_attn.k_proj",
                           v="self_attn.v_proj", o="self_attn.o_proj", up=("mlp.up_proj", "mlp.gate_proj"),
                           down="mlp.down_proj", kv_heads_key="num_key_value_heads")

ADAPTERS: dict[str, FamilyAdapter] = {
    "bert": BERT_LIKE,
    "roberta": BERT_LIKE,
    "xlm-roberta": BERT_LIKE,
    "llama": LLAMA_LIKE,
    "mistral": LLAMA_LIKE,
    "qwen2": LLAMA_LIKE,
}


@dataclass(frozen=True)
class TransformerDims:
    layers: int
    heads: int
    kv_heads: int  # == heads without grouped-query attention
    head_dim: int
    intermediate: int

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.heads // self.kv_heads


def adapter_for(model: nn.Module) -> FamilyAdapter:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in ADAPTERS:
        raise ValueError(f"unsupported transformer family {model_type!r}; supported: {sorted(ADAPTERS)}")
    return ADAPTERS[model_type]


def _base(model: nn.Module, adapter: FamilyAdapter) -> nn.Module:
    """The module that holds `adapter.layers` (task heads wrap the base model under a prefix)."""
    root = adapter.layers.split(".")[0]
    if hasattr(model, root):
        return model
    for child in model.children():
        if hasattr(child, root):
            return child
    raise ValueError(f"no {adapter.layers!r} in {type(model).__name__}")


def layers(model: nn.Module) -> list[nn.Module]:
    adapter = adapter_for(model)
    return list(_base(model, adapter).get_submodule(adapter.layers))


def dims(model: nn.Module) -> TransformerDims:
    """Head and FFN sizes from the config (the one place config fields are read)."""
    config = model.config
    adapter = adapter_for(model)
    heads = int(getattr(config, adapter.heads_key))
    kv_heads = int(getattr(config, adapter.kv_heads_key, None) or heads) if adapter.kv_heads_key else heads
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return TransformerDims(int(config.num_hidden_layers), heads, kv_heads, head_dim,
                           int(config.intermediate_size))
