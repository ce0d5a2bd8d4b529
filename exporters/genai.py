"""What ONNX Runtime GenAI (`onnxruntime-genai`) needs beside a causal LM's decode step to generate with it:
`genai_config.json` (its configuration reference: the decoder's file, input and output names, sizes, search
defaults), next to `decode.onnx` and the tokenizer files.

The decode step (`onnx.export_decode_step`) already takes any number of new tokens after a cache of any length
from 0, which is how GenAI prefills a prompt and then decodes token by token. Pruned layers keep different KV
head counts: GenAI reads each cache's shape from the graph, and `num_key_value_heads` (one number in its
configuration) is only the count it starts an empty cache with, which a zero-length cache does not care about;
layers whose attention was removed have no cache, so `num_hidden_layers` counts the caches.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

from compressor.transformer.adapters import dims
from compressor.transformer.sublayers import ATTENTION, is_removed, kv_layers
from compressor.transformer.surgery import kv_index

CONFIG = "genai_config.json"
# model_type -> GenAI's model type, for the families whose decode step GenAI was tested to generate with (the
# greedy tokens of PyTorch); GenAI knows others, untested here
GENAI_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3"}


def genai_type(model: nn.Module) -> str | None:
    """GenAI's model type for this model, or None when GenAI generation is not supported for its family."""
    return GENAI_TYPES.get(getattr(model.config, "model_type", ""))


def _token_id(value: Any) -> int | list[int] | None:
    return [int(v) for v in value] if isinstance(value, list | tuple) else (None if value is None else int(value))


def _merged(first: int | list[int] | None, second: int | list[int] | None) -> int | list[int] | None:
    """The ids of both, `first`'s first, each once: one id as an int, none as None."""
    ids = list(dict.fromkeys([*_as_list(first), *_as_list(second)]))
    return None if not ids else ids[0] if len(ids) == 1 else ids


def _as_list(ids: int | list[int] | None) -> list[int]:
    return [] if ids is None else ids if isinstance(ids, list) else [ids]


def genai_config(model: nn.Module, decode: str = "decode.onnx") -> dict[str, Any]:
    """The configuration GenAI reads for the model's decode step `decode` (a file name beside it)."""
    kind = genai_type(model)
    if kind is None:
        raise ValueError(f"ONNX Runtime GenAI generation is not supported for {model.config.model_type!r} "
                         f"(supported: {', '.join(sorted(GENAI_TYPES))})")
    config, d = model.config, dims(model)
    kept = [i for i in range(d.layers) if not is_removed(model, i, ATTENTION)]
    # the first layer with an attention, as pruned (the config's counts are the dense model's when layers differ)
    first = kv_index(model, kept[0]).tolist() if kept else None
    heads, kv_heads = (len(first), len(set(first))) if first is not None else (d.heads, d.kv_heads)
    # generate() stops at the generation config's end ids (an instruct model's end of turn) as well as config.json's
    generation = getattr(model, "generation_config", None)
    eos = _merged(_token_id(getattr(generation, "eos_token_id", None)),
                  _token_id(getattr(config, "eos_token_id", None)))
    pad = _token_id(getattr(generation, "pad_token_id", None))
    pad = pad if pad is not None else _token_id(getattr(config, "pad_token_id", None))
    if isinstance(pad, list):  # one id, as GenAI reads it
        pad = pad[0] if pad else None
    context = int(getattr(config, "max_position_embeddings", 2048))
    decoder = {
        "filename": decode,
        "session_options": {"log_id": "osscar", "provider_options": []},
        "head_size": d.head_dim,
        "hidden_size": d.hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,  # the first cache's; every cache's shape comes from the graph
        "num_hidden_layers": kv_layers(model),  # the caches: a layer without attention has none
        "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                   "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"},
        "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value"},
    }
    tokens = {"bos_token_id": _token_id(getattr(config, "bos_token_id", None)), "eos_token_id": eos,
              # GenAI takes one pad id: a list of end tokens (Llama 3 Instruct's) lends its first
              "pad_token_id": pad if pad is not None else eos[0] if isinstance(eos, list) and eos else
              None if isinstance(eos, list) else eos}
    return {
        "model": {"type": kind, "decoder": decoder, "context_length": context, "vocab_size": int(config.vocab_size),
                  **{name: value for name, value in tokens.items() if value is not None}},
        # greedy by default; a cache buffer shared between past and present needs a fixed-size cache input,
        # which this decode step (a cache that grows) is not
        "search": {"do_sample": False, "num_beams": 1, "num_return_sequences": 1, "max_length": context,
                   "min_length": 0, "past_present_share_buffer": False, "repetition_penalty": 1.0,
                   "temperature": 1.0, "top_k": 1, "top_p": 1.0, "early_stopping": True, "length_penalty": 1.0,
                   "no_repeat_ngram_size": 0, "diversity_penalty": 0.0},
    }


def write_genai_config(model: nn.Module, directory: str | Path, decode: str = "decode.onnx") -> Path:
    """genai_config.json for the decode step `decode` in `directory`; returns its path."""
    path = Path(directory) / CONFIG
    path.write_text(json.dumps(genai_config(model, decode), indent=2) + "\n")
    return path
