"""A pruned checkpoint with unequal widths loads in plain transformers through its modeling_osscar.py."""

import json

import pytest
import torch
import transformers

from compressor.transformer.adapters import adapter_for, block_hidden, dims, layers
from compressor.transformer.models import save_standard
from compressor.transformer.remote import CHANGES, MODULE, _inner, auto_class
from compressor.transformer.sublayers import ATTENTION, FFN, remove_sublayer
from compressor.transformer.surgery import (
    MANIFEST,
    load_pruned,
    prune_ffn,
    prune_heads,
    prune_query_heads,
    remove_layers,
)

from .transformer_models import ENCODER_SHAPED, LLAMA_SHAPED, MODELS, example_inputs, first_output, tiny_llama

# every family whose pruning the file can state; the rest below keep the manifest alone
REMOTE = ["bert", "distilbert", "modernbert", "deberta-v2", "mpnet", "vit", "deit", "swin", "opt", "gpt2", "gpt_neox",
          "llama", "qwen2", "qwen3", "gemma2", "gemma3_text",
          # records on the modules of the families above: a pre-norm BERT, a ViT of layer scales whose config cannot
          # state widths, one of rotary patches, CLIP's vision tower, GPT-J, multi-query attention (GPT-BigCode, Falcon:
          # query heads over their one KV head as the family's own attention repeats it)
          "xlm-roberta-xl", "dinov2", "dinov3_vit", "clip_vision_model", "gptj", "gpt_bigcode", "falcon"]
BUILDERS = {**MODELS, **ENCODER_SHAPED, **LLAMA_SHAPED}


