"""Loading HF directories: which class a config builds (causal LMs with their head, encoders bare)."""

import json

import pytest
import torch

from compressor.transformer.adapters import dims, layers, layers_path
from compressor.transformer.models import hf_model_class, load_transformer
from compressor.transformer.offload import StreamedCheckpoint
from compressor.transformer.pipeline import prune_blocks

from .transformer_models import MODELS, example_inputs, first_output, tiny_bert, tiny_llama


def _without_architectures(model, directory):
    """`model` saved the way converted checkpoints often are: config.json naming no class."""
    model.save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    config.pop("architectures", None)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2", "opt", "phi3"])
def test_a_decoder_without_architectures_loads_as_a_causal_lm(name, tmp_path):
    model = MODELS[name]()
    loaded = load_transformer(str(_without_architectures(model, tmp_path / name)))
    assert type(loaded.model) is type(model) and loaded.output_name == "logits"
    inputs = example_inputs(model)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(**inputs).logits, model(**inputs).logits)


@pytest.mark.parametrize("name, arch", [("exaone", "ExaoneForCausalLM"), ("internlm3", "InternLM3ForCausalLM")])
def test_a_decoder_naming_a_remote_code_class_loads_as_transformers_causal_lm(name, arch, tmp_path):
    """EXAONE 3.5's and InternLM3's checkpoints name their remote-code classes, which transformers serves by its Llama
    modeling: loaded with their LM head, as a causal LM."""
    from .transformer_models import LLAMA_SHAPED

    model = LLAMA_SHAPED[name]()
    model.save_pretrained(tmp_path / name)
    config = json.loads((tmp_path / name / "config.json").read_text())
    config["architectures"] = [arch]  # as the checkpoints' config.json names it (save_pretrained writes its own)
    if name == "exaone":  # EXAONE 3.5's own keys, which only ExaoneConfig reads (LlamaConfig would build 32 layers)
        config["num_layers"], config["layer_norm_epsilon"] = config.pop("num_hidden_layers"), config.pop("rms_norm_eps")
    (tmp_path / name / "config.json").write_text(json.dumps(config))
    loaded = load_transformer(str(tmp_path / name))
    assert type(loaded.model).__name__ == "LlamaForCausalLM" and loaded.output_name == "logits"
    assert len(layers(loaded.model)) == 2 and loaded.model.config.rms_norm_eps == model.config.rms_norm_eps
    inputs = example_inputs(model)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(**inputs).logits, model(**inputs).logits)


def test_an_encoder_without_architectures_stays_the_base_model(tmp_path):
    loaded = load_transformer(str(_without_architectures(tiny_bert(), tmp_path / "bert")))
    assert type(loaded.model).__name__ == "BertModel" and loaded.output_name == "last_hidden_state"
    cls, causal = hf_model_class(loaded.model.config)
    assert cls.__name__ == "AutoModel" and not causal


def test_an_encoder_takes_token_type_ids_exactly_when_its_tokenizer_gives_them(tmp_path):
    """RoBERTa's and XLM-R's tokenizers give no token_type_ids though their configs keep a one-row type table: an
    export that required them failed in ONNX Runtime on `session.run(None, dict(tokenizer(texts)))`."""
    import transformers
    from tokenizers import Tokenizer, models

    def saved(model, name: str, input_names: list[str] | None) -> str:
        model.save_pretrained(tmp_path / name)
        if input_names is not None:
            tokenizer = transformers.PreTrainedTokenizerFast(
                tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")),
                model_input_names=input_names)
            tokenizer.save_pretrained(tmp_path / name)
        return str(tmp_path / name)

    roberta = transformers.RobertaModel(transformers.RobertaConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        type_vocab_size=1))
    with_types = ["input_ids", "token_type_ids", "attention_mask"]
    assert load_transformer(saved(roberta, "roberta", ["input_ids", "attention_mask"])).input_names == \
        ("input_ids", "attention_mask")
    assert load_transformer(saved(roberta, "roberta-bare", None)).input_names == ("input_ids", "attention_mask")
    assert load_transformer(saved(tiny_bert(), "bert", with_types)).input_names == \
        ("input_ids", "attention_mask", "token_type_ids")
    assert load_transformer(saved(tiny_bert(), "bert-bare", None)).input_names == \
        ("input_ids", "attention_mask", "token_type_ids")  # two token types: a BERT tokenizer gives them
    # a forward that reads none is never given them, whatever the tokenizer says
    assert load_transformer(saved(MODELS["modernbert"](), "modernbert", with_types)).input_names == \
        ("input_ids", "attention_mask")


