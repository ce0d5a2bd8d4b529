"""Mixture-of-Experts families end to end, each with what is its own: Phi-3.5-MoE's sparse mixer, gpt-oss's layout,
OLMoE's whole attentions, dense-FFN layers between MoE layers, grouped sigmoid routing, latent attention heads."""

import copy
import json

import pytest
import torch
import transformers

from compressor.progress import WARNING
from compressor.transformer.adapters import layers
from compressor.transformer.experts import expert_inputs, keep_expert_neurons, router_of
from compressor.transformer.models import save_standard
from compressor.transformer.pipeline import attention_fixed_cost, group_cost, prune_transformer
from exporters.onnx import check_hf_outputs, export_hf_onnx, hf_reference

from .transformer_models import (
    MODELS,
    MOE_EXTRA,
    MOE_MIXED,
    example_inputs,
    first_output,
    tiny_qwen3_moe,
)

MODELS = {**MODELS, **MOE_EXTRA}


def _exports_decodes_and_reads_half(pruned, tmp_path, *, decode: bool = True) -> dict:
    """model.onnx (prefill) and decode.onnx (one new token, then a prefill of 8) of a pruned MoE decoder, and the
    export of its bf16 copy read in float32 through parametrized (renamed) modules, each within 1e-4 of PyTorch;
    returns the example the graphs were exported on. `decode=False` checks the prefill graph alone: each export
    takes 6-9 s here (18 s with a delta rule's scan), so layouts whose decode step and half-precision read another
    test already covers skip them."""
    import copy

    from compressor.precision import float32_view
    from exporters.onnx import check_decode_parity, export_decode_step

    example = example_inputs(pruned, batch=2, length=10)
    path = export_hf_onnx(pruned, example, tmp_path / "model.onnx", output_name="logits", max_length=32)
    assert check_hf_outputs(path, example, hf_reference(pruned, example, "logits")).max_abs_error < 1e-4
    if not decode:
        return example
    step = export_decode_step(pruned, example["input_ids"], tmp_path / "decode.onnx", max_length=32)
    ids = torch.randint(3, 50, (3, 11), generator=torch.Generator().manual_seed(1))
    assert check_decode_parity(pruned, step, ids).max_abs_error < 1e-4
    assert check_decode_parity(pruned, step, ids, new=8).max_abs_error < 1e-4
    bf16 = copy.deepcopy(pruned).to(torch.bfloat16)
    with float32_view(bf16) as view:
        path = export_hf_onnx(view, example, tmp_path / "half.onnx", output_name="logits", max_length=32)
        assert check_hf_outputs(path, example, hf_reference(view, example, "logits")).max_abs_error < 1e-4
    return example


def test_phi_3_5_moe_is_pruned_exported_decoded_and_reloaded(tmp_path):
    """The experts solved on the sparse mixer's routing, the ONNX graph's routing equal to transformers' (prefill and
    decode step), the uniform widths in a config transformers loads alone; a router of another k is refused."""

    from compressor.errors import UnsupportedArchitecture
    from compressor.transformer.adapters import check_config

    model = MOE_EXTRA["phimoe"]()
    pruned, reports = prune_transformer(model, [example_inputs(model, batch=4, length=16, seed=s) for s in range(2)],
                                        {**{f"model.layers.{i}.self_attn.o_proj": 4 for i in (0, 1)},
                                         **{f"model.layers.{i}.mlp.experts": 8 for i in (0, 1)}})
    assert [r.width_after for r in reports] == [4, 8, 4, 8]
    _exports_decodes_and_reads_half(pruned, tmp_path)
    assert save_standard(pruned, tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["intermediate_size"] == 8
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    torch.testing.assert_close(first_output(reloaded), first_output(pruned))
    with pytest.raises(UnsupportedArchitecture, match="two experts a token"):
        check_config({**model.config.to_dict(), "model_type": "phimoe", "num_experts_per_tok": 3}, "m")


def test_gpt_oss_is_pruned_exported_decoded_and_reloaded(tmp_path):
    """gpt-oss: each expert keeps interleaved gate / up columns and their biases, solved on its routed rows; each kept
    query head keeps its sink logit (the gathered attention of unevenly pruned heads adds it to its softmax); an FFN
    removed alone stands in as the (output, scores) pair its block unpacks; the ONNX graph (the MoE node with
    gpt-oss's clamped SwiGLU and biases; prefill, decode step, a bf16 model read in float32) matches PyTorch; uniform
    widths go to a config transformers loads alone."""
    import copy

    from compressor.transformer.sublayers import FFN, RemovedSublayer
    from compressor.transformer.surgery import load_pruned

    model = MOE_EXTRA["gpt_oss"]()
    experts = layers(model)[0].mlp.experts
    keep = [0, 5, 6, 9, 17, 20, 30, 31]
    trimmed = copy.deepcopy(experts)
    keep_expert_neurons(trimmed, [keep] * 4)
    x = torch.randn(12, 32, generator=torch.Generator().manual_seed(3))
    _, weights, index = router_of(layers(model)[0].mlp)(x)  # the block's router: its top-k picks and weights
    full, part = expert_inputs(experts, x, index, weights), expert_inputs(trimmed, x, index, weights)
    torch.testing.assert_close(part[1], full[1][:, keep])  # the kept neurons' activations, biases and clamp included
    assert trimmed.intermediate_size == 8 and trimmed.gate_up_proj_bias.shape == (4, 16)
    data = [example_inputs(model, batch=4, length=16, seed=s) for s in range(2)]
    pruned, reports = prune_transformer(model, data, 0.25)
    assert [r.width_after for r in reports] == [3, 24, 3, 24]  # query heads, expert neurons
    dense_sinks = layers(model)[0].self_attn.sinks.detach()
    kept = [int(h) for h in reports[0].kept]
    torch.testing.assert_close(layers(pruned)[0].self_attn.sinks, dense_sinks[kept])
    groups = {**{f"model.layers.{i}.self_attn.o_proj": 1 for i in (0, 1)},  # one KV group of two query heads
              **{f"model.layers.{i}.mlp.experts": 24 for i in (0, 1)}}
    equal, _ = prune_transformer(model, data, groups, gqa="kv-groups")
    assert layers(equal)[1].self_attn.sinks.shape == (2,)
    example = _exports_decodes_and_reads_half(pruned, tmp_path)
    assert not save_standard(pruned, tmp_path / "saved")  # 3 query heads over 2 KV heads: the manifest
    torch.testing.assert_close(first_output(load_pruned(tmp_path / "saved")), first_output(pruned))
    assert save_standard(equal, tmp_path / "equal")
    config = json.loads((tmp_path / "equal" / "config.json").read_text())
    assert (config["intermediate_size"], config["num_attention_heads"], config["num_key_value_heads"]) == (24, 2, 1)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "equal")
    torch.testing.assert_close(first_output(reloaded), first_output(equal))
    shallow, _ = prune_transformer(model, data, 0.0, sublayers=[(1, FFN)])
    assert isinstance(layers(shallow)[1].mlp, RemovedSublayer) and layers(shallow)[1].mlp.pair
    path = export_hf_onnx(shallow, example, tmp_path / "shallow.onnx", output_name="logits", max_length=32)
    assert check_hf_outputs(path, example, hf_reference(shallow, example, "logits")).max_abs_error < 1e-4


