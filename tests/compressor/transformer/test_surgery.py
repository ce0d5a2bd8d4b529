"""Head (GQA-aware) and FFN surgery on every transformer family, and save -> reload via the manifest."""

import copy
import json

import pytest
import torch
import transformers

from compressor.errors import UnsupportedArchitecture
from compressor.modules import count_parameters
from compressor.transformer.adapters import adapter_for, block_hidden, dims, layers
from compressor.transformer.experts import is_experts
from compressor.transformer.surgery import (
    head_groups,
    in_features,
    kv_index,
    load_pruned,
    projection,
    prune_ffn,
    prune_heads,
    prune_query_heads,
    query_heads,
    remove_layers,
    save_pruned,
    widths,
)

from .transformer_models import MODELS, example_inputs, ffn_keep, first_output, tiny_gpt2, tiny_llama


def zero_inputs(model, index, path, kept):
    """The dense model with every input row of a projection but `kept` zeroed."""
    ref = copy.deepcopy(model)
    proj = projection(layers(ref)[index], path)
    dropped = torch.ones(in_features(proj), dtype=torch.bool)
    dropped[kept] = False
    if is_experts(proj):  # every expert's down projection
        proj.down_proj.data[:, :, dropped] = 0
    elif proj.weight.shape[0] == in_features(proj) and type(proj).__name__ == "Conv1D":
        proj.weight.data[dropped] = 0
    else:
        proj.weight.data[:, dropped] = 0
    return ref


