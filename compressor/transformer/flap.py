"""FLAP's structure for a transformer (An et al. 2024), a benchmark baseline: the fluctuation of every attention
output and FFN output projection's inputs on the dense model, and the per-layer widths FLAP's global search
keeps (`compressor.solver.baselines.flap_allocation`), as a structure that `--widths-from` prunes with
`--method flap`.

FLAP scores on the dense model in one pass (every layer sees the dense stream), then allocates across layers;
which heads and neurons a layer keeps is then the layer's own fluctuation order, what `--method flap` picks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..errors import UnsupportedArchitecture
from ..solver.baselines import flap_allocation
from .adapters import TransformerDims, adapter_for, block_path, dims, layers
from .surgery import dense_weight, in_features, projection


@dataclass
class _Moments:
    """Per-channel sums of a projection's inputs over the counted tokens (float64)."""

    total: Tensor
    squares: Tensor
    count: int = 0

    def add(self, x: Tensor) -> None:  # x: (tokens, d1)
        x = x.double()
        self.total += x.sum(0)
        self.squares += x.square().sum(0)
        self.count += x.shape[0]

    def variance(self) -> Tensor:
        assert self.count > 1, "no calibration tokens reached the projection"
        mean = self.total / self.count
        return (self.squares / self.count - mean.square()).clamp_min(0) * self.count / (self.count - 1)


def fluctuation_scores(model: nn.Module, batches: Sequence[dict[str, Tensor]]) -> tuple[list[Tensor], list[Tensor]]:
    """FLAP's WIFV of every layer on the dense model: (attention output projection inputs, FFN neurons), each
    the input's sample variance over the non-padding tokens times the squared norm of its weight row."""
    adapter = adapter_for(model)
    paths = [(block, path) for block in layers(model) for path in (adapter.o, adapter.down)]
    widths = [in_features(projection(b, p)) for b, p in paths]
    moments = [_Moments(torch.zeros(d, dtype=torch.float64), torch.zeros(d, dtype=torch.float64)) for d in widths]
    counted: dict[str, Tensor | None] = {}

    def hook(m: _Moments):
        def record(_module, inputs):
            x = inputs[0].detach()
            mask = counted["mask"]
            m.add(x.reshape(-1, x.shape[-1]) if mask is None else x[mask])
        return record

    handles = [projection(b, p).register_forward_pre_hook(hook(m)) for (b, p), m in zip(paths, moments, strict=True)]
    try:
        with torch.no_grad():
            for batch in batches:
                mask = batch.get("attention_mask")
                counted["mask"] = None if mask is None else mask.bool()
                model(**batch)
    finally:
        for handle in handles:
            handle.remove()
    scores = [m.variance() * dense_weight(projection(b, p)).double().square().sum(1)
              for (b, p), m in zip(paths, moments, strict=True)]
    return scores[0::2], scores[1::2]


def head_rows(d: TransformerDims) -> float:
    """The rows of hidden size a query head takes with it: its query and output rows, and its share of its KV head's
    key and value rows (a whole KV head each on a model without grouped queries)."""
    return (2 + 2 * d.kv_heads / d.heads) * d.head_dim


def flap_structure(model: nn.Module, batches: Sequence[dict[str, Tensor]], keep: float) -> dict:
    """FLAP's widths for `model` keeping `keep` of its attention and FFN parameters, as a structure for
    `--widths-from`: {"layers": [{name, width_after}], "removed_layers": [sub-layers left with no unit]}; query
    heads are the attention's unit (a head weighs its query and output rows and its share of its KV head's key and
    value rows: (2 + 2 kv_heads / heads) x head_dim x hidden parameters, all four on a model without grouped
    queries; a neuron its FFN rows and column: (up projections + 1) x hidden)."""
    adapter, d = adapter_for(model), dims(model)
    if adapter.experts:
        raise UnsupportedArchitecture(f"FLAP scores a dense FFN's neurons; {model.config.model_type}'s FFN is a "
                                      "Mixture-of-Experts layer")
    if not adapter.heads_prunable:
        raise UnsupportedArchitecture(f"FLAP allocates one budget over heads and FFN neurons; {model.config.model_type}"
                                      "'s attention heads are not a prunable unit")
    if adapter.parallel_mixer is not None:
        raise UnsupportedArchitecture(f"FLAP allocates one budget over attention heads and FFN neurons; "
                                      f"{model.config.model_type}'s layers run a recurrent mixer beside the attention, "
                                      "which the budget does not weigh (an attention FLAP empties cannot go alone)")
    if adapter.linear_attention is not None:
        raise UnsupportedArchitecture(f"FLAP allocates one budget over attention heads and FFN neurons; "
                                      f"{model.config.model_type}'s linear-attention layers have other units")
    if getattr(model.config, "is_heterogeneous", False):  # one head size in the allocation
        raise UnsupportedArchitecture(f"FLAP weighs every head as one size; {model.config.model_type}'s layers state "
                                      "heads of their own sizes (per_layer_config)")
    if adapter.latent_attention:  # a head's rows come from latents of their own widths, not 4 x head_dim x hidden
        raise UnsupportedArchitecture(f"FLAP weighs a head as 4 x head_dim x hidden parameters; "
                                      f"{model.config.model_type}'s multi-head latent attention heads are not")
    attention, ffn = fluctuation_scores(model, batches)
    head_weight = head_rows(d) / (adapter.up_matrices + 1)
    heads, neurons = flap_allocation(attention, ffn, d.head_dim, head_weight, keep)
    structure: dict = {"layers": [], "removed_layers": []}
    for i, (h, n) in enumerate(zip(heads, neurons, strict=True)):
        for path, width in ((adapter.o, h), (adapter.down, n)):
            name = f"{block_path(model, i)}.{path}"
            if width:
                structure["layers"].append({"name": name, "width_after": width})
            else:
                structure["removed_layers"].append(name)
    return structure