@pytest.mark.parametrize("name", ["olmoe", "flex_olmo"])
def test_olmoe_and_flex_olmo_keep_their_attentions_and_prune_their_experts(name, tmp_path):
    """OLMoE and FlexOLMo normalise all heads' queries (keys) together: the heads stay whole (said once), the experts
    are pruned; a layer goes whole; the ONNX graphs (prefill, decode step, bf16 read in float32) match PyTorch and
    uniform widths go to a config transformers loads alone."""
    from compressor.errors import UnsupportedArchitecture
    from compressor.transformer.adapters import adapter_for, check_config
    from compressor.transformer.surgery import prune_heads, query_heads, remove_layers

    model = MOE_EXTRA[name]()
    assert not adapter_for(model).heads_prunable and adapter_for(model).experts
    check_config({**model.config.to_dict(), "model_type": name}, name)
    with pytest.raises(UnsupportedArchitecture, match="heads are not a prunable unit"):
        prune_heads(model, 0, [0])
    seen = []
    pruned, reports = prune_transformer(model, [example_inputs(model, batch=4, length=16, seed=s) for s in range(2)],
                                        0.5, progress=seen.append)
    assert [(r.name, r.width_after) for r in reports] == [(f"model.layers.{i}.mlp.experts", 16) for i in (0, 1)]
    assert [p for p in seen if p.stage == WARNING and "its attentions stay whole" in p.message]
    assert [query_heads(pruned, i) for i in (0, 1)] == [4, 4]
    assert save_standard(pruned, tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["intermediate_size"] == 16
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    torch.testing.assert_close(first_output(reloaded), first_output(pruned))
    remove_layers(pruned, [0])
    _exports_decodes_and_reads_half(pruned, tmp_path, decode=name == "olmoe")  # FlexOLMo's cache is OLMoE's
    with pytest.raises(UnsupportedArchitecture, match="SwiGLU"):
        check_config({**model.config.to_dict(), "model_type": name, "hidden_act": "gelu"}, name)



@pytest.mark.parametrize("name", sorted(MOE_MIXED))
def test_a_dense_ffn_layer_between_moe_layers_is_pruned_exported_removed_and_reloaded(name, tmp_path):
    """A MoE family's dense-FFN layer is pruned as a dense family's FFN (`FamilyAdapter.at`: its paths, one neuron's
    cost), beside the experts of the others; the ONNX graphs match PyTorch; a removed layer restates which layers are
    dense (first_k_dense_replace, mlp_only_layers, mlp_layer_types, ERNIE 4.5's MoE range), and uniform widths go to
    both width keys of a config transformers loads alone (an ungated shared expert's width, n_shared_experts x
    moe_intermediate_size, is no key of its own: the manifest)."""
    from compressor.errors import ModelReferenceError
    from compressor.transformer.adapters import adapter_for, check_config, dense_ffn_layers
    from compressor.transformer.pipeline import resize_transformer
    from compressor.transformer.surgery import apply_widths, load_pruned, remove_layers, widths

    build, dense = MOE_MIXED[name]
    model = build()
    check_config({**model.config.to_dict(), "model_type": name}, name)
    assert dense_ffn_layers(model.config) == [i == dense for i in range(3)]
    adapter = adapter_for(model)
    here = adapter.at(layers(model)[dense])
    assert (here.down, here.experts, here.shared_down) == ("mlp.down_proj", False, None)
    assert adapter.at(layers(model)[2]) is adapter
    # a dense neuron: its gate, up and down rows at every token; an expert's: at each of the token's 2 experts
    assert group_cost(model, "ffn_neurons", 1, index=dense) == 32 * 3
    assert group_cost(model, "ffn_neurons", 1, index=2) == 32 * 3 * 2

    data = [example_inputs(model, batch=4, length=16, seed=s) for s in range(2)]
    pruned, reports = prune_transformer(model, data, 0.25)
    ffn = {r.name: r.width_after for r in reports if r.kind == "ffn_neurons"}
    assert ffn[f"model.layers.{dense}.mlp.down_proj"] == 15 and ffn["model.layers.2.mlp.experts"] == 16
    assert widths(pruned)["ffn"][dense] == 15
    # every layout's routing in the prefill graph; the decode step and bf16 read for one grouped router with a gated
    # shared expert and one softmax router (both latent attentions' in their own test)
    _exports_decodes_and_reads_half(pruned, tmp_path, decode=name in ("glm4_moe", "qwen3_moe"))

    shared = adapter.shared_down
    plan = {**{f"model.layers.{i}.self_attn.o_proj": 4 for i in range(3)},
            **{f"model.layers.{i}.mlp.experts": 8 for i in range(3) if i != dense},
            **{f"model.layers.{i}.{shared}": 8 for i in range(3) if i != dense and shared},
            f"model.layers.{dense}.mlp.down_proj": 12}
    resized = resize_transformer(model, plan)
    assert widths(resized)["ffn"] == [12 if i == dense else 8 for i in range(3)]
    remove_layers(resized, [2 if dense == 0 else 0])  # a MoE layer: the dense one is then the first
    assert dense_ffn_layers(resized.config) == [True, False]
    restated = {"glm4_moe": ("first_k_dense_replace", 1), "dots1": ("first_k_dense_replace", 1),
                "deepseek_v3": ("first_k_dense_replace", 1), "deepseek_v2": ("first_k_dense_replace", 1),
                "mistral4": ("first_k_dense_replace", 1), "ernie4_5_moe": ("moe_layer_end_index", 1),
                "qwen3_moe": ("mlp_only_layers", [0]),
                "exaone_moe": ("mlp_layer_types", ["dense", "sparse"]),
                "glm4_moe_lite": ("mlp_layer_types", ["dense", "sparse"])}[name]
    assert getattr(resized.config, restated[0]) == restated[1]
    if shared:
        assert widths(resized)["shared"] == [0, 8]  # a dense FFN's layer has no shared expert
        assert not save_standard(resized, tmp_path / "saved")
        reloaded = load_pruned(tmp_path / "saved")
        with pytest.raises(ModelReferenceError, match="for layers without one"):
            apply_widths(build(), {"heads": [4] * 3, "ffn": [20, 16, 16], "shared": [8 * (i != dense) + 8 for i in
                                                                                     range(3)]})
    else:
        assert save_standard(resized, tmp_path / "saved")
        config = json.loads((tmp_path / "saved" / "config.json").read_text())
        assert (config["intermediate_size"], config["moe_intermediate_size"], config["mlp_only_layers"]) == (12, 8, [0])
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    torch.testing.assert_close(first_output(reloaded), first_output(resized))


@pytest.mark.parametrize("family, q_lora_rank", [("Glm4MoeLite", 24), ("DeepseekV2", None)])
def test_latent_attention_heads_keep_their_query_and_key_value_rows_and_leave_the_cache_whole(family, q_lora_rank,
                                                                                            tmp_path):
    """A multi-head latent attention head (DeepSeek-V3's, as GLM-4.7-Flash's class inherits it; DeepSeek-V2's, whose
    rotary is complex-valued and exported in real arithmetic) is its query rows (q_b_proj's, or q_proj's without a
    query latent: 8 + 4 a head), its key / value rows of kv_b_proj (8 + 8 a head) and its output projection's inputs
    (8 a head): keeping heads 0 and 2 gives the dense model with heads 1 and 3's outputs zeroed; the latent the cache
    holds keeps its width; the pruned model exports, decodes and reloads."""
    import copy

    from compressor.transformer.adapters import dims
    from compressor.transformer.surgery import load_pruned, prune_heads, query_heads, save_pruned
    from exporters.onnx import _past_of

    from .transformer_models import tiny_latent

    model = tiny_latent(f"{family}ForCausalLM", f"{family}Config", layers=2, q_lora_rank=q_lora_rank)
    d = dims(model)
    assert (d.heads, d.kv_heads, d.head_dim) == (4, 4, 8)
    attention = layers(model)[1].self_attn
    query = attention.q_b_proj if q_lora_rank else attention.q_proj
    q, kv, o = (p.weight.detach().clone() for p in (query, attention.kv_b_proj, attention.o_proj))
    reference = copy.deepcopy(model)
    with torch.no_grad():
        reference.model.layers[1].self_attn.o_proj.weight[:, 8:16] = 0  # head 1's output
        reference.model.layers[1].self_attn.o_proj.weight[:, 24:32] = 0  # head 3's
    prune_heads(model, 1, [0, 2])
    assert query_heads(model, 1) == 2 and query_heads(model, 0) == 4
    torch.testing.assert_close(query.weight, torch.cat([q[0:12], q[24:36]]))
    torch.testing.assert_close(attention.kv_b_proj.weight, torch.cat([kv[0:16], kv[32:48]]))
    torch.testing.assert_close(attention.o_proj.weight, torch.cat([o[:, 0:8], o[:, 16:24]], 1))
    torch.testing.assert_close(first_output(model), first_output(reference), rtol=1e-5, atol=1e-6)
    ids = example_inputs(model)["input_ids"]
    assert [tuple(t.shape) for t in _past_of(model, ids)[2:]] == [(2, 1, 9, 16), (2, 1, 9, 4)]  # the latent, whole
    # a head's rows: q from the 24-wide query latent (or the 32-wide stream), kv_b from the 16-wide latent, o's
    # inputs; and its scores and values over 10 keys
    query_inputs = q_lora_rank or 32
    assert group_cost(model, "attention_heads", 10) == query_inputs * 12 + 16 * 16 + 8 * 32 + 10 * (12 + 8)
    # what no head owns (a removed attention saves it too): the stream into the query latent, the key / value latent
    # and the rotary key
    assert attention_fixed_cost(model) == 32 * ((q_lora_rank or 0) + 16 + 4)
    assert attention_fixed_cost(MODELS["llama"]()) == 0
    _exports_decodes_and_reads_half(model, tmp_path)
    save_pruned(model, tmp_path / "saved")
    torch.testing.assert_close(first_output(load_pruned(tmp_path / "saved")), first_output(model))


def test_grouped_routing_configs_its_router_cannot_run_are_refused_naming_the_values():
    """n_group must split the experts into equal groups of 2 at least (the router sums each group's top 2),
    topk_group must be a count of groups, and a token's experts must fit in its chosen groups (DeepSeek-V2's of one
    expert, or none when it routes greedily; its two topk_methods only); a Qwen-MoE without routed experts
    (num_experts 0, which config.json holds as num_local_experts) is a dense model."""
    from compressor.errors import UnsupportedArchitecture
    from compressor.transformer.adapters import check_config

    from .transformer_models import tiny_glm4_moe

    base = {**tiny_glm4_moe().config.to_dict(), "model_type": "glm4_moe"}
    check_config(base, "m")
    for change, message in [({"n_group": 3}, "8 experts in n_group 3"), ({"n_group": 8}, "8 experts in n_group 8"),
                            ({"topk_group": 3}, "topk_group 3 of n_group 2"),
                            ({"num_experts_per_tok": 5}, "num_experts_per_tok 5 exceeds the 4 experts"),
                            ({"hidden_act": "gelu"}, "hidden_act 'gelu'")]:
        with pytest.raises(UnsupportedArchitecture, match=f"m: glm4_moe \\(grouped routing\\): {message}"):
            check_config({**base, **change}, "m")
    # DeepSeek-V2: greedy routing has no groups (n_group unset, as its configs leave it); a group may be one expert
    v2 = {**base, "model_type": "deepseek_v2", "topk_method": "greedy", "n_group": None, "topk_group": None}
    check_config(v2, "m")
    check_config({**v2, "topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 4}, "m")
    with pytest.raises(UnsupportedArchitecture, match="deepseek_v2 \\(grouped routing\\): topk_method 'noaux_tc'"):
        check_config({**v2, "topk_method": "noaux_tc"}, "m")
    with pytest.raises(UnsupportedArchitecture, match="group_limited_greedy routing without n_group and topk_group"):
        check_config({**v2, "topk_method": "group_limited_greedy"}, "m")
    # ERNIE 4.5: a config.json without moe_num_shared_experts builds its class's default, 2 shared experts
    ernie = {"model_type": "ernie4_5_moe", "hidden_act": "silu", "moe_layer_interval": 1}
    check_config(ernie, "m")
    with pytest.raises(UnsupportedArchitecture, match="shared experts \\(moe_num_shared_experts 1 or more\\)"):
        check_config({**ernie, "moe_num_shared_experts": 0}, "m")
    qwen = {**tiny_qwen3_moe().config.to_dict(), "model_type": "qwen3_moe"}
    assert "num_local_experts" in qwen
    with pytest.raises(UnsupportedArchitecture, match="num_experts 0 every layer is a dense FFN"):
        check_config({**qwen, "num_local_experts": 0}, "m")


def test_a_half_precision_export_keeps_a_grouped_router_in_float32():
    """transformers keeps GLM-4.5's router weight and correction bias in float32 in a half model: a float16 export
    rounding the bias would route otherwise than the model."""
    from exporters.onnx import Float16

    from .transformer_models import tiny_glm4_moe

    model = tiny_glm4_moe()
    half = Float16(model)
    gate, dense = layers(half.model)[0].mlp.gate, layers(model)[0].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(gate.weight, dense.weight) and torch.equal(gate.e_score_correction_bias,
                                                                  dense.e_score_correction_bias)  # not rounded
    assert layers(half.model)[0].mlp.experts.down_proj.dtype == torch.float16


def test_ernie_moe_layers_are_read_from_their_range_and_restated_as_one():
    """ERNIE 4.5 builds MoE FFNs from moe_layer_start_index to moe_layer_end_index (-1 in config.json: the last
    layer), dense ones around them; removing layers restates the range, and a config left without MoE layers states
    a range past its last layer (not -1)."""
    from types import SimpleNamespace

    from compressor.transformer.adapters import dense_ffn_layers, restate_dense_ffn_layers

    saved = {"model_type": "ernie4_5_moe", "num_hidden_layers": 5, "moe_layer_start_index": 1,
             "moe_layer_end_index": -1, "moe_layer_interval": 1}
    assert dense_ffn_layers(saved) == [True, False, False, False, False]
    assert dense_ffn_layers({**saved, "moe_layer_end_index": 3}) == [True, False, False, False, True]
    config = SimpleNamespace(**{**saved, "moe_layer_end_index": 3})
    restate_dense_ffn_layers(config, [True, False, True])  # layers 2 and 3 removed
    assert (config.moe_layer_start_index, config.moe_layer_end_index) == (1, 1)
    restate_dense_ffn_layers(config, [True, True])
    config.num_hidden_layers = 2
    assert dense_ffn_layers(vars(config)) == [True, True]
    with pytest.raises(ValueError, match="MoE layers \\[1, 3\\] are not one run"):
        restate_dense_ffn_layers(config, [True, False, True, False])


def test_deepseek_v2s_complex_rotary_is_rotated_in_real_arithmetic_within_overlapping_exports():
    """Within an export, DeepSeek-V2's rotary gives (cos, sin) tables (yarn's attention scaling; longrope's tables of
    the input's length, whatever length the model ran last) and its module's apply_rotary_emb rotates with them as
    the complex one does; complex tables always go to the model's function, which the last export to end restores
    (two exports overlapping in threads end in either order)."""
    import sys

    from exporters.onnx import _real_rotary

    from .transformer_models import tiny_latent

    ropes = [{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "rope_theta": 10000.0},
             {"rope_type": "longrope", "short_factor": [1.0, 1.5], "long_factor": [3.0, 5.0], "factor": 4.0,
              "original_max_position_embeddings": 8, "rope_theta": 10000.0}]
    models = [tiny_latent("DeepseekV2ForCausalLM", "DeepseekV2Config", layers=1, rope_parameters=rope)
              for rope in ropes]
    modeling = sys.modules[type(models[0].model.rotary_emb).__module__]
    original = modeling.apply_rotary_emb
    gen = torch.Generator().manual_seed(0)
    x, positions = torch.randn(2, 20, 32, generator=gen), torch.arange(20).expand(2, 20)  # past the original 8
    q, k = torch.randn(2, 4, 20, 4, generator=gen), torch.randn(2, 1, 20, 4, generator=gen)
    expected = [original(q, k, m.model.rotary_emb(x, positions)) for m in models]
    for m in models:  # a short input last: longrope's short factors in place
        m.model.rotary_emb(x[:, :4], positions[:, :4])
    first, second = (_real_rotary(m) for m in models)
    first.__enter__()
    second.__enter__()
    for m, want in zip(models, expected, strict=True):
        tables = m.model.rotary_emb(x, positions)
        assert not tables.is_complex() and tables.shape == (2, 20, 2, 2)
        for got, wanted in zip(modeling.apply_rotary_emb(q, k, tables), want, strict=True):
            torch.testing.assert_close(got, wanted)
    first.__exit__(None, None, None)  # the first to start ends first: the second still exports
    assert modeling.apply_rotary_emb is not original
    complex_tables = type(models[0].model.rotary_emb).forward(models[0].model.rotary_emb, x, positions)
    for got, wanted in zip(modeling.apply_rotary_emb(q, k, complex_tables), expected[0], strict=True):
        torch.testing.assert_close(got, wanted)
    second.__exit__(None, None, None)
    assert modeling.apply_rotary_emb is original and not any("forward" in vars(m.model.rotary_emb) for m in models)


def test_qwen3_5_moe_prunes_its_experts_beside_delta_nets_and_loads_uniform_widths_alone(tmp_path):
    """Qwen3.5-MoE's language model: every layer's routed experts and gated shared expert are pruned, the attention
    layer's gated-query heads and the Gated DeltaNets' key groups too; a DeltaNet layer removed whole restates
    layer_types; the graph (a MoE node a layer beside the delta rule's scan) matches PyTorch; uniform widths go to a
    config transformers loads alone, and the multimodal checkpoint is refused with the line that saves its language
    model."""
    import onnx

    from compressor.errors import UnsupportedArchitecture
    from compressor.transformer.adapters import check_config
    from compressor.transformer.surgery import query_heads, remove_layers

    model = MOE_EXTRA["qwen3_5_moe_text"]()
    data = [example_inputs(model, batch=4, length=16, seed=s) for s in range(2)]
    pruned, reports = prune_transformer(model, data, 0.25, gqa="query-heads")
    widths = {r.name: r.width_after for r in reports}
    assert widths == {**{f"model.layers.{i}.mlp.experts": 24 for i in range(3)},
                      **{f"model.layers.{i}.mlp.shared_expert.down_proj": 18 for i in range(3)},
                      "model.layers.1.self_attn.o_proj": 3,
                      **{f"model.layers.{i}.linear_attn.out_proj": 2 for i in (0, 2)}}  # 2 key groups: a quarter is 0
    assert [query_heads(pruned, i) for i in range(3)] == [4, 3, 4]  # a DeltaNet layer's value columns, whole
    remove_layers(pruned, [2])
    assert pruned.config.layer_types == ["linear_attention", "full_attention"]
    # its decode step composes Qwen3.5's DeltaNet states (their own test) with MoE layers' (the MoE families')
    _exports_decodes_and_reads_half(pruned, tmp_path, decode=False)
    assert len([n for n in onnx.load(str(tmp_path / "model.onnx")).graph.node if n.op_type == "MoE"]) == 2

    equal, _ = prune_transformer(model, data, {**{f"model.layers.{i}.mlp.experts": 16 for i in range(3)},
                                               **{f"model.layers.{i}.mlp.shared_expert.down_proj": 12
                                                  for i in range(3)}, "model.layers.1.self_attn.o_proj": 4,
                                               **{f"model.layers.{i}.linear_attn.out_proj": 1 for i in (0, 2)}})
    assert save_standard(equal, tmp_path / "equal")
    config = json.loads((tmp_path / "equal" / "config.json").read_text())
    assert (config["moe_intermediate_size"], config["shared_expert_intermediate_size"], config["linear_num_key_heads"],
            config["linear_num_value_heads"]) == (16, 12, 1, 2)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "equal")
    torch.testing.assert_close(first_output(reloaded), first_output(equal))
    with pytest.raises(UnsupportedArchitecture, match="saved as a qwen3_5_moe_text checkpoint"):
        check_config({**model.config.to_dict(), "model_type": "qwen3_5_moe"}, "m")
    with pytest.raises(UnsupportedArchitecture, match="SwiGLU"):
        check_config({**model.config.to_dict(), "hidden_act": "gelu"}, "m")


def test_qwen3_next_reads_its_fused_delta_net_projections_and_a_dense_ffn_under_a_mixer():
    """Qwen3-Next: Qwen3.5-MoE's layers with its DeltaNet's q, k, v, z fused in in_proj_qkvz (b, a in in_proj_ba),
    grouped by key head: a key group's rows are cut from them together (removing one equals zeroing its value heads'
    output columns) and the exported graph orders them as its own forward does, over prompts of several chunks; a
    layer with both a DeltaNet mixer and a dense FFN (mlp_only_layers) reads as both (`FamilyAdapter.at`), its FFN
    pruned as a dense family's; a removed layer restates layer_types and mlp_only_layers; reloaded as pruned."""
    import tempfile
    from pathlib import Path

    from compressor.transformer.adapters import adapter_for, check_config, dense_ffn_layers
    from compressor.transformer.surgery import load_pruned, prune_mixer_units, remove_layers, save_pruned
    from exporters.onnx import check_hf_parity

    model = MOE_EXTRA["qwen3_next"]()
    cut, reference = copy.deepcopy(model), copy.deepcopy(model)
    prune_mixer_units(cut, 2, [0])  # key head 0 and its value heads 0 and 1
    with torch.no_grad():
        reference.model.layers[2].linear_attn.out_proj.weight[:, 16:] = 0  # value heads 2 and 3's columns
    torch.testing.assert_close(first_output(cut), first_output(reference), rtol=1e-6, atol=1e-6)
    check_config(model.config.to_dict(), "m")
    assert dense_ffn_layers(model.config) == [False, False, True]
    last = adapter_for(model).at(layers(model)[2])
    assert (last.recurrent, last.down, last.experts, last.shared_down) == (True, "mlp.down_proj", False, None)
    data = [example_inputs(model, batch=4, length=16, seed=s) for s in range(2)]
    pruned, reports = prune_transformer(model, data, 0.25, gqa="query-heads")
    assert {r.name: r.width_after for r in reports} == {
        **{f"model.layers.{i}.mlp.experts": 24 for i in (0, 1)},
        **{f"model.layers.{i}.mlp.shared_expert.down_proj": 18 for i in (0, 1)},
        "model.layers.1.self_attn.o_proj": 3, "model.layers.2.mlp.down_proj": 15,
        **{f"model.layers.{i}.linear_attn.out_proj": 2 for i in (0, 2)}}
    prune_mixer_units(pruned, 0, [1])  # the fused rows cut, then exported
    with tempfile.TemporaryDirectory() as tmp:
        _exports_decodes_and_reads_half(pruned, Path(tmp), decode=False)  # Qwen3.5-MoE's test decodes
        longer = example_inputs(pruned, batch=2, length=30, seed=1)  # two of the export's 16-token chunks
        assert check_hf_parity(pruned, Path(tmp) / "model.onnx", longer, "logits").max_abs_error < 1e-4
        remove_layers(pruned, [0])
        assert pruned.config.layer_types == ["full_attention", "linear_attention"]
        assert pruned.config.mlp_only_layers == [1]
        save_pruned(pruned, Path(tmp) / "saved")
        torch.testing.assert_close(first_output(load_pruned(Path(tmp) / "saved")), first_output(pruned))


def test_lfm2_moe_routes_by_its_blocks_bias_prunes_experts_beside_short_convolutions_and_restates_its_dense_layers(
        tmp_path):
    """LFM2-MoE: its router picks by sigmoid scores plus a bias its MoE block holds (passed to the router's forward);
    the export's MoE node computes the router's own picks and weights (`experts.BLOCK_BIASED_ROUTERS`), within 1e-4
    of PyTorch in the prefill graph (LFM2's test decodes its short convolutions' states, GLM-4.5's a node of routes
    given). The first layer's dense FFN is pruned as a dense family's; removing it restates num_dense_layers; uniform
    widths go to a config transformers loads alone."""
    from compressor.transformer.adapters import adapter_for, check_config, dense_ffn_layers
    from compressor.transformer.experts import _route, experts_as_operator
    from compressor.transformer.pipeline import resize_transformer
    from compressor.transformer.surgery import remove_layers
    from exporters.onnx import Float16

    model = MOE_EXTRA["lfm2_moe"]()
    check_config({**model.config.to_dict(), "model_type": "lfm2_moe"}, "m")
    assert dense_ffn_layers(model.config) == [True, False, False]
    assert adapter_for(model).at(layers(model)[0]).down == "feed_forward.w2"
    block = layers(model)[1].feed_forward
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))
    _, _, with_bias = _route(block, block.gate, x)
    assert not torch.equal(with_bias, block.gate(x, torch.zeros(4))[2])  # the drawn bias moves some tokens' picks
    feed = example_inputs(model, batch=2, length=9)
    expected = first_output(model, feed)
    with experts_as_operator(model):
        torch.testing.assert_close(first_output(model, feed), expected, rtol=1e-5, atol=1e-6)

    data = [example_inputs(model, batch=4, length=16, seed=s) for s in range(2)]
    pruned, reports = prune_transformer(model, data, 0.25)
    assert {r.name: r.width_after for r in reports} == {
        "model.layers.0.feed_forward.w2": 15, "model.layers.1.self_attn.out_proj": 3,
        **{f"model.layers.{i}.feed_forward.experts": 24 for i in (1, 2)},
        **{f"model.layers.{i}.conv.out_proj": 24 for i in (0, 2)}}  # the short convolutions' channels
    _exports_decodes_and_reads_half(pruned, tmp_path, decode=False)
    # in float16 the router and its block's bias run in the model's dtype, as transformers runs a half LFM2-MoE
    with torch.no_grad():
        half = Float16(pruned)(**feed).logits
    # (a token whose experts tie within float16's rounding may take others: the mean, not the peak)
    assert half.dtype == torch.float32 and (half - first_output(pruned, feed)).abs().mean() < 1e-3

    plan = {"model.layers.1.self_attn.out_proj": 2, "model.layers.0.feed_forward.w2": 12,
            **{f"model.layers.{i}.feed_forward.experts": 16 for i in (1, 2)},
            **{f"model.layers.{i}.conv.out_proj": 32 for i in (0, 2)}}  # whole: no config key states channels
    resized = resize_transformer(model, plan)
    remove_layers(resized, [0])  # the dense layer: none is left
    assert resized.config.num_dense_layers == 0 and resized.config.layer_types == ["full_attention", "conv"]
    assert save_standard(resized, tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert (config["moe_intermediate_size"], config["num_attention_heads"], config["num_dense_layers"]) == (16, 2, 0)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    torch.testing.assert_close(first_output(reloaded), first_output(resized))


def test_granite_4_h_moe_prunes_experts_and_its_fused_shared_expert_beside_mamba2_mixers(tmp_path):
    """Granite 4.0-H-Tiny's layout: each layer's routed experts (Mixtral's routing) and the fused SwiGLU shared expert
    beside them in the layer (shared_mlp: [gate | up] rows) are pruned as two units, the Mamba2 mixers' heads too; an
    FFN alone is not removed (its shared expert lies outside the MoE block), whole layers are. Exported within 1e-4;
    uniform widths go to a config transformers loads alone."""
    from compressor.errors import UnsupportedArchitecture
    from compressor.transformer.adapters import adapter_for, check_config
    from compressor.transformer.pipeline import resize_transformer
    from compressor.transformer.sublayers import FFN, remove_sublayer
    from compressor.transformer.surgery import remove_layers

    model = MOE_EXTRA["granitemoehybrid:moe"]()
    check_config({**model.config.to_dict(), "model_type": "granitemoehybrid"}, "m")
    assert adapter_for(model).shared_fused_up and adapter_for(model).down == "block_sparse_moe.experts"
    with pytest.raises(UnsupportedArchitecture, match="an FFN alone is not removed"):
        remove_sublayer(model, 1, FFN)
    data = [example_inputs(model, batch=4, length=16, seed=s) for s in range(2)]
    pruned, reports = prune_transformer(model, data, 0.25)
    assert {r.name: r.width_after for r in reports} == {
        "model.layers.1.self_attn.o_proj": 3, "model.layers.0.mamba.out_proj": 3, "model.layers.2.mamba.out_proj": 3,
        **{f"model.layers.{i}.shared_mlp.output_linear": 15 for i in range(3)},
        **{f"model.layers.{i}.block_sparse_moe.experts": 24 for i in range(3)}}
    assert all(layers(pruned)[i].shared_mlp.input_linear.out_features == 30 for i in range(3))
    _exports_decodes_and_reads_half(pruned, tmp_path, decode=False)

    plan = {"model.layers.1.self_attn.o_proj": 2,
            **{f"model.layers.{i}.shared_mlp.output_linear": 12 for i in range(3)},
            **{f"model.layers.{i}.block_sparse_moe.experts": 16 for i in range(3)}}
    resized = resize_transformer(model, plan)
    remove_layers(resized, [2])
    assert save_standard(resized, tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert (config["intermediate_size"], config["shared_intermediate_size"], config["num_attention_heads"],
            config["layer_types"]) == (16, 12, 2, ["linear_attention", "full_attention"])
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    torch.testing.assert_close(first_output(reloaded), first_output(resized))


@pytest.mark.parametrize("name", ["granitemoe", "granitemoeshared"])
def test_granite_3_moe_prunes_its_experts_and_shared_expert_and_reloads_alone(name, tmp_path):
    """Granite 3.x MoE: Granite 4.0-H-Tiny's routed experts (block_sparse_moe) under Llama's attention in every layer,
    granitemoeshared's fused SwiGLU shared expert beside them (an FFN alone then not removed: it lies outside the MoE
    block); heads, experts' and shared neurons pruned, exported and decoded within 1e-4; uniform widths go to a config
    transformers loads alone. A granitemoeshared config building no shared expert is refused, naming granitemoe."""
    from compressor.errors import UnsupportedArchitecture
    from compressor.transformer.adapters import adapter_for, check_config
    from compressor.transformer.pipeline import resize_transformer
    from compressor.transformer.sublayers import FFN, remove_sublayer
    from compressor.transformer.surgery import remove_layers

    model = MOE_EXTRA[name]()
    shared = name == "granitemoeshared"
    check_config({**model.config.to_dict(), "model_type": name}, "m")
    assert adapter_for(model).down == "block_sparse_moe.experts" and adapter_for(model).linear_attention is None
    assert adapter_for(model).ffn_alone is not shared
    if shared:
        with pytest.raises(UnsupportedArchitecture, match="an FFN alone is not removed"):
            remove_sublayer(model, 1, FFN)
        with pytest.raises(UnsupportedArchitecture, match="set model_type granitemoe"):
            check_config({**model.config.to_dict(), "model_type": name, "shared_intermediate_size": 0}, "m")
    data = [example_inputs(model, batch=4, length=16, seed=s) for s in range(2)]
    pruned, reports = prune_transformer(model, data, 0.25)
    assert {r.name: r.width_after for r in reports} == {
        **{f"model.layers.{i}.self_attn.o_proj": 3 for i in range(2)},
        **({f"model.layers.{i}.shared_mlp.output_linear": 15 for i in range(2)} if shared else {}),
        **{f"model.layers.{i}.block_sparse_moe.experts": 24 for i in range(2)}}
    _exports_decodes_and_reads_half(pruned, tmp_path, decode=shared)

    plan = {**{f"model.layers.{i}.self_attn.o_proj": 2 for i in range(2)},
            **({f"model.layers.{i}.shared_mlp.output_linear": 12 for i in range(2)} if shared else {}),
            **{f"model.layers.{i}.block_sparse_moe.experts": 16 for i in range(2)}}
    resized = resize_transformer(model, plan)
    remove_layers(resized, [1])
    assert save_standard(resized, tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert (config["intermediate_size"], config["num_attention_heads"], config["num_hidden_layers"]) == (16, 2, 1)
    assert config.get("shared_intermediate_size") == (12 if shared else None)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    torch.testing.assert_close(first_output(reloaded), first_output(resized))