def removed_parameters(model, index, groups_removed, neurons_removed):
    adapter, d = adapter_for(model), dims(model)
    layer, hidden = layers(model)[index], block_hidden(model, index)
    per_group = d.group * d.head_dim * 2 * hidden + 2 * d.head_dim * hidden  # q and o, k and v
    # a head's entries of each per-head parameter (Swin's bias table: a column; gpt-oss's sinks: one)
    per_group += sum(d.group * (p.numel() // p.shape[-1]) for p in map(layer.get_parameter, adapter.head_columns))
    if projection(layer, adapter.q).bias is not None:
        per_group += d.group * d.head_dim + 2 * d.head_dim
    for path in adapter.per_head_outputs:  # pruned with the query heads where the block has them
        extra = dict(layer.named_modules()).get(path)
        if extra is not None:
            per_group += d.group * d.head_dim * (hidden + (extra.bias is not None))
    up_biases = sum(projection(layer, p).bias is not None for p in adapter.up) * (1 + adapter.fused_up)
    per_neuron = hidden * (1 + adapter.up_matrices) + up_biases
    if adapter.experts:  # one neuron of every expert: its gate, up and down weights
        per_neuron = layer.get_submodule(adapter.down).gate_up_proj.shape[0] * 3 * hidden
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
    keep = ffn_keep(model, [1, 4, 5, 9])
    reference = zero_inputs(model, 1, adapter.down, keep)
    prune_ffn(model, 1, keep)
    torch.testing.assert_close(first_output(model), first_output(reference), rtol=1e-5, atol=1e-5)
    assert count_parameters(model) == before - removed_parameters(MODELS[name](), 0, d.kv_heads - 2, 0) \
        - removed_parameters(MODELS[name](), 1, 0, ffn - len(keep))



@pytest.mark.parametrize("name", sorted(MODELS))
def test_save_and_reload_through_the_manifest(name, tmp_path):
    model = MODELS[name]()
    prune_heads(model, 1, [1])
    keep = ffn_keep(model, [0, 2, 3, 7, 11])
    prune_ffn(model, 0, keep)
    save_pruned(model, tmp_path / "m")
    reloaded = load_pruned(tmp_path / "m")
    torch.testing.assert_close(first_output(reloaded), first_output(model))
    assert head_groups(reloaded, 1) == 1
    assert in_features(projection(layers(reloaded)[0], adapter_for(model).down)) == len(keep)


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
    with pytest.raises(ValueError, match=r"query heads: indices out of range \[0, 8\): \[8, 9\]; repeated "
                                         r"indices: \[1\]"):
        prune_query_heads(model, 0, [1, 1, 8, 9])
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


def _kv_width(model, layer):
    """Rows of K (= of V): their own projection's, or the k part of a fused [q | k | v] one."""
    adapter = adapter_for(model)
    if adapter.fused_qkv:
        return (projection(layer, adapter.q).out_features - in_features(projection(layer, adapter.o))) // 2
    return projection(layer, adapter.k).out_features


def _query_rows(heads, head_dim):
    return [h * head_dim + a for h in heads for a in range(head_dim)]


@pytest.mark.parametrize("name", ["llama", "qwen2", "phi3"])
def test_single_query_heads_equal_the_dense_model_with_those_heads_zeroed(name):
    """GQA pruned one query head at a time: uneven query heads per KV head, and a KV head with no kept
    query head leaves with its K/V rows."""
    model = MODELS[name]()
    adapter, d = adapter_for(model), dims(model)
    last = d.heads - 1
    keep = [0, 1, last]  # KV head 0 keeps two query heads, the last KV head one; any between: none
    reference = zero_inputs(model, 0, adapter.o, _query_rows(keep, d.head_dim))
    before = count_parameters(model)
    prune_query_heads(model, 0, keep)
    torch.testing.assert_close(first_output(model), first_output(reference), rtol=1e-5, atol=1e-5)
    assert query_heads(model, 0) == 3 and kv_index(model, 0).tolist() == [0, 0, 1]
    layer = layers(model)[0]
    assert _kv_width(model, layer) == 2 * d.head_dim
    if not adapter.fused_qkv:
        assert projection(layer, adapter.v).out_features == 2 * d.head_dim
    bias = projection(layers(model)[0], adapter.q).bias is not None
    per_q = 2 * d.head_dim * d.hidden + (d.head_dim if bias else 0)  # q rows and o columns
    per_kv = 2 * (d.head_dim * d.hidden + (d.head_dim if bias else 0))
    assert before - count_parameters(model) == (d.heads - 3) * per_q + (d.kv_heads - 2) * per_kv
    prune_query_heads(model, 0, [2])  # again on the pruned layer: the map follows the kept heads
    assert kv_index(model, 0).tolist() == [0] and _kv_width(model, layer) == d.head_dim
    torch.testing.assert_close(first_output(model), first_output(zero_inputs(reference, 0, adapter.o,
                                                                             _query_rows([last], d.head_dim))),
                               rtol=1e-5, atol=1e-5)


def test_gemma2s_soft_capped_scores_survive_single_query_heads():
    """Gemma 2 caps its attention scores (tanh, `attn_logit_softcapping`); pruned one query head at a time it runs
    the gathered attention, which dropped the cap (0.34 off at a cap of 0.5): it equals the dense model with those
    heads zeroed, padding queries included."""
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=20, max_position_embeddings=32, sliding_window=4,
        attn_logit_softcapping=0.5)).eval()
    adapter, d = adapter_for(model), dims(model)
    reference = zero_inputs(model, 0, adapter.o, _query_rows([0, 1, 3], d.head_dim))
    prune_query_heads(model, 0, [0, 1, 3])
    torch.testing.assert_close(first_output(model), first_output(reference), rtol=1e-5, atol=1e-5)
    # a prompt run into an empty static cache comes without a mask: causal from the first key, as SDPA's flag
    # is (the cache's empty slots after the prompt are never seen)
    ids = torch.randint(3, 64, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(input_ids=ids, use_cache=False).logits
        cache = transformers.StaticCache(config=model.config, max_cache_len=16)
        torch.testing.assert_close(model(input_ids=ids, past_key_values=cache, use_cache=True).logits, plain,
                                   rtol=1e-5, atol=1e-5)


def test_query_head_widths_save_and_reload(tmp_path):
    model = tiny_llama()
    prune_query_heads(model, 0, [0, 2, 3, 7])
    prune_query_heads(model, 1, [5])
    prune_ffn(model, 1, [0, 3])
    assert widths(model) == {"heads": [4, 1], "ffn": [20, 2], "kv_index": [[0, 0, 0, 1], [0]]}
    save_pruned(model, tmp_path / "m")
    reloaded = load_pruned(tmp_path / "m")
    torch.testing.assert_close(first_output(reloaded), first_output(model))
    assert widths(reloaded) == widths(model)


def test_manifests_of_earlier_releases_count_kv_groups(tmp_path):
    import json

    model = tiny_llama()
    prune_heads(model, 1, [1])
    save_pruned(model, tmp_path / "m")
    (tmp_path / "m" / "osscar_widths.json").write_text(json.dumps({"head_groups": [2, 1], "ffn": [20, 20]}))
    torch.testing.assert_close(first_output(load_pruned(tmp_path / "m")), first_output(model))


def test_a_bad_kv_map_in_a_manifest_is_refused(tmp_path):
    import json

    from compressor.errors import ModelReferenceError

    model = tiny_llama()
    prune_query_heads(model, 0, [0, 7])
    save_pruned(model, tmp_path / "m")
    manifest = json.loads((tmp_path / "m" / "osscar_widths.json").read_text())
    manifest["kv_index"][0] = [0, 2]  # KV head 1 kept but read by nobody
    (tmp_path / "m" / "osscar_widths.json").write_text(json.dumps(manifest))
    with pytest.raises(ModelReferenceError, match="kv_index"):
        load_pruned(tmp_path / "m")


def _identity_at(model, index):
    """The dense model with block `index` passing its input through (its updates to the stream gone)."""
    ref = copy.deepcopy(model)

    def hook(_module, args, kwargs, output):
        hidden = args[0] if args else next(v for k, v in kwargs.items() if k in ("hidden_states", "x"))
        return hidden if isinstance(output, torch.Tensor) else (hidden, *output[1:])

    layers(ref)[index].register_forward_hook(hook, with_kwargs=True)
    return ref


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_removed_layer_is_the_identity_and_the_model_saves_as_a_shallower_one(name, tmp_path):
    model = MODELS[name]()
    n = dims(model).layers
    gone = 1 if adapter_for(model).first_layer_fixed else 0  # ModernBERT's first layer stays (its own build)
    if not adapter_for(model).whole_layers:  # Swin: blocks shift windows by their place in a stage
        with pytest.raises(UnsupportedArchitecture, match="no layer is removed whole"):
            remove_layers(model, [gone])
        assert len(layers(model)) == n
        return
    if gone:
        with pytest.raises(UnsupportedArchitecture, match="first layer is built unlike the others"):
            remove_layers(model, [0])
    reference = _identity_at(model, gone)
    before = count_parameters(model)
    types = getattr(model.config, "layer_types", None)
    remove_layers(model, [gone])
    assert len(layers(model)) == dims(model).layers == n - 1 == model.config.num_hidden_layers
    if isinstance(types, list):
        assert model.config.layer_types == types[:gone] + types[gone + 1:]
    # the block left is renumbered: a KV cache indexes its layers by layer_idx
    assert all(m.layer_idx == 0 for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int))
    assert count_parameters(model) < before
    torch.testing.assert_close(first_output(model), first_output(reference), rtol=1e-5, atol=1e-5)
    save_pruned(model, tmp_path / "m")
    torch.testing.assert_close(first_output(load_pruned(tmp_path / "m")), first_output(model))


