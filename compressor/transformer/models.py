"""Hugging Face transformers: loading a supported family's model (causal LMs with their head, encoders
as the base model) from a local directory, never downloaded."""

from __future__ import annotations

import inspect
import json
import os
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ModelReferenceError, UnsupportedArchitecture
from .adapters import ADAPTERS, FamilyAdapter, dense_ffn_layers, family_record, kv_heads_of

if TYPE_CHECKING:  # transformers is imported where it is used: importing this module stays cheap
    from transformers import PretrainedConfig


@dataclass
class LoadedTransformer:
    model: torch.nn.Module  # eval mode
    tokenizer: object | None  # the model's tokenizer, when the directory has one
    output_name: str  # "last_hidden_state" (encoders) or "logits" (language models, sequence classifiers)
    input_names: tuple[str, ...]  # ONNX inputs, as the source model takes them
    causal: bool = False  # a causal LM ("logits" are next-token scores); an encoder's "logits" are its classes'
    # ONNX outputs after the first (a CLIP vision tower's last_hidden_state after its pooler_output)
    extra_outputs: tuple[str, ...] = ()

    @property
    def outputs(self) -> tuple[str, ...]:
        """The export's outputs in order: `output_name`, then `extra_outputs`."""
        return (self.output_name, *self.extra_outputs)


def transformer_config(reference: str) -> dict | None:
    """The config.json of a local HF directory whose model family has a transformer adapter, else None."""
    path = Path(str(reference)).expanduser() / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    return config if isinstance(config, dict) and config.get("model_type") in ADAPTERS else None


LM_HEAD_SUFFIXES = ("ForCausalLM", "LMHeadModel")
# base models built as the class their checkpoint names, where AutoModel would build another: T5's encoder alone
# (AutoModel: both halves), CLIP's vision tower with its projection
OWN_CLASS_SUFFIXES = ("EncoderModel", "VisionModelWithProjection")
# an encoder with its classification head, kept and exported: a text one's, or a vision transformer's (DeiT's with
# its distillation head too, whose logits average the two)
CLASSIFIER_SUFFIX = ("ForSequenceClassification", "ForImageClassification", "ForImageClassificationWithTeacher")


