"""Head (GQA-aware) and FFN surgery on every transformer family, and save -> reload via the manifest."""

import copy

import pytest
import torch
import transformers

from compressor.modules import count_parameters
from compressor.transformer.adapters import adapter_for, dims, layers
from compressor.transformer.surgery import (
    head_groups,
    in_features,
    load_pruned,
    projection,
    prune_ffn,
    prune_heads,
    save_pruned,
)

from .transformer_models import MODELS, first_output, tiny_gpt2, tiny_llama


def zero_inputs(model, index, path, kept):
    """The dense model with every input row of a projection but `kept` zeroed."""
    ref = copy.deepcopy(model)
    proj = projection(layers(ref)[index], path)
    dropped = torch.ones(in_features(proj), dtype=torch.bool)
    dropped[kept] = False
    if proj.weight.shape[0] == in_features(proj) and type(proj).__name__ == "Conv1D":
        proj.weight.data[dropped] = 0
    else:
        proj.weight.data[:, dropped] = 0
    return ref


def removed_parameters(model, index, groups_removed, neurons_removed):
    adapter, d = adapter_for(model), dims(model)
    layer, hidden = layers(model)[index], model.config.hidden_size
    per_group = d.group * d.head_dim * 2 * hidden + 2 * d.head_dim * hidden  # q and o, k and v
    if projection(layer, adapter.q).bias is not None:
        per_group += d.group * d.head_dim + 2 * d.head_dim
    per_neuron = hidden * (1 + len(adapter.up)) + sum(projection(layer, p).bias is not None for p in adapter.up)
    return groups_removed * per_group + neurons_removed * per_neuron


@pytest.mark.parametrize("name", sorted(MODELS))
def test_pruning_equals_the_dense_model_with_those_rows_zeroed(name):
    model = MODELS[name]()
    adapter, d = adapter_for(model), dims(model)
    assert head_groups(model, 0) == d.kv_heads  # GQA: whole KV groups are the unit
    before = count_parameters(model)
    keep_groups = [0, d.kv_heads - 1]
    q_rows = [h * d.head_dim + a for grp in keep_groups for h in range(grp * d.group, (grp + 1) * d.group)
              for a in range(d.head_dim)]
    reference = zero_inputs(model, 0, adapter.o, q_rows)
    prune_heads(model, 0, keep_groups)
    torch.testing.assert_close(first_output(model), first_output(reference), rtol=1e-5, atol=1e-5)
    ffn = in_features(projection(layers(model)[1], adapter.down))
    reference = zero_inputs(model, 1, adapter.down, [1, 4, 5, 9])
    prune_ffn(model, 1, [1, 4, 5, 9])
    torch.testing.assert_close(first_output(model), first_output(reference), rtol=1e-5, atol=1e-5)
    assert count_parameters(model) == before - removed_parameters(MODELS[name](), 0, d.kv_heads - 2, 0) \
        - removed_parameters(MODELS[name](), 1, 0, ffn - 4)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_save_and_reload_through_the_manifest(name, tmp_path):
    model = MODELS[name]()
    prune_heads(model, 1, [1])
    prune_ffn(model, 0, [0, 2, 3, 7, 11])
    save_pruned(model, tmp_path / "m")
    reloaded = load_pruned(tmp_path / "m")
    torch.testing.assert_close(first_output(reloaded), first_output(model))
    assert head_groups(reloaded, 1) == 1
    assert in_features(projection(layers(reloaded)[0], adapter_for(model).down)) == 5


def test_gpt2_fused_qkv_keeps_q_k_and_v_of_the_kept_heads():
    model = tiny_gpt2()
    c_attn = layers(model)[0].attn.c_attn.weight.detach().clone()  # (hidden, 3 * hidden) Conv1D
    prune_heads(model, 0, [2])
    hd = dims(model).head_dim
    cols = [c + part * 32 for part in range(3) for c in range(2 * hd, 3 * hd)]
    torch.testing.assert_close(layers(model)[0].attn.c_attn.weight, c_attn[:, cols])
    assert layers(model)[0].attn.split_size == hd and layers(model)[0].attn.num_heads == 1


def test_bad_selections_are_refused():
    model = tiny_llama()
    with pytest.raises(ValueError, match=r"head groups: indices out of range \[0, 2\): \[2\]"):
        prune_heads(model, 0, [0, 2])
    with pytest.raises(ValueError, match="no channel kept"):
        prune_ffn(model, 0, [])
    with pytest.raises(ValueError, match="unsupported transformer family"):
        adapter_for(torch.nn.Linear(2, 2))
    opt350 = transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, ffn_dim=8, num_attention_heads=2, word_embed_proj_dim=16,
        do_layer_norm_before=False))
    with pytest.raises(ValueError, match="post-norm OPT"):
        adapter_for(opt350)


def test_stories260k_gqa_prunes_and_reloads(shared_data, tmp_path):
    model = transformers.LlamaForCausalLM.from_pretrained(str(shared_data / "stories260K")).eval()
    d = dims(model)
    assert (d.heads, d.kv_heads, d.head_dim) == (8, 4, 8)
    for i in range(d.layers):
        prune_heads(model, i, [0, 2, 3])
        prune_ffn(model, i, range(0, 172, 2))
    ids = {"input_ids": torch.tensor([[1, 300, 301, 302, 50, 60]])}
    save_pruned(model, tmp_path / "s")
    torch.testing.assert_close(first_output(load_pruned(tmp_path / "s"), ids), first_output(model, ids))
