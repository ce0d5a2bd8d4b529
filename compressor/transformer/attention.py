"""Attention whose query heads read their KV heads through an index: grouped-query attention after
query heads were pruned one by one.

HF's kernels assume every KV head serves the same number of query heads (`repeat_kv`). Once single
query heads are gone that no longer holds: KV head 0 may serve three query heads and KV head 1 one.
Each attention module then carries `kv_index` (one entry per query head: the KV head it reads), and
this attention gathers K and V by it instead of repeating them. A KV head no kept query head reads is
removed with its K/V rows, so the cache shrinks with it. The gather is a plain `index_select`: it
traces into torch.export and ONNX, and the decode step's cache holds only the kept KV heads.

It plugs into transformers' attention registry under `GATHERED` (`use_gathered_attention(model)`);
modules without `kv_index` (a dense block) read KV head `h // group`, as `repeat_kv` does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

GATHERED = "osscar_gathered"


def gathered_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                       scaling: float | None = None, dropout: float = 0.0, **kwargs: Any) -> tuple[Tensor, None]:
    """query (batch, heads, q_len, head_dim) over key/value (batch, kv_heads, k_len, head_dim); returns
    the attention output (batch, q_len, heads, head_dim), as transformers' attention functions do."""
    index = getattr(module, "kv_index", None)
    if index is None:  # an unpruned block: query head h reads KV head h // group
        heads, kv_heads = query.shape[1], key.shape[1]
        index = torch.arange(heads, device=query.device) // (heads // kv_heads)
    key = key.index_select(1, index.to(key.device))  # (batch, heads, k_len, head_dim)
    value = value.index_select(1, index.to(value.device))
    mask = attention_mask[:, :, :, : key.shape[-2]] if attention_mask is not None else None
    # as transformers' sdpa path: without a mask, a multi-token query of a causal model is causal
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = mask is None and query.shape[2] > 1 and getattr(module, "is_causal", True)
    dropout = dropout if module.training else 0.0
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    # Gemma 2 caps its scores (tanh) before the softmax, gpt-oss adds a learned sink logit per head to it (`s_aux`,
    # the module's `sinks`), neither of which SDPA can: the scores are made here
    if softcap or sinks is not None:
        out = _explicit_attention(query, key, value, mask, scaling, bool(is_causal), dropout,
                                  float(softcap) if softcap else None, sinks)
    else:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                             is_causal=bool(is_causal), dropout_p=dropout)
    return out.transpose(1, 2).contiguous(), None


def _explicit_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, scaling: float | None,
                        is_causal: bool, dropout: float, softcap: float | None, sinks: Tensor | None) -> Tensor:
    """softmax(softcap * tanh(q k^T * scaling / softcap) + mask) v, as Gemma 2's eager attention computes it; with
    `sinks` (heads,), each head's sink logit joins its softmax and its weight is dropped after it (gpt-oss's)."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = (query @ key.transpose(-1, -2)) * scale  # (batch, heads, q_len, k_len)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    # masked scores at the dtype's minimum, as the eager attention adds them: a padding query that sees no key
    # then averages them all instead of turning NaN
    low = torch.finfo(scores.dtype).min
    if mask is not None:  # the registry's sdpa masks: boolean (True: attend) or additive
        scores = scores.masked_fill(~mask, low) if mask.dtype == torch.bool else scores + mask
    elif is_causal:
        q_len, k_len = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(q_len, k_len, dtype=torch.bool, device=scores.device)
                                    .tril().logical_not(), low)  # top-left, as SDPA's is_causal
    if sinks is not None:  # (batch, heads, q_len, k_len + 1), the sink last
        sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)
        scores = scores - scores.max(dim=-1, keepdim=True).values  # as gpt-oss's eager attention
        weights = torch.softmax(scores.float(), dim=-1)[..., :-1]
    else:
        weights = torch.softmax(scores.float(), dim=-1)
    weights = F.dropout(weights.to(query.dtype), p=dropout)
    return weights @ value  # (batch, heads, q_len, head_dim)


def register() -> None:
    """Make `GATHERED` a name transformers' attention and mask registries know (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GATHERED, gathered_attention)
    AttentionMaskInterface.register(GATHERED, sdpa_mask)  # the same boolean masks as sdpa


def use_gathered_attention(model: nn.Module) -> None:
    """Switch a model to the gathered attention: its config and every config its modules hold (blocks
    built or streamed apart from the model keep config objects of their own)."""
    register()
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = GATHERED