def _prune_unevenly(model) -> None:
    """Layer 0 loses FFN neurons and a head group, the last layer its FFN (a stand-in with an update; Gemma 2 / 3,
    which remove no sub-layer alone, two neurons of it instead)."""
    d = dims(model)
    prune_ffn(model, 0, range(7))
    if d.kv_heads == 1:  # multi-query attention, one group: a query head goes alone
        prune_query_heads(model, 0, range(d.heads - 1))
    else:
        prune_heads(model, 0, range(d.heads // d.group - 1))
    torch.manual_seed(1)
    last = len(layers(model)) - 1
    if adapter_for(model).normed_updates:
        prune_ffn(model, last, range(2))
    else:
        remove_sublayer(model, last, FFN, torch.randn(block_hidden(model, last)) * 0.1)


def _auto_load(directory, model):
    auto = getattr(transformers, auto_class(type(model).__name__))
    return auto.from_pretrained(directory, trust_remote_code=True, local_files_only=True).eval()


@pytest.mark.parametrize("family", REMOTE)
def test_unequal_widths_load_with_trust_remote_code_and_give_the_pruned_outputs(family, tmp_path):
    model = BUILDERS[family]()
    _prune_unevenly(model)
    assert not save_standard(model, tmp_path)
    assert (tmp_path / f"{MODULE}.py").is_file() and (tmp_path / MANIFEST).is_file()  # load_pruned still reads it
    config = json.loads((tmp_path / "config.json").read_text())
    inner = _inner(model)  # a task model's base model: AutoModel loads it alone, as from the dense checkpoint
    assert config["auto_map"] == {auto_class(type(model).__name__): f"{MODULE}.Osscar{type(model).__name__}",
                                  **({"AutoModel": f"{MODULE}.Osscar{inner[0]}"} if inner else {})}
    kinds = {c["kind"] for c in config[CHANGES]}
    # projections resized: nn.Linear rebuilt, or parameters of another module resized in place (GPT-2's Conv1D;
    # Swin's relative-position bias table has a column per head)
    assert ("removed" in kinds) != adapter_for(model).normed_updates and ("linear" in kinds) == (family != "gpt2")
    assert ("parameters" in kinds) == (family in ("gpt2", "swin"))
    # MPNet's relative bias is computed once for every layer: a pruned layer's hook reads its kept heads' rows
    assert ("bias_rows" in kinds) == (family == "mpnet")
    loaded = _auto_load(tmp_path, model)
    assert type(loaded).__name__ == f"Osscar{type(model).__name__}"
    inputs = example_inputs(model)
    torch.testing.assert_close(first_output(loaded, inputs), first_output(model, inputs), rtol=0, atol=0)
    torch.testing.assert_close(first_output(load_pruned(tmp_path), inputs), first_output(model, inputs))
    if inner is not None:
        base = transformers.AutoModel.from_pretrained(tmp_path, trust_remote_code=True, local_files_only=True).eval()
        assert type(base).__name__ == f"Osscar{inner[0]}"
        with torch.no_grad():
            torch.testing.assert_close(base(**inputs).last_hidden_state,
                                       getattr(model, inner[1])(**inputs).last_hidden_state, rtol=0, atol=0)


def test_a_decoder_without_an_attention_and_a_layer_generates_as_pruned(tmp_path):
    """Renumbered KV caches (an attention removed, a whole layer gone) are attributes the file sets."""
    config = transformers.LlamaConfig(vocab_size=50, hidden_size=32, num_hidden_layers=4, num_attention_heads=8,
                                      num_key_value_heads=2, head_dim=4, intermediate_size=20,
                                      max_position_embeddings=64, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    prune_heads(model, 1, [1])
    prune_ffn(model, 2, range(5))
    remove_sublayer(model, 0, ATTENTION, torch.randn(32) * 0.1)
    remove_layers(model, [3])
    assert not save_standard(model, tmp_path)
    changes = json.loads((tmp_path / "config.json").read_text())[CHANGES]
    assert any(c["kind"] == "attributes" and "layer_idx" in c["values"] for c in changes)
    loaded = _auto_load(tmp_path, model)
    ids = torch.tensor([[5, 7, 9, 11, 13]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
        steps = dict(max_new_tokens=8, do_sample=False, output_scores=True, return_dict_in_generate=True)
        ours, theirs = loaded.generate(ids, **steps), model.generate(ids, **steps)
    assert torch.equal(ours.sequences, theirs.sequences)
    torch.testing.assert_close(torch.stack(ours.scores), torch.stack(theirs.scores))  # through the KV cache


def _uneven_kv_map():
    model = tiny_llama()  # 3 + 1 query heads per KV head: the attention gathers with a buffer of surgery's
    for i in range(len(layers(model))):
        prune_query_heads(model, i, [0, 1, 2, 4])
    return model


def _phi3():
    model = MODELS["phi3"]()  # the attention reads its head count from a config view of its own
    prune_heads(model, 0, [0])
    return model


def _stablelm_norms():
    from .transformer_models import LLAMA_SHAPED

    model = LLAMA_SHAPED["stablelm"]()  # q/k LayerNorm modules one per head: the removed heads' are gone
    prune_heads(model, 0, [1])
    return model


@pytest.mark.parametrize("make", [_uneven_kv_map, _phi3, _stablelm_norms])
def test_changes_the_file_cannot_make_leave_the_manifest_alone(make, tmp_path):
    model = make()
    assert not save_standard(model, tmp_path)
    assert not (tmp_path / f"{MODULE}.py").exists()
    config = json.loads((tmp_path / "config.json").read_text())
    assert "auto_map" not in config and CHANGES not in config
    inputs = example_inputs(model)
    torch.testing.assert_close(first_output(load_pruned(tmp_path), inputs), first_output(model, inputs))


def test_query_heads_kept_in_whole_groups_leave_the_familys_attention_and_load_with_remote_code(tmp_path):
    """The default --gqa query-heads resized every attention through a KV map, every head kept too: the map (a
    tuple) is nothing the file can set, so a decoder whose FFNs alone narrowed got no modeling_osscar.py."""
    model = tiny_llama()  # 8 query heads over 2 KV heads
    d = dims(model)
    prune_query_heads(model, 0, range(d.heads))  # every head (the solver keeps them all)
    prune_query_heads(model, 1, range(d.group))  # KV head 0's whole group
    prune_ffn(model, 0, range(7))
    assert not any(hasattr(m, "kv_map") for m in model.modules())
    assert not save_standard(model, tmp_path)
    assert (tmp_path / f"{MODULE}.py").is_file()
    inputs = example_inputs(model)
    torch.testing.assert_close(first_output(_auto_load(tmp_path, model), inputs), first_output(model, inputs),
                               rtol=0, atol=0)
    torch.testing.assert_close(first_output(load_pruned(tmp_path), inputs), first_output(model, inputs))
    uneven = tiny_llama()
    prune_query_heads(uneven, 0, [0, 1, 4, 5])  # two of each KV head's four: a map repeat_kv does not read
    prune_query_heads(uneven, 1, range(6))  # KV head 1 keeps two of its four
    assert [hasattr(layer.self_attn, "kv_map") for layer in layers(uneven)] == [True, True]


def test_equal_widths_need_no_remote_code(tmp_path):
    model = tiny_llama()
    for i in range(len(layers(model))):
        prune_ffn(model, i, range(10))
    assert save_standard(model, tmp_path)
    assert not (tmp_path / f"{MODULE}.py").exists() and "auto_map" not in json.loads(
        (tmp_path / "config.json").read_text())


def test_the_auto_class_follows_the_class_name():
    assert auto_class("LlamaForCausalLM") == "AutoModelForCausalLM"
    assert auto_class("GPT2LMHeadModel") == "AutoModelForCausalLM"
    assert auto_class("BertForSequenceClassification") == "AutoModelForSequenceClassification"
    assert auto_class("BertModel") == "AutoModel"