def test_a_directory_of_pickled_weights_is_refused_in_one_line(tmp_path):
    """transformers' own OSError (a 10-frame traceback out of the CLI) for a pytorch_model.bin-only directory."""
    from compressor.errors import ModelReferenceError

    model = tiny_llama()
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(ModelReferenceError, match=r"no model\.safetensors .*\(found pytorch_model\.bin\); weights "
                                                  r"are read from safetensors only"):
        load_transformer(str(tmp_path))
    assert load_transformer(str(tmp_path), weights=False).model is not None  # shapes alone need no weights


def test_a_streamed_llama_without_architectures_prunes_with_its_head(tmp_path):
    model = tiny_llama()
    checkpoint = StreamedCheckpoint(_without_architectures(model, tmp_path / "src"), tmp_path / "out")
    assert type(checkpoint.model).__name__ == "LlamaForCausalLM"
    reports = prune_blocks(checkpoint, [example_inputs(model, batch=3, length=12, seed=i) for i in range(2)], 0.5)
    out = checkpoint.finish()
    assert len(reports) == 2 * len(layers(model))
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


# ---- standard outputs: config.json says the widths when it can ---------------------------------------


def tiny_mistral():
    import transformers

    torch.manual_seed(0)
    return transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
        head_dim=4, intermediate_size=20, max_position_embeddings=32, sliding_window=None)).eval()


