"""Head (GQA-aware) and FFN surgery on HF transformers, and save -> reload through the manifest."""

import copy

import pytest
import torch
import transformers

from compressor.adapters import adapter_for, dims, layers
from compressor.surgery import count_parameters
from compressor.transformer_surgery import head_groups, load_pruned, prune_ffn, prune_heads, save_pruned


def tiny_bert():
    config = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=24, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.BertModel(config).eval()


def tiny_llama():
    config = transformers.LlamaConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=8,
                                      num_key_value_heads=2, head_dim=4, intermediate_size=20,
                                      max_position_embeddings=32, tie_word_embeddings=True)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


MODELS = {"bert": tiny_bert, "llama": tiny_llama}
IDS = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))


def first_output(model, ids=IDS):
    with torch.no_grad():
        out = model(input_ids=ids)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def zero_columns(model, index, path, cols):
    ref = copy.deepcopy(model)
    linear = layers(ref)[index].get_submodule(path)
    dropped = torch.ones(linear.in_features, dtype=torch.bool)
    dropped[cols] = False
    linear.weight.data[:, dropped] = 0
    return ref


@pytest.mark.parametrize("name", sorted(MODELS))
def test_heads_and_neurons_pruned_equal_zeroed_columns(name):
    model = MODELS[name]()
    adapter, d = adapter_for(model), dims(model)
    assert head_groups(model, 0) == d.kv_heads  # GQA: whole KV groups are the unit
    before = count_parameters(model)
    keep_groups = [0, d.kv_heads - 1]
    q_cols = [h * d.head_dim + a for grp in keep_groups for h in range(grp * d.group, (grp + 1) * d.group)
              for a in range(d.head_dim)]
    reference = zero_columns(model, 0, adapter.o, q_cols)
    prune_heads(model, 0, keep_groups)
    torch.testing.assert_close(first_output(model), first_output(reference), rtol=1e-5, atol=1e-5)
    reference = zero_columns(model, 1, adapter.down, [1, 4, 5, 9])
    prune_ffn(model, 1, [1, 4, 5, 9])
    torch.testing.assert_close(first_output(model), first_output(reference), rtol=1e-5, atol=1e-5)
    hidden = model.config.hidden_size
    removed_heads = (d.kv_heads - 2) * (d.group * d.head_dim * 2 * hidden + 2 * d.head_dim * hidden)
    removed_ffn = (d.intermediate - 4) * hidden * (1 + len(adapter.up))
    biases = 0 if name == "llama" else (d.kv_heads - 2) * 3 * d.head_dim + (d.intermediate - 4)
    assert count_parameters(model) == before - removed_heads - removed_ffn - biases


@pytest.mark.parametrize("name", sorted(MODELS))
def test_save_and_reload_through_the_manifest(name, tmp_path):
    model = MODELS[name]()
    prune_heads(model, 1, [1])
    prune_ffn(model, 0, [0, 2, 3, 7, 11])
    save_pruned(model, tmp_path / "m")
    reloaded = load_pruned(tmp_path / "m")
    torch.testing.assert_close(first_output(reloaded), first_output(model))
    assert head_groups(reloaded, 1) == 1 and layers(reloaded)[0].get_submodule(adapter_for(model).down).in_features == 5


def test_bad_selections_are_refused():
    model = tiny_llama()
    with pytest.raises(ValueError, match=r"head groups: indices out of range \[0, 2\): \[2\]"):
        prune_heads(model, 0, [0, 2])
    with pytest.raises(ValueError, match="no channel kept"):
        prune_ffn(model, 0, [])
    with pytest.raises(ValueError, match="unsupported transformer family"):
        adapter_for(torch.nn.Linear(2, 2))


def test_stories260k_gqa_prunes_and_reloads(shared_data, tmp_path):
    model = transformers.LlamaForCausalLM.from_pretrained(str(shared_data / "stories260K")).eval()
    d = dims(model)
    assert (d.heads, d.kv_heads, d.head_dim) == (8, 4, 8)
    for i in range(d.layers):
        prune_heads(model, i, [0, 2, 3])
        prune_ffn(model, i, range(0, d.intermediate, 2))
    ids = torch.tensor([[1, 300, 301, 302, 50, 60]])
    save_pruned(model, tmp_path / "s")
    torch.testing.assert_close(first_output(load_pruned(tmp_path / "s"), ids), first_output(model, ids))