def hf_model_class(config: PretrainedConfig) -> tuple[type, bool]:
    """(class to build, is a causal LM): the checkpoint's own LM class for language models (GPT-2's is
    GPT2LMHeadModel), an encoder's own sequence or image classifier (its head kept: it is what the user serves), the
    base model otherwise (other encoder heads are dropped: pruned and exported without them).

    A config without `architectures` (converted checkpoints often have none) of a decoder-only family
    (`FamilyAdapter.causal`) gets the family's causal-LM class from transformers' auto mapping: its base
    model would lack the LM head and the layer paths the adapters name. So does one naming a remote-code class of a
    model type that transformers serves by another family's modeling (EXAONE 3.5's ExaoneForCausalLM)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    arch = (config.architectures or [""])[0]
    if arch.endswith(LM_HEAD_SUFFIXES) and hasattr(transformers, arch):
        return getattr(transformers, arch), True
    if arch.endswith(OWN_CLASS_SUFFIXES) and hasattr(transformers, arch):
        return getattr(transformers, arch), False
    adapter = ADAPTERS.get(config.model_type)
    if arch.endswith(CLASSIFIER_SUFFIX) and hasattr(transformers, arch) and adapter is not None:
        return getattr(transformers, arch), False  # a decoder's too (a reranker's or reward model's score head)
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, "")
    # no class named, or a remote-code class of a model type that transformers serves by another family's modeling
    # (EXAONE 3.5's ExaoneForCausalLM by LlamaForCausalLM: the class it replaced; a custom class of a family with a
    # modeling of its own is no such class: loaded as an unknown class is, its base model)
    # (and the config transformers' own, not a remote one: the class would not read it)
    own_config = config.model_type in transformers.CONFIG_MAPPING and \
        type(config) is transformers.CONFIG_MAPPING[config.model_type]
    replaced = arch.endswith(LM_HEAD_SUFFIXES) and not hasattr(transformers, arch) and hasattr(transformers, name) \
        and getattr(getattr(transformers, name), "config_class", None) is not None \
        and getattr(transformers, name).config_class.model_type != config.model_type and own_config
    if (not arch or replaced) and adapter is not None and adapter.causal and hasattr(transformers, name):
        return getattr(transformers, name), True
    return transformers.AutoModel, False


def build_hf_model(cls: type, config: PretrainedConfig, *, init_weights: bool = True) -> torch.nn.Module:
    """An untrained model of `cls` (a concrete class, or AutoModel) for `config`, on the current default
    device (use `with torch.device("meta")` for shapes without memory), in the config's dtype: a bf16 / fp16
    checkpoint's model is built in it, never in float32 first. `init_weights=False`: parameters allocated but
    never drawn, for a model whose weights are loaded next (drawing a 128k-token embedding alone takes ~10 s on
    two cores); buffers computed from the config (rotary tables) are still real."""
    import transformers

    with nullcontext() if init_weights else _no_init_weights():
        model = cls.from_config(config) if cls is transformers.AutoModel else cls._from_config(config)
    if not init_weights:
        model.tie_weights()  # skipped with the draws: `init_weights` is where transformers ties them
    return model.eval()


def _no_init_weights() -> AbstractContextManager:
    """transformers' switch that skips the draws (torch's and its own `init_weights`), where this release has it;
    otherwise nothing is skipped: slower, never wrong."""
    import importlib

    for module in ("transformers.initialization", "transformers.modeling_utils"):
        try:
            return importlib.import_module(module).no_init_weights()
        except (ImportError, AttributeError):
            continue
    return nullcontext()


def load_transformer(reference: str, *, trust_remote_code: bool = False, weights: bool = True) -> LoadedTransformer:
    """A HF transformer from a local directory (never downloaded): causal LMs with their LM head, sequence
    classifiers with their head, other encoders as the base model. `weights=False` builds it on the meta device
    (shapes, no memory), for callers that stream the weights themselves."""
    import transformers

    path = Path(str(reference)).expanduser()
    if not (path / "config.json").is_file():
        raise ModelReferenceError(f"{reference}: expected a Hugging Face model directory with config.json")
    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    if config.model_type not in ADAPTERS:
        raise UnsupportedArchitecture(f"{reference}: unsupported transformer family {config.model_type!r}; "
                                      f"supported: {sorted(ADAPTERS)}")
    cls, causal = hf_model_class(config)
    if weights and not any((path / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")):
        found = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt*"))
        raise ModelReferenceError(f"{reference}: no model.safetensors or model.safetensors.index.json"
                                  + (f" (found {', '.join(found[:3])})" if found else "") + "; weights are read from "
                                  "safetensors only, never a pickle (it could run code): save the model with "
                                  "save_pretrained (safetensors by default)")
    from .surgery import MANIFEST, load_pruned

    if weights and (path / MANIFEST).is_file():
        # a model this service pruned, its layers of their own widths (which from_pretrained refuses): rebuilt by the
        # width manifest, so that it can be compressed again
        model = load_pruned(path, cls)
    elif weights:
        # never a pickle (it could run code); in the checkpoint's own dtype: a bf16 model stays bf16 on the host
        # a class serving another family's config (EXAONE 3.5's by LlamaForCausalLM) takes that config as loaded: its
        # own would read config.json's keys under other names (num_layers, layer_norm_epsilon) as no field
        own = getattr(cls, "config_class", None) in (None, type(config))
        model = cls.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code,
                                    use_safetensors=True, dtype="auto", **({} if own else {"config": config})).eval()
    else:
        with torch.device("meta"):
            model = build_hf_model(cls, config)
    tokenizer = None
    if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt")):
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    names: tuple[str, ...] = ("input_ids", "attention_mask")
    if hasattr(config, "num_channels"):  # vision transformers take images
        names = ("pixel_values",)
    elif not causal and _takes_token_types(model, config, tokenizer):
        names += ("token_type_ids",)
    classifier = type(model).__name__.endswith(CLASSIFIER_SUFFIX)
    pooled = ADAPTERS[config.model_type].pooled_output
    if type(model).__name__.endswith("VisionModelWithProjection"):  # IP-Adapter's, SVD's image encoders serve these
        pooled = "image_embeds"
    if pooled is not None and not causal and not classifier and getattr(config, "vision_use_head", True) is not False:
        # the embedding the base model serves (SigLIP without its head has none), then the token states
        return LoadedTransformer(model, tokenizer, pooled, names, extra_outputs=("last_hidden_state",))
    return LoadedTransformer(model, tokenizer, "logits" if causal or classifier else "last_hidden_state", names,
                             causal=causal)


def _takes_token_types(model: torch.nn.Module, config: object, tokenizer: object) -> bool:
    """Whether an encoder's export takes token_type_ids: exactly when its tokenizer gives them (serving feeds the
    tokenizer's output to ONNX Runtime, which refuses an input the graph lacks and needs every one it has:
    RoBERTa's and XLM-R's tokenizers give none, though their configs keep a one-row type table), and the model
    reads them; without a tokenizer, when the config has more than one token type."""
    if "token_type_ids" not in inspect.signature(model.forward).parameters:
        return False
    if tokenizer is not None:
        return "token_type_ids" in tokenizer.model_input_names
    return (getattr(config, "type_vocab_size", 0) or 0) > 1


# ---- standard outputs: a pruned model whose config says its widths ------------------------------------

def standard_config(config: dict, manifest: dict) -> dict | None:
    """config.json (a dict) that describes the widths of a width manifest (`osscar_widths.json`), so that
    transformers builds the pruned model from it alone, or None when it cannot: layers of different
    widths, heads pruned in a family whose config cannot keep head_dim, query heads reading their KV
    heads through a map that repeat_kv does not express (uneven query heads per KV head), or a config
    that transformers' own validation refuses (Llama: hidden_size must stay a multiple of the heads)."""
    model_type = config.get("model_type")
    if model_type not in ADAPTERS:
        return None
    adapter = family_record(model_type, config)
    if not adapter.config_widths:
        return None
    ffn_key = adapter.ffn_key
    import transformers

    # config.json keeps a family's own names (GPT-2: n_head for num_attention_heads)
    key = transformers.CONFIG_MAPPING[model_type].attribute_map.get
    heads_before = int(config[key(adapter.heads_key, adapter.heads_key)])
    kv_before = kv_heads_of(adapter, config.get, heads_before)
    group = heads_before // kv_before
    heads = [k * group for k in manifest["head_groups"]] if "head_groups" in manifest else manifest.get("heads", [])
    ffn, maps = manifest.get("ffn", []), manifest.get("kv_index")
    units = None  # a linear-attention mixer's kept units, the same in each such layer
    if "mixer_units" in manifest and adapter.linear_attention is None:
        return None  # not this family's manifest: `load_pruned` refuses it with the reason
    if adapter.linear_attention is not None:  # a linear-attention layer's heads are no attention heads to state
        attends = [kind != adapter.linear_layer_type for kind in _layer_kinds(config, adapter)]
        if len(attends) != len(heads):
            return None
        units = {u for u, a in zip(manifest.get("mixer_units") or [], attends, strict=False) if not a}
        if len(units) > 1:
            return None
        heads = [h for h, a in zip(heads, attends, strict=True) if a]
        maps = None if maps is None else [m for m, a in zip(maps, attends, strict=True) if a]
    if any(rows != list(range(heads_before)) for rows in manifest.get("bias_rows", [])):
        return None  # layers read other rows of a shared per-head bias than the first ones
    if manifest.get("biases"):
        return None  # output projections given a bias that the family's config does not build
    if 0 in heads or 0 in ffn:
        return None  # a removed attention or FFN (`sublayers`): its stand-in is no module of the family
    shared = manifest.get("shared")
    dense = dense_ffn_layers(config) or [False] * len(ffn)  # a MoE family's layers with a dense FFN: its own key
    if len(dense) != len(ffn):
        return None
    dense_ffn = sorted({f for f, d in zip(ffn, dense, strict=True) if d})
    ffn = [f for f, d in zip(ffn, dense, strict=True) if not d]
    if shared is not None:
        shared = [w for w, d in zip(shared, dense, strict=True) if not d]
    if shared is not None and (adapter.shared_key is None or len(set(shared)) > 1):
        return None  # shared experts of unequal widths (or widths no config key states)
    if len(set(heads)) != 1 or len(set(ffn)) > 1 or len(dense_ffn) > 1 or \
            (maps is not None and any(m != maps[0] for m in maps)):
        return None
    kept = heads[0]
    kv_heads = len(set(maps[0])) if maps is not None else kept // group
    if kv_heads == 0 or kept % kv_heads or \
            (maps is not None and maps[0] != [h // (kept // kv_heads) for h in range(kept)]):
        return None  # uneven query heads per KV head: only the gathered attention reads them
    out = dict(config)
    if ffn:
        out[ffn_key] = int(ffn[0])
        out.update(adapter.ffn_config)
    if dense_ffn:
        out[adapter.dense_key] = int(dense_ffn[0])
    if shared:
        out[adapter.shared_key] = int(shared[0])
    # a Gated DeltaNet's key groups (value heads per key head stay as they were); an LFM2 short convolution's channels
    # are hidden_size's, which no key states apart: a pruned one does not build as saved (`_builds_as_saved`)
    if units and "linear_num_key_heads" in config:
        (groups,) = units
        ratio = int(config["linear_num_value_heads"]) // int(config["linear_num_key_heads"])
        out["linear_num_key_heads"], out["linear_num_value_heads"] = int(groups), int(groups) * ratio
    if (kept, kv_heads) != (heads_before, kv_before):
        if not adapter.config_head_dim:
            return None
        if not adapter.latent_attention:  # its head sizes are keys of their own (head_dim: the rotary part's)
            head_dim = key("head_dim", "head_dim")  # T5's d_kv
            out[head_dim] = int(config.get(head_dim) or config[key("hidden_size", "hidden_size")] // heads_before)
        out[key(adapter.heads_key, adapter.heads_key)] = kept
        if adapter.kv_heads_key is not None:
            out[key(adapter.kv_heads_key, adapter.kv_heads_key)] = kv_heads
    try:  # what transformers itself accepts: Llama's config still wants hidden_size % heads == 0
        config_object(transformers.CONFIG_MAPPING[model_type], out)
    except Exception:  # its validators raise ValueError, or huggingface_hub's validation error
        return None
    return out


def _layer_kinds(config: dict, adapter: FamilyAdapter) -> list[str]:
    """Each layer's kind as config.json states it: its `layer_types`, or the indices of one kind's layers where the
    config class computes the list from them (Bamba's attn_layer_indices), the others linear-attention layers."""
    from .surgery import LEGACY_LAYER_INDICES

    if config.get("layer_types"):
        return list(config["layer_types"])
    for key, kind in LEGACY_LAYER_INDICES.items():
        if isinstance(config.get(key), list):
            return [kind if i in config[key] else adapter.linear_layer_type
                    for i in range(int(config["num_hidden_layers"]))]
    return []


def config_object(cls: type, config: dict) -> Any:
    """config.json's dict as its config class `cls` reads it from a file: transformers writes the floats JSON has no
    literal for as objects ({"__float__": "Infinity"}: Mamba2's time_step_limit), which from_pretrained decodes and
    from_dict does not."""
    decode = getattr(cls, "_decode_special_floats", None)
    return cls.from_dict(decode(config) if decode is not None else config)


def write_config(path: Path, config: dict) -> None:
    """Replace config.json at `path` by `config`, never leaving a half-written one."""
    partial = path.with_name(".config.json.partial")
    partial.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    os.replace(partial, path)


def _builds_as_saved(directory: Path, config: dict) -> bool:
    """Whether the family's own class, built from `config` (on the meta device: no memory), has the shape of every
    tensor saved in `directory`: a family may size a projection by another field than the widths the config states
    (Helium's o_proj is hidden x hidden whatever its heads), and from_pretrained would then refuse the checkpoint.
    A config naming no class transformers has is taken as it is."""
    import transformers
    from safetensors import safe_open

    names = config.get("architectures") or []
    cls = getattr(transformers, names[0], None) if names else None
    if cls is None:
        return True
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in cls(config_object(cls.config_class, config)).state_dict().items()}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as saved:
            for name in saved.keys():  # noqa: SIM118 (safe_open is no mapping)
                if name in shapes and tuple(saved.get_slice(name).get_shape()) != shapes[name]:
                    return False
    return True


def standardise(directory: str | Path) -> bool:
    """Rewrite a saved pruned model's config.json to say its widths and drop its width manifest, when
    `standard_config` can (then transformers' from_pretrained loads it with no code of ours); otherwise
    leave the manifest for `surgery.load_pruned`. Returns whether the directory is now standard."""
    from .surgery import MANIFEST

    directory = Path(directory)
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        return True
    config_path = directory / "config.json"
    standard = standard_config(json.loads(config_path.read_text()), json.loads(manifest_path.read_text()))
    if standard is None or not _builds_as_saved(directory, standard):
        return False
    write_config(config_path, standard)
    manifest_path.unlink()
    return True


def save_standard(model: torch.nn.Module, directory: str | Path) -> bool:
    """`surgery.save_pruned`, then `standardise`: a pruned model directory that transformers loads by
    itself when its widths allow; else with the width manifest for `load_pruned`, and with transformers'
    `trust_remote_code=True` where `remote.write_remote_code` can state the widths. Returns whether it is
    standard."""
    from .remote import write_remote_code
    from .surgery import save_pruned

    save_pruned(model, directory)
    if standardise(directory):
        return True
    write_remote_code(model, directory)
    return False