def test_bad_layer_removals_are_refused_listing_every_bad_index():
    model = tiny_llama()
    with pytest.raises(ValueError, match=r"\[-1, 1, 5\]"):
        remove_layers(model, [-1, 5, 1, 1])
    with pytest.raises(UnsupportedArchitecture, match="removing all 2 layers"):
        remove_layers(model, [0, 1])
    assert dims(model).layers == 2  # nothing was removed


def test_mpnet_layers_read_the_shared_bias_rows_of_the_heads_they_kept(tmp_path):
    """MPNet computes one relative attention bias per head for all layers: a pruned layer selects its heads'
    rows (twice pruned: rows of the dense numbering), the manifest records them and a reload reads them."""
    model = MODELS["mpnet"]()
    reference = zero_inputs(model, 0, adapter_for(model).o, _query_rows([1, 3], dims(model).head_dim))
    prune_heads(model, 0, [1, 2, 3])
    prune_heads(model, 0, [0, 2])  # heads 1 and 3 of the dense layer
    torch.testing.assert_close(first_output(model), first_output(reference), rtol=1e-5, atol=1e-5)
    assert widths(model)["bias_rows"] == [[1, 3], [0, 1, 2, 3]]
    save_pruned(model, tmp_path / "m")
    torch.testing.assert_close(first_output(load_pruned(tmp_path / "m")), first_output(model))


def test_a_gpt2_scaled_by_inverse_layer_index_keeps_its_scaling_when_layers_move(tmp_path):
    """With `scale_attn_by_inverse_layer_idx` a GPT-2 block divides its scores by its index + 1, computed when
    the model is built: a block moved down by a removed layer must reload as the model in memory is."""
    from .transformer_models import VOCAB, _seeded

    model = _seeded(transformers.GPT2LMHeadModel, transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=4, n_inner=24, n_positions=32, bos_token_id=0,
        eos_token_id=0, scale_attn_by_inverse_layer_idx=True))
    prune_heads(model, 2, [0, 2])  # a narrower block: its queries are the first half of c_attn's outputs
    reference = _identity_at(model, 0)
    remove_layers(model, [0])
    torch.testing.assert_close(first_output(model), first_output(reference), rtol=1e-5, atol=1e-5)
    save_pruned(model, tmp_path / "m")
    torch.testing.assert_close(first_output(load_pruned(tmp_path / "m")), first_output(model), rtol=1e-5, atol=1e-6)


def test_whole_head_groups_are_refused_once_query_heads_went_one_by_one():
    model = tiny_llama()  # 8 query heads over 2 KV heads
    prune_query_heads(model, 0, [0, 1, 4, 5])  # two of each KV head's four
    with pytest.raises(ValueError, match="pruned one by one"):
        prune_heads(model, 0, [0])
    with pytest.raises(ValueError, match="pruned one by one"):
        head_groups(model, 0)