def _auto_load(directory, causal: bool, base_of_lm: bool = False):
    """transformers alone, offline: no code of ours, and every weight accounted for (the base model of a
    causal LM leaves only the LM head out)."""
    import transformers

    cls = transformers.AutoModelForCausalLM if causal else transformers.AutoModel
    model, info = cls.from_pretrained(directory, local_files_only=True, output_loading_info=True)
    unexpected = {k for k in info["unexpected_keys"] if not (base_of_lm and k.startswith("lm_head."))}
    assert not info["missing_keys"] and not unexpected and not info["mismatched_keys"], info
    return model.eval()


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "phi3"])
def test_uniform_heads_and_ffn_of_a_head_dim_family_load_with_transformers_alone(name, tmp_path, monkeypatch):
    from compressor.transformer.models import save_standard
    from compressor.transformer.surgery import MANIFEST, prune_ffn, prune_query_heads, query_heads

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = tiny_mistral() if name == "mistral" else MODELS[name]()
    heads, group = query_heads(model, 0), model.config.num_attention_heads // model.config.num_key_value_heads
    for i in range(len(layers(model))):  # other heads and neurons per layer, the same counts
        # half the query heads of every KV head (heads == group on qwen2: one of two per KV head)
        keep = [kv * group + (j + i) % group for kv in range(heads // group) for j in range(max(1, group // 2))]
        prune_query_heads(model, i, sorted(keep))
        prune_ffn(model, i, [n for n in range(20) if (n + i) % 4 != 0])
    inputs = example_inputs(model)
    expected = first_output(model, inputs)
    assert save_standard(model, tmp_path / name)
    assert not (tmp_path / name / MANIFEST).exists()
    config = json.loads((tmp_path / name / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (heads // 2, heads // group)
    assert config["intermediate_size"] == 15 and config["head_dim"] == dims(model).head_dim
    loaded = _auto_load(tmp_path / name, causal=True)
    assert type(loaded).__module__.startswith("transformers.")
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, expected)
        # AutoModel: the base model, the same hidden states
        base = _auto_load(tmp_path / name, causal=False, base_of_lm=True)
        torch.testing.assert_close(base(**inputs).last_hidden_state, model.model(**inputs).last_hidden_state)


@pytest.mark.parametrize("name", ["bert", "vit", "opt", "gpt2"])
def test_a_uniform_ffn_of_any_family_loads_with_transformers_alone(name, tmp_path):
    from compressor.transformer.adapters import ADAPTERS
    from compressor.transformer.models import save_standard
    from compressor.transformer.surgery import MANIFEST, prune_ffn

    model = MODELS[name]()
    for i in range(len(layers(model))):
        prune_ffn(model, i, [n for n in range(24) if (n + i) % 3 != 0])
    inputs = example_inputs(model)
    expected = first_output(model, inputs)
    assert save_standard(model, tmp_path / name)
    assert not (tmp_path / name / MANIFEST).exists()
    assert json.loads((tmp_path / name / "config.json").read_text())[ADAPTERS[name].ffn_key] == 16
    loaded = _auto_load(tmp_path / name, causal=name in ("opt", "gpt2"))
    torch.testing.assert_close(first_output(loaded, inputs), expected)


def test_pruned_heads_outside_head_dim_families_keep_the_manifest(tmp_path):
    from compressor.transformer.models import save_standard
    from compressor.transformer.surgery import MANIFEST, load_pruned, prune_heads

    model = tiny_bert()
    for i in range(len(layers(model))):
        prune_heads(model, i, [0, 2])  # uniform, but BERT's config derives head size from hidden / heads
    before = model.config.to_dict()
    assert not save_standard(model, tmp_path / "bert")
    assert json.loads((tmp_path / "bert" / MANIFEST).read_text())["heads"] == [2, 2]
    config = json.loads((tmp_path / "bert" / "config.json").read_text())
    assert (config["num_attention_heads"], config["intermediate_size"]) == (before["num_attention_heads"], 24)
    inputs = example_inputs(model)
    torch.testing.assert_close(first_output(load_pruned(tmp_path / "bert"), inputs), first_output(model, inputs))


def test_uneven_widths_or_an_uneven_kv_map_keep_the_manifest(tmp_path):
    from compressor.transformer.models import save_standard
    from compressor.transformer.surgery import MANIFEST, load_pruned, prune_ffn, prune_query_heads

    uneven_ffn = tiny_llama()
    prune_ffn(uneven_ffn, 0, range(10))
    assert not save_standard(uneven_ffn, tmp_path / "ffn") and (tmp_path / "ffn" / MANIFEST).exists()

    uneven_map = tiny_llama()  # the same counts everywhere, but 3 + 1 query heads per KV head
    for i in range(len(layers(uneven_map))):
        prune_query_heads(uneven_map, i, [0, 1, 2, 4])
    assert not save_standard(uneven_map, tmp_path / "kv")
    assert json.loads((tmp_path / "kv" / MANIFEST).read_text())["kv_index"] == [[0, 0, 0, 1]] * 2
    inputs = example_inputs(uneven_map)
    torch.testing.assert_close(first_output(load_pruned(tmp_path / "kv"), inputs), first_output(uneven_map, inputs))


def test_standard_config_reads_earlier_manifests_in_kv_groups():
    from compressor.transformer.models import standard_config

    config = {"model_type": "llama", "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 32,
              "intermediate_size": 20}
    out = standard_config(config, {"head_groups": [1, 1], "ffn": [12, 12]})
    assert (out["num_attention_heads"], out["num_key_value_heads"], out["head_dim"], out["intermediate_size"]) == \
        (4, 1, 4, 12)
    assert config["intermediate_size"] == 20  # the input is not changed
    assert standard_config(config, {"head_groups": [1, 2], "ffn": [12, 12]}) is None


@pytest.mark.parametrize(("name", "standard"), [("llama", False), ("mistral", True)])
def test_a_config_transformers_would_refuse_keeps_the_manifest(name, standard, tmp_path):
    """6 query heads (3 per KV head) of a hidden size of 32: Mistral's config takes head_dim as given,
    Llama's still asks hidden_size % heads == 0 and refuses it, so that model keeps its manifest."""
    from compressor.transformer.models import save_standard
    from compressor.transformer.surgery import MANIFEST, load_pruned, prune_query_heads

    model = tiny_mistral() if name == "mistral" else tiny_llama()
    for i in range(len(layers(model))):
        prune_query_heads(model, i, [0, 1, 2, 4, 5, 6])
    inputs = example_inputs(model)
    assert save_standard(model, tmp_path / name) is standard
    assert (tmp_path / name / MANIFEST).exists() is not standard
    loaded = _auto_load(tmp_path / name, causal=True) if standard else load_pruned(tmp_path / name)
    torch.testing.assert_close(first_output(loaded, inputs), first_output(model, inputs))


def test_the_longest_sequence_leaves_roberta_its_positions_after_padding():
    """RoBERTa's position ids start at pad_token_id + 1, so 34 position embeddings take 32 tokens (a measured
    shape of 34 would index past them in ONNX Runtime); BERT's take all of theirs."""
    import transformers

    from compressor.transformer.adapters import max_sequence

    common = dict(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=24,
                  max_position_embeddings=34)
    roberta = transformers.RobertaModel(transformers.RobertaConfig(pad_token_id=1, **common))
    assert max_sequence(roberta) == 32
    ids = torch.randint(3, 50, (1, 32))
    assert roberta(input_ids=ids).last_hidden_state.shape == (1, 32, 32)  # the limit itself runs
    assert max_sequence(transformers.BertModel(transformers.BertConfig(**common))) == 34


def test_of_the_supported_families_gemma_4_alone_reads_per_layer_config_and_for_its_head_sizes_alone():
    """transformers 5.x can state per-layer widths in a config (`per_layer_config`), but only families whose
    modeling code reads it build their layers from it. Of the families here, the installed release's Gemma 4 alone
    does, and for its layers' head size and KV heads alone (its global layers'): its config keeps them, restated when
    layers go, while its query heads and FFN widths are read from the global config, so unequal ones keep
    osscar_widths.json + load_pruned (the README's table of families says so). A release that teaches a family more
    fails this test: that family should then save `per_layer_config` for them."""
    import inspect
    import re

    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    from compressor.transformer.adapters import ADAPTERS

    readers = {}
    for model_type in sorted(ADAPTERS):
        source = inspect.getsource(inspect.getmodule(getattr(transformers, MODEL_MAPPING_NAMES[model_type])))
        if "per_layer_config" in source:
            readers[model_type] = set(re.findall(r"layer_config\.(\w+)", source))
    assert readers == {"gemma4_text": {"head_dim", "num_key_value_heads"}}


def test_an_encoder_classifier_keeps_its_head_and_other_heads_are_dropped(tmp_path):
    """A sequence classifier is what its user serves: loaded with its head, logits out; a masked-LM head (a
    pretraining head) is dropped for the base model, as before."""
    import transformers

    config = tiny_bert().config
    torch.manual_seed(0)
    transformers.BertForSequenceClassification(transformers.BertConfig(**{**config.to_dict(), "num_labels": 3})
                                               ).save_pretrained(tmp_path / "classifier")
    loaded = load_transformer(str(tmp_path / "classifier"))
    assert type(loaded.model).__name__ == "BertForSequenceClassification"
    assert (loaded.output_name, loaded.causal) == ("logits", False)
    assert layers(loaded.model) is loaded.model.bert.encoder.layer
    transformers.BertForMaskedLM(config).save_pretrained(tmp_path / "mlm")
    loaded = load_transformer(str(tmp_path / "mlm"))
    assert (type(loaded.model).__name__, loaded.output_name) == ("BertModel", "last_hidden_state")


@pytest.mark.parametrize("cls, config, path", [
    ("Qwen3Model", "Qwen3Config", "layers"),  # an embedding model's checkpoint (Qwen3-Embedding, gte-Qwen2)
    ("MistralModel", "MistralConfig", "layers"),  # e5-mistral's
    ("Qwen3ForSequenceClassification", "Qwen3Config", "model.layers"),  # a reranker's or reward model's score head
    ("OPTModel", "OPTConfig", "decoder.layers"),
])
def test_a_decoder_familys_base_model_and_score_head_load_as_encoders(cls, config, path, tmp_path):
    """A decoder family's base model (no LM head) or sequence classifier is an encoder here: its last hidden state or
    its logits out, no decode step; its blocks where the family's causal LM holds them under `model.`."""
    import transformers

    torch.manual_seed(0)
    getattr(transformers, cls)(getattr(transformers, config)(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=20, ffn_dim=20, max_position_embeddings=32, pad_token_id=0, num_labels=1,
        word_embed_proj_dim=32)).save_pretrained(tmp_path / cls)
    loaded = load_transformer(str(tmp_path / cls))
    assert type(loaded.model).__name__ == cls and not loaded.causal
    assert loaded.output_name == ("logits" if cls.endswith("Classification") else "last_hidden_state")
    assert layers_path(loaded.model) == path and layers(loaded.model) is loaded.model.get_submodule(path)


@pytest.mark.parametrize("name, head", [("clip_vision_model", True), ("siglip_vision_model", True),
                                        ("siglip_vision_model", False), ("clip_projection", True)])
def test_a_vision_tower_serves_its_pooled_embedding_first_and_its_token_states_after(name, head, tmp_path):
    """CLIP's and SigLIP's vision towers serve pooler_output (the [CLS] state after post_layernorm, SigLIP's
    attention-pooling head), CLIP's with its projection (IP-Adapter's, SVD's image encoder) its image_embeds: the
    export's first output, which the job scores, the last hidden state after it, both within parity; a SigLIP tower
    without its head serves its token states alone."""
    import transformers

    from exporters.onnx import check_hf_parity, export_hf_onnx

    from .transformer_models import ENCODER_SHAPED

    model = ENCODER_SHAPED[name if name != "clip_projection" else "clip_vision_model"]()
    if name == "clip_projection":
        torch.manual_seed(0)
        model = transformers.CLIPVisionModelWithProjection(model.config).eval()
    model.config.vision_use_head = head
    if not head:
        model = type(model)(model.config).eval()
    model.save_pretrained(tmp_path / name)
    loaded = load_transformer(str(tmp_path / name))
    pooled = "image_embeds" if name == "clip_projection" else "pooler_output"
    assert type(loaded.model) is type(model)
    assert loaded.outputs == ((pooled, "last_hidden_state") if head else ("last_hidden_state",))
    if head:
        example = example_inputs(loaded.model)
        path = export_hf_onnx(loaded.model, example, tmp_path / "model.onnx", output_name=loaded.outputs)
        assert check_hf_parity(loaded.model, path, example, loaded.outputs).max_abs_error < 1e-5
        import onnxruntime as ort

        assert [o.name for o in ort.InferenceSession(str(path)).get_outputs()] == list(loaded.outputs)
