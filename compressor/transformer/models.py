"""Hugging Face transformers: loading a supported family's model (causal LMs with their head, encoders
as the base model) from a local directory, never downloaded."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import ModelReferenceError, UnsupportedArchitecture
from .adapters import ADAPTERS

if TYPE_CHECKING:  # transformers is imported where it is used: importing this module stays cheap
    from transformers import PretrainedConfig


@dataclass
class LoadedTransformer:
    model: torch.nn.Module  # eval mode
    tokenizer: object | None  # the model's tokenizer, when the directory has one
    output_name: str  # "last_hidden_state" (encoders) or "logits" (language models)
    input_names: tuple[str, ...]  # ONNX inputs, as the source model takes them


def transformer_config(reference: str) -> dict | None:
    """The config.json of a local HF directory whose model family has a transformer adapter, else None."""
    path = Path(str(reference)).expanduser() / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    return config if isinstance(config, dict) and config.get("model_type") in ADAPTERS else None


LM_HEAD_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def hf_model_class(config: PretrainedConfig) -> tuple[type, bool]:
    """(class to build, is a causal LM): the checkpoint's own LM class for language models (GPT-2's is
    GPT2LMHeadModel), the base model otherwise (encoders are pruned and exported without task heads).

    A config without `architectures` (converted checkpoints often have none) of a decoder-only family
    (`FamilyAdapter.causal`) gets the family's causal-LM class from transformers' auto mapping: its base
    model would lack the LM head and the layer paths the adapters name."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    arch = (config.architectures or [""])[0]
    if arch.endswith(LM_HEAD_SUFFIXES) and hasattr(transformers, arch):
        return getattr(transformers, arch), True
    adapter = ADAPTERS.get(config.model_type)
    if not arch and adapter is not None and adapter.causal:
        name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, "")
        if hasattr(transformers, name):
            return getattr(transformers, name), True
    return transformers.AutoModel, False


def build_hf_model(cls: type, config: PretrainedConfig) -> torch.nn.Module:
    """An untrained model of `cls` (a concrete class, or AutoModel) for `config`, on the current default
    device (use `with torch.device("meta")` for shapes without memory)."""
    import transformers

    return (cls.from_config(config) if cls is transformers.AutoModel else cls(config)).eval()


def load_transformer(reference: str, *, trust_remote_code: bool = False, weights: bool = True) -> LoadedTransformer:
    """A HF transformer from a local directory (never downloaded): causal LMs with their LM head,
    encoders as the base model. `weights=False` builds it on the meta device (shapes, no memory), for
    callers that stream the weights themselves."""
    import transformers

    path = Path(str(reference)).expanduser()
    if not (path / "config.json").is_file():
        raise ModelReferenceError(f"{reference}: expected a Hugging Face model directory with config.json")
    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    if config.model_type not in ADAPTERS:
        raise UnsupportedArchitecture(f"{reference}: unsupported transformer family {config.model_type!r}; "
                                      f"supported: {sorted(ADAPTERS)}")
    cls, causal = hf_model_class(config)
    if weights:
        model = cls.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code,
                                    use_safetensors=True).eval()  # never a pickle: it could run code
    else:
        with torch.device("meta"):
            model = build_hf_model(cls, config)
    tokenizer = None
    if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt")):
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    names: tuple[str, ...] = ("input_ids", "attention_mask")
    if hasattr(config, "num_channels"):  # vision transformers take images
        names = ("pixel_values",)
    elif not causal and getattr(config, "type_vocab_size", 0):
        names += ("token_type_ids",)
    return LoadedTransformer(model, tokenizer, "logits" if causal else "last_hidden_state", names)