def _legacy_reader(directory):
    """The model a reader builds from a saved config's older per-layer key alone (transformers 5 without
    `layer_types`; what earlier releases read)."""
    from safetensors.torch import load_file

    config = json.loads((directory / "config.json").read_text())
    config.pop("layer_types")
    model_type = config.pop("model_type")
    cls = {"qwen2": transformers.Qwen2ForCausalLM, "modernbert": transformers.ModernBertModel,
           "gemma3_text": transformers.Gemma3ForCausalLM}[model_type]
    model = cls(transformers.AutoConfig.for_model(model_type, **config)).eval()
    model.load_state_dict(load_file(str(directory / "model.safetensors")), strict=False)
    return model


@pytest.mark.parametrize("family,layers_before,key,before,gone,after", [
    # full below max_window_layers, sliding from it: F F S S minus layer 0 is F S S, max_window_layers 1
    ("qwen2", 4, "max_window_layers", 2, [0], 1),
    # global every 3rd from layer 0: F S S F minus layer 2 is F S F, every 2nd
    ("modernbert", 4, "global_attn_every_n_layers", 3, [2], 2),
    # every 3rd global: S S F S S F minus layers 0 and 3 is S F S F, every 2nd
    ("gemma3_text", 6, "sliding_window_pattern", 3, [0, 3], 2),
])
def test_a_configs_older_layer_pattern_key_states_the_layers_left(family, layers_before, key, before, gone, after,
                                                                   tmp_path):
    """Removing layers shrinks `layer_types`; the older key that states the same pattern by a rule over the index
    is restated, so a reader that builds the layers from it builds the pruned model (left at its dense value it
    stated another one: Qwen2's F S S read as F F S, 0.31 apart)."""
    from compressor.transformer.models import save_standard

    from .transformer_models import VOCAB, _seeded

    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers_before, num_attention_heads=4,
                  intermediate_size=20, max_position_embeddings=64)
    config = {
        "qwen2": lambda: transformers.Qwen2Config(**common, num_key_value_heads=2, use_sliding_window=True,
                                                  sliding_window=4, max_window_layers=before),
        "modernbert": lambda: transformers.ModernBertConfig(**common, local_attention=4,
                                                            global_attn_every_n_layers=before, pad_token_id=0,
                                                            bos_token_id=1, eos_token_id=2, cls_token_id=1,
                                                            sep_token_id=2),
        "gemma3_text": lambda: transformers.Gemma3TextConfig(**common, num_key_value_heads=2, head_dim=16,
                                                             sliding_window=4, sliding_window_pattern=before),
    }[family]()
    cls = {"qwen2": transformers.Qwen2ForCausalLM, "modernbert": transformers.ModernBertModel,
           "gemma3_text": transformers.Gemma3ForCausalLM}[family]
    model = _seeded(cls, config)
    inputs = example_inputs(model, length=12)  # longer than the window: sliding and full layers differ
    remove_layers(model, gone)
    assert getattr(model.config, key, None) == after or getattr(model.config, f"_{key}") == after
    save_standard(model, tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text()).get(key, after) == after
    reader = _legacy_reader(tmp_path / "m")
    assert reader.config.layer_types == model.config.layer_types
    torch.testing.assert_close(first_output(reader, inputs), first_output(model, inputs))


def test_a_layer_pattern_no_older_key_can_state_is_named_in_a_warning(caplog):
    """ModernBERT's F S F S minus layer 1 is F F S: no 'global every n-th' states it. The key stays and a warning
    says which readers misplace the layers."""
    from .transformer_models import VOCAB, _seeded

    model = _seeded(transformers.ModernBertModel, transformers.ModernBertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=24,
        max_position_embeddings=64, local_attention=4, global_attn_every_n_layers=2, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2))
    with caplog.at_level("WARNING", logger="compressor.transformer.surgery"):
        remove_layers(model, [1])
    assert model.config.layer_types == ["full_attention", "full_attention", "sliding_attention"]
    assert "global_attn_every_n_layers = 2 cannot state the layers' attention types" in caplog.text


def test_a_conv1d_read_in_float32_is_still_a_projection():
    """`precision.float32_view` parametrizes a half-precision Conv1D into a subclass of another name."""
    from compressor.precision import float32_view
    from compressor.transformer.surgery import in_features, is_projection

    model = MODELS["gpt2"]().to(torch.bfloat16)
    with float32_view(model) as view:
        c_attn = layers(view)[0].attn.c_attn
        assert type(c_attn).__name__ != "Conv1D"
        assert is_projection(c_attn) and in_features(c_attn) == model.config.n_embd
